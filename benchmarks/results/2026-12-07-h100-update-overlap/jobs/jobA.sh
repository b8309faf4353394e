# 0k: the fused update over two micro-batches (fused against not) on the solution's A2 step (torch scan, deterministic),
# and on the unpatched starter (a parameter per expert matrix, float32 gradients); the mamba_ssm A2 step's kernels with
# the mode and without (its cost); the torch scan's carry on bf16 operands (step_probes.py ssd-carry-bf16); 0l: the best layout's kernels by name, then 1 x 4096's. Each run only while the
# call has time: BUDGET seconds in all (default 560).
source .gpujob/common.sh > $OUT/common.log 2>&1
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
run() { local name=$1 need=$2 dir=$3; shift 3; case " $DONE " in *" $name "*) return;; esac; if [ $(left) -gt $need ]; then
  (cd $dir && wall $name env PYTHONPATH=starter_code timeout $(( $(left) < 130 ? $(left) : 130 )) "$@" --out $OUT/$name.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
  else echo "SKIP $name ($(left) s left)" >> $OUT/tables.log; fi; }
A="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=8 --steps 10 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1 --top-kernels 80"
MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? 24 : 12}')
L="--preset a1-1gpu --seq-len 4096 --steps 5 --warmup 3 --compile blocks --mamba-kernel mamba_ssm --quiet --profile /tmp/prof --profile-steps 1 --top-kernels 80"
[ -f $OUT/overlap-base.json ] || run one-seq-kernels 60 $S python3 -m onenode.cli bench $L --micro-batch 1 --cuda-graphs
run best-kernels-mb$MB 100 $S python3 -m onenode.cli bench $L --micro-batch $MB
(cd $S && [ $(left) -gt 150 ] && wall best-overlap-mb$MB env PYTHONPATH=starter_code timeout $(( $(left) < 200 ? $(left) : 200 )) python3 $P/benchmarks/update_overlap.py --rounds 2 --out $OUT/best-overlap-mb$MB.json -- --preset a1-1gpu --seq-len 4096 --micro-batch $MB --steps 3 --warmup 3 --compile blocks --mamba-kernel mamba_ssm >> $OUT/tables.log 2>&1)
for d in true false; do
  run mamba-mb8-det-$d 60 $S python3 -m onenode.cli bench $A --set train.deterministic=$d --set train.micro_batch_size=8 --set model.mamba_kernel=mamba_ssm
done
for f in true false; do
  run a2-torch-det-fused-$f 60 $S python3 -m onenode.cli bench $A --set train.deterministic=true --set train.micro_batch_size=4 --set train.fused_update=$f
done
run a2-torch-det-carry-bf16 60 $S python3 $P/benchmarks/step_probes.py ssd-carry-bf16 -- $A --set train.deterministic=true --set train.micro_batch_size=4
for f in true false; do
  run starter-accumulated-fused-$f 45 $P python3 -m onenode.cli bench --preset a1-1gpu --seq-len 4096 --micro-batch 1 \
    --set train.global_batch_size=2 --steps 4 --warmup 2 --quiet --set train.fused_update=$f
done
grep -E "WALL|SKIP|rror" $OUT/tables.log | tail -14
python3 .gpujob/summary.py
python3 - <<'PY'
import glob, json, os
for path in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    r = json.load(open(path))
    if r.get("kernel_mix"):
        print(os.path.basename(path), {k: round(v, 3) for k, v in r["kernel_mix"].items()})
        print([(k["name"][:50], round(k["self_s"] * 1e3, 2), k["calls"]) for k in r["top_kernels"][:10]])
PY
(cd $OUT && tar czf jobA.tgz --remove-files *.json *.log)
