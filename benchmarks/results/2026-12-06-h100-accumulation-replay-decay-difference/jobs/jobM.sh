# 0e's last line: the unpatched starter with int8 moments; the peer and the kit at 2 x 4096 (the ratio's target: 20x)
source .gpujob/common.sh > $OUT/common.log 2>&1
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet"
wall starter-int8 env PYTHONPATH=starter_code timeout 300 python3 -m onenode.cli bench $B --set optimizer.moments=int8 --out $OUT/starter-int8.json >> $OUT/tables.log 2>&1
C="--preset a1-1gpu --seq-len 4096 --micro-batch 2 --steps 6 --warmup 2 --quiet"
(cd $S && wall peer-mb2 env PYTHONPATH=starter_code timeout 100 python3 -m onenode.cli bench $C --impl transformers --out $OUT/peer-mb2.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
(cd $S && wall kit-mb2 env PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench $C --compile blocks --cuda-graphs --mamba-kernel mamba_ssm --out $OUT/kit-mb2.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
grep -E "WALL|Error|error" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
