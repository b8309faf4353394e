source .gpujob/common.sh > $OUT/common.log 2>&1
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true --steps 12 --warmup 3 --quiet"
for run in torch:false:8:8 mamba_ssm:true:8:8 mamba_ssm:true:16:16; do
  IFS=: read k d mb gb <<< "$run"; name=g-$k-det-$d-mb$mb
  (cd $S && wall $name env PYTHONPATH=starter_code timeout 100 python3 -m onenode.cli bench $R --set train.global_batch_size=$gb \
    --set train.micro_batch_size=$mb --set model.mamba_kernel=$k --set train.deterministic=$d --out $OUT/$name.json >> $OUT/tables.log 2>&1)
done
grep -E "WALL|Error" $OUT/tables.log | tail -8
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    d = json.load(open(f)); print(os.path.basename(f), round(d["results"]["tokens_per_s"]), d["results"].get("mfu"), d["results"].get("peak_memory_gib"), d["steps"]["losses"][-2:])
PY
