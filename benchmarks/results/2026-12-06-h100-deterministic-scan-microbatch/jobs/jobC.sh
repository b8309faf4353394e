source .gpujob/common.sh > $OUT/common.log 2>&1
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --steps 6 --warmup 3 --quiet"
for run in mamba_ssm:true:b torch:true:a torch:false:a; do
  IFS=: read k d rep <<< "$run"; name=a2-flex-$k-det-$d-$rep
  wall $name env PYTHONPATH=$S/starter_code timeout 120 python3 benchmarks/step_probes.py flex-attention --mask-len 4096 -- $R \
    --set model.mamba_kernel=$k --set train.deterministic=$d --out $OUT/$name.json >> $OUT/tables.log 2>&1
done
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet"
wall tests env PYTHONPATH=starter_code timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_adamw_kernel.py -k "cuda or bucketize" >> $OUT/tables.log 2>&1
(cd $S && wall m-int8 env PYTHONPATH=starter_code timeout 170 python3 -m onenode.cli bench $B --set optimizer.moments=int8 --out $OUT/m-int8.json >> $OUT/tables.log 2>&1)
grep -E "passed|failed|WALL" $OUT/tables.log
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    d = json.load(open(f)); print(os.path.basename(f), round(d["results"]["tokens_per_s"]), d["results"].get("mfu"), d["steps"]["losses"][-3:])
PY
