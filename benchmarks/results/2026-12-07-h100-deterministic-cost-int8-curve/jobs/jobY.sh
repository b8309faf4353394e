# after jobX on the same machine: FlexAttention without the mode, and the mode's cost on the baseline's step profiled
source .gpujob/common.sh > $OUT/common-y.log 2>&1
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
run() { local name=$1 need=$2 dir=$3; shift 3; case " $DONE " in *" $name "*) return;; esac; if [ $(left) -gt $need ]; then
  (cd $dir && wall $name env PYTHONPATH=starter_code timeout $(( $(left) < 150 ? $(left) : 150 )) "$@" --out $OUT/$name.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
  else echo "SKIP $name ($(left) s left)" >> $OUT/tables.log; fi; }
A="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=8 --set train.micro_batch_size=4 --steps 8 --warmup 3 --quiet"
run base-det-false-flex 50 $S python3 -m onenode.cli bench $A --set train.deterministic=false --attention-kernel flex
run prof-det-true-flex 60 $S python3 -m onenode.cli bench $A --set train.deterministic=true --attention-kernel flex --profile /tmp/p1 --top-kernels 80
run prof-det-false-sdpa 60 $S python3 -m onenode.cli bench $A --set train.deterministic=false --profile /tmp/p2 --top-kernels 80
grep -E "WALL|SKIP|rror" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
