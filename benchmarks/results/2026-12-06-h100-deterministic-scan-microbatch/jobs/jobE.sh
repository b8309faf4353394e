source .gpujob/common.sh > $OUT/common.log 2>&1
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.compile=true --steps 12 --warmup 3 --quiet"
for run in mamba_ssm:true:8 torch:true:8 mamba_ssm:false:8; do
  IFS=: read k d mb <<< "$run"; name=e-$k-det-$d-mb$mb
  (cd $S && wall $name env PYTHONPATH=starter_code timeout 100 python3 -m onenode.cli bench $R --set train.micro_batch_size=$mb \
    --set model.mamba_kernel=$k --set train.deterministic=$d --out $OUT/$name.json >> $OUT/tables.log 2>&1)
done
(cd $S && wall f-kernels env PYTHONPATH=starter_code timeout 120 python3 -m onenode.cli bench $R --set train.micro_batch_size=4 \
  --set train.deterministic=true --profile /tmp/prof --profile-steps 1 --top-kernels 80 --out $OUT/f-torch-det-kernels.json >> $OUT/tables.log 2>&1)
grep -E "WALL|Error|error" $OUT/tables.log | tail -8
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    d = json.load(open(f)); print(os.path.basename(f), round(d["results"]["tokens_per_s"]), d["results"].get("mfu"), d["results"].get("peak_memory_gib"), d["steps"]["losses"][-2:])
PY
