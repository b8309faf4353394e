source .gpujob/common.sh
python3 -c "import mamba_ssm.utils.determinism as d; print('mamba_ssm determinism module ok')" 2>&1 | tail -1
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --steps 6 --warmup 3 --quiet"
cd $S
for run in mamba_ssm:true:a torch:true:a mamba_ssm:true:b; do
  IFS=: read k d rep <<< "$run"; name=a2-$k-det-$d-$rep
  wall $name env PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench $R --set model.mamba_kernel=$k \
    --set train.deterministic=$d --out $OUT/$name.json > $OUT/$name-table.log 2>&1
  tail -2 $OUT/$name-table.log
done
(cd $P && wall a2-flex env PYTHONPATH=$S/starter_code timeout 150 python3 benchmarks/step_probes.py flex-attention --mask-len 4096 -- $R \
  --set model.mamba_kernel=mamba_ssm --set train.deterministic=true --out $OUT/a2-flex-mamba_ssm-det-true-a.json > $OUT/a2-flex-table.log 2>&1)
tail -2 $OUT/a2-flex-table.log
for run in mamba_ssm:false:a torch:false:a; do
  IFS=: read k d rep <<< "$run"; name=a2-$k-det-$d-$rep
  wall $name env PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench $R --set model.mamba_kernel=$k \
    --set train.deterministic=$d --out $OUT/$name.json > $OUT/$name-table.log 2>&1
  tail -2 $OUT/$name-table.log
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/a2-*.json")):
    d = json.load(open(f)); print(os.path.basename(f), round(d["results"]["tokens_per_s"]), d["results"].get("mfu"), d["steps"]["losses"][-3:])
PY
