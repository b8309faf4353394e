source .gpujob/common.sh
echo "code $ONENODE_COMMIT"
# issue 41: the A2 baseline's model compiled, one GPU, 8 x 4096 a step, deterministic: before ea6f64c's counts
# (index_add_ in the balancer: a sort and a serial add each) and after, losses bit for bit; then after on default kernels
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --steps 6 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1"
for run in before:$P/.cache/before/tree:true after:$S:true after:$S:false; do IFS=: read n t d <<< "$run"; (cd $t && wall a2-$n-det-$d env PYTHONPATH=starter_code timeout 200 \
    python3 -m onenode.cli bench $R --set train.deterministic=$d --out $OUT/a2-$n-det-$d.json > $OUT/a2-$n-det-$d-table.log 2>&1; grep -E "^(tokens/s|MFU|launches|kernel mix)" $OUT/a2-$n-det-$d-table.log; \
    grep -E "indexing_backward|flash_bwd" $OUT/a2-$n-det-$d-table.log | head -3); done 2>&1 | tee $OUT/a2-deterministic.log
python3 -c "
import json; a=json.load(open('$OUT/a2-before-det-true.json'))['steps']['losses']; b=json.load(open('$OUT/a2-after-det-true.json'))['steps']['losses']
print('losses before', a); print('losses after ', b); print('bit for bit:', a == b)" | tee -a $OUT/a2-deterministic.log
