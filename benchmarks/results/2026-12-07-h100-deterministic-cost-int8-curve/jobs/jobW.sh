# issue 41's deterministic mode: model.attention_kernel flex (the option, step_probes' probe promoted) at 8 sequences
# with mamba_ssm's scan beside SDPA with the mode and without, in one job; then flex's loss curve on the A2 baseline
# (the recipe's deterministic mode), beside jobV's two SDPA (float32) seeds
source .gpujob/common.sh > $OUT/common-w.log 2>&1
export ONENODE_CACHE=$PWD/.cache/onenode
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
run() { local name=$1 need=$2 dir=$3; shift 3; case " $DONE " in *" $name "*) return;; esac; if [ $(left) -gt $need ]; then
  (cd $dir && wall $name env PYTHONPATH=starter_code timeout $(( $(left) < 150 ? $(left) : 150 )) "$@" --out $OUT/$name.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
  else echo "SKIP $name ($(left) s left)" >> $OUT/tables.log; fi; }
wall gpu-tests env PYTHONPATH=starter_code timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -k flex > $OUT/gpu-tests.log 2>&1; tail -2 $OUT/gpu-tests.log
A="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=8 --set train.micro_batch_size=8 --set model.mamba_kernel=mamba_ssm --steps 10 --warmup 3 --quiet"
run det-true-flex 60 $S python3 -m onenode.cli bench $A --set train.deterministic=true --attention-kernel flex
run det-true-sdpa 60 $S python3 -m onenode.cli bench $A --set train.deterministic=true
run det-false-sdpa 60 $S python3 -m onenode.cli bench $A --set train.deterministic=false
if [ $(left) -gt 150 ]; then
  PYTHONPATH=$S/starter_code timeout $(left) python3 -m onenode.cli train a2_pretrain/recipes/baseline.yaml --out /tmp/curve-flex-seed0 \
   --fresh --set seed=0 --set model.attention_kernel=flex --set data.path=data/default --set parallel.ep=1 \
   --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --set train.token_budget=6553600 \
   --set checkpoint.enabled=false --set checkpoint.export_hf=false --set eval.every_steps=50 --set log.every_steps=5 \
   --set log.tensorboard=false --set log.progress_bar=false > $OUT/curve-flex-0.log 2>&1; echo "WALL curve-flex-0 rc=$? $(( $(date +%s) - T0 )) s"
else echo "SKIP curve-flex-0"; fi
tail -n 2 $OUT/curve-flex-0.log
grep -E "WALL|SKIP|rror" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
