# 0q then 0p (benchmarks/README.md): the A2 step at 8 sequences with the deterministic mode and without, and the mode with
# FlexAttention by step_probes.py's probe, in one job; the collector's test; then the solution's 1 x 4096 with CUDA
# graphs at HEAD (the collector left automatic there), the starter's first number, the best layout.
source .gpujob/common.sh > $OUT/common-u.log 2>&1
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
run() { local name=$1 need=$2 dir=$3; shift 3; case " $DONE " in *" $name "*) return;; esac; if [ $(left) -gt $need ]; then
  (cd $dir && wall $name env PYTHONPATH=starter_code timeout $(( $(left) < 150 ? $(left) : 150 )) "$@" --out $OUT/$name.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
  else echo "SKIP $name ($(left) s left)" >> $OUT/tables.log; fi; }
wall gpu-tests env PYTHONPATH=starter_code timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k collector > $OUT/gpu-tests.log 2>&1; tail -2 $OUT/gpu-tests.log
A="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=8 --set train.micro_batch_size=8 --set model.mamba_kernel=mamba_ssm --steps 10 --warmup 3 --quiet"
run det-true-sdpa 60 $S python3 -m onenode.cli bench $A --set train.deterministic=true
run det-false-sdpa 60 $S python3 -m onenode.cli bench $A --set train.deterministic=false
run det-true-flex 60 $S python3 $P/benchmarks/step_probes.py flex-attention --mask-len 4096 -- $A --set train.deterministic=true \
  --profile /tmp/prof --top-kernels 40
run one-seq-graphs 80 $S python3 -m onenode.cli bench --preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 6 --warmup 4 \
  --compile blocks --mamba-kernel mamba_ssm --cuda-graphs --quiet
run first-starter 120 $P python3 -m onenode.cli bench --preset a1-1gpu --seq-len 4096 --steps 10 --warmup 3 --measure-ceiling --profile /tmp/prof-first
MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? 24 : 8}')
run best-mb$MB 100 $S python3 -m onenode.cli bench --preset a1-1gpu --seq-len 4096 --micro-batch $MB --steps 5 --warmup 3 \
  --compile blocks --mamba-kernel mamba_ssm --quiet
grep -E "WALL|SKIP|rror" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
