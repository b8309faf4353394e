# the deterministic mode's reduction configs: inductor picks one config a reduction without benchmarking under torch's
# deterministic algorithms (triton_heuristics' filter); the torch scan's two per-row sums over head_dim took 5.3 ms
# against 1.1 each in the A2 baseline's step (jobY). The bound: the same step with that filter off (its env switch)
source .gpujob/common.sh > $OUT/common-z.log 2>&1
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
run() { local name=$1 need=$2 dir=$3; shift 3; case " $DONE " in *" $name "*) return;; esac; if [ $(left) -gt $need ]; then
  (cd $dir && wall $name env PYTHONPATH=starter_code timeout $(( $(left) < 150 ? $(left) : 150 )) "$@" --out $OUT/$name.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
  else echo "SKIP $name ($(left) s left)" >> $OUT/tables.log; fi; }
A="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=8 --set train.micro_batch_size=4 --steps 8 --warmup 3 --quiet --attention-kernel flex \
   --set train.deterministic=true --profile /tmp/p --top-kernels 80"
run det-flex-filtered 60 $S python3 -m onenode.cli bench $A
run det-flex-benchmarked 40 $S env TORCHINDUCTOR_WRITE_ARE_DETERMINISTIC_ALGORITHMS_ENABLED=0 python3 -m onenode.cli bench $A
grep -E "WALL|SKIP|rror" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
