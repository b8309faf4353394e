source .gpujob/common.sh
echo "code $ONENODE_COMMIT"
# the deterministic mode after 23e9ea4 run to run (compiled, twice more), and eager before against after
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --steps 4 --warmup 2 --quiet --set train.deterministic=true"
for run in after:$S:true:1 after:$S:true:2 before:$P/.cache/before/tree:false:0 after:$S:false:0; do IFS=: read n t c k <<< "$run"; (cd $t && wall $n-compile-$c-$k env PYTHONPATH=starter_code timeout 150 \
    python3 -m onenode.cli bench $R --set train.compile=$c --out $OUT/det-$n-compile-$c-$k.json > /tmp/det-$n-$c-$k.log 2>&1; grep -E "^tokens/s" /tmp/det-$n-$c-$k.log; tail -1 /tmp/det-$n-$c-$k.log); done 2>&1 | tee $OUT/repeat.log
python3 - <<PY | tee -a $OUT/repeat.log
import json
L = lambda f: json.load(open("$OUT/" + f))["steps"]["losses"]
first = json.load(open("$OUT/a2-after-det-true.json"))["steps"]["losses"][:6] if False else None
a, b = L("det-after-compile-true-1.json"), L("det-after-compile-true-2.json")
print("compiled, after, run 1 vs run 2 bit for bit:", a == b, a)
c, d = L("det-before-compile-false-0.json"), L("det-after-compile-false-0.json")
print("eager, before vs after bit for bit:", c == d, c, d)
PY
