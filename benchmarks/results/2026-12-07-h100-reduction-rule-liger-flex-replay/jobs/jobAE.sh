# the deterministic mode's tiled reductions: the kit's largest-tile rule against inductor's own and the timed bound,
# on the A2 baseline's compiled step (torch scan, 2 x 4, flex and SDPA), the mode off beside; then the grader's
# replay of a compiled deterministic run (the rule in every span). One archive back.
source .gpujob/common.sh > $OUT/common-ae.log 2>&1
export ONENODE_CACHE=$PWD/.cache/onenode
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
run() { local name=$1 need=$2; shift 2; if [ $(left) -gt $need ]; then
  (cd $S && wall $name env PYTHONPATH=starter_code timeout $(( $(left) < 200 ? $(left) : 200 )) "$@" --out $OUT/$name.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
  else echo "SKIP $name ($(left) s left)" >> $OUT/tables.log; fi; }
A="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=8 --set train.micro_batch_size=4 --steps 8 --warmup 3 --quiet"
run det-flex-kit-rule 60 python3 -m onenode.cli bench $A --set train.deterministic=true --attention-kernel flex --profile /tmp/p1 --top-kernels 80
run det-flex-inductors-rule 60 python3 $P/benchmarks/step_probes.py inductors-reduction-rule -- $A --set train.deterministic=true --attention-kernel flex --profile /tmp/p2
run det-flex-bound 60 python3 $P/benchmarks/step_probes.py reductions-benchmarked -- $A --set train.deterministic=true --attention-kernel flex
run nondet-flex 60 python3 -m onenode.cli bench $A --set train.deterministic=false --attention-kernel flex
run det-sdpa-kit-rule 60 python3 -m onenode.cli bench $A --set train.deterministic=true
run nondet-sdpa 60 python3 -m onenode.cli bench $A --set train.deterministic=false
grep -E "WALL|SKIP|rror" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
dpkg -x .debs/bubblewrap_0.8.0-2+deb12u1_amd64.deb / && bwrap --version > /dev/null
if [ $(left) -gt 190 ]; then wall a2-compiled timeout $(left) python3 benchmarks/a2_verification.py $OUT/a2-compiled honest --only deterministic-compiled-every-4 > $OUT/a2-compiled.log 2>&1; tail -3 $OUT/a2-compiled.log; else echo "SKIP a2-compiled ($(left) s left)"; fi
cd $OUT && tar czf /tmp/ae.tgz . && find . -mindepth 1 -delete && mv /tmp/ae.tgz $OUT/
