# 0i: the torch scan's decays by difference against the kit's, deterministic and default, in the A2 step
source .gpujob/common.sh > $OUT/common.log 2>&1
D="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=8 --set train.micro_batch_size=4 --steps 10 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1 --top-kernels 80"
for d in true false; do
  (cd $S && wall segsum-det-$d env PYTHONPATH=starter_code timeout 130 python3 -m onenode.cli bench $D --set train.deterministic=$d \
     --out $OUT/segsum-det-$d.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
  wall difference-det-$d env PYTHONPATH=$S/starter_code timeout 130 python3 benchmarks/step_probes.py ssd-decay-difference -- $D \
     --set train.deterministic=$d --out $OUT/difference-det-$d.json >> $OUT/tables.log 2>&1
done
grep -E "WALL|Error|error" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
