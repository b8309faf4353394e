source .gpujob/common.sh > $OUT/common.log 2>&1
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --steps 15 --warmup 3 --quiet"
for run in sdpa:torch:true flex:torch:true flex:mamba_ssm:true sdpa:torch:false sdpa:mamba_ssm:true; do
  IFS=: read a k d <<< "$run"; name=d-$a-$k-det-$d; probe=""; [ $a = flex ] && probe="flex-attention --mask-len 4096"
  [ $a = flex ] && cmd="benchmarks/step_probes.py $probe --" || cmd="-m onenode.cli bench"
  wall $name env PYTHONPATH=$S/starter_code timeout 110 python3 $cmd $R --set model.mamba_kernel=$k --set train.deterministic=$d \
    --out $OUT/$name.json >> $OUT/tables.log 2>&1
done
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet"
for m in float32 int8; do
  (cd $S && wall m-$m env PYTHONPATH=starter_code timeout 100 python3 -m onenode.cli bench $B --set optimizer.moments=$m --out $OUT/m-$m.json >> $OUT/tables.log 2>&1)
done
grep -E "WALL" $OUT/tables.log
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    d = json.load(open(f)); print(os.path.basename(f), round(d["results"]["tokens_per_s"]), d["results"].get("mfu"), d["results"].get("peak_memory_gib"), d["steps"]["losses"][-2:])
PY
