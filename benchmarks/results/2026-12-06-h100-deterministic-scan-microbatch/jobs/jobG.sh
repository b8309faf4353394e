source .gpujob/common.sh > $OUT/common.log 2>&1
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true --steps 12 --warmup 3 --quiet --set train.global_batch_size=8 --set train.micro_batch_size=8 --set model.mamba_kernel=mamba_ssm --set train.deterministic=true"
for rep in a b; do
  (cd $S && wall h-autotuned-$rep env TRITON_CACHE_AUTOTUNING=1 PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench $R --out $OUT/h-mamba_ssm-det-true-mb8-autotuned-$rep.json >> $OUT/tables.log 2>&1)
done
grep -E "WALL|Error" $OUT/tables.log | tail -8
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    d = json.load(open(f)); print(os.path.basename(f), round(d["results"]["tokens_per_s"]), d["results"].get("mfu"), d["results"].get("peak_memory_gib"), d["steps"]["losses"][-2:])
PY
