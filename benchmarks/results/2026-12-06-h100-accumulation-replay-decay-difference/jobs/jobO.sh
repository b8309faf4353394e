# the unpatched starter eager, int8 against float32 moments (issue 43); then the peer at 1 x 4096 (issue 41's ratio)
source .gpujob/common.sh > $OUT/common.log 2>&1
E="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 5 --warmup 2 --quiet"
for m in int8 float32; do
  wall starter-eager-$m env PYTHONPATH=starter_code timeout 120 python3 -m onenode.cli bench $E --set optimizer.moments=$m --out $OUT/starter-eager-$m.json >> $OUT/tables.log 2>&1
done
(cd $S && wall peer-mb1 env PYTHONPATH=starter_code timeout 80 python3 -m onenode.cli bench $E --impl transformers --out $OUT/peer-mb1.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
grep -E "WALL|tokens/s|peak|Error|error" $OUT/tables.log | tail -16
python3 .gpujob/summary.py
