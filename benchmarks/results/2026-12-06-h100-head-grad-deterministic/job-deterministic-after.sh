source .gpujob/common.sh
echo "code $ONENODE_COMMIT"
# issue 41: the A2 baseline's model compiled, one GPU, 8 x 4096 a step: deterministic before (index sorts, NaN fills) and
# after, their losses compared bit for bit, then the default kernels after
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --steps 6 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1"
for run in before:$P/.cache/before/tree:true after:$S:true after:$S:false; do IFS=: read n t d <<< "$run"; (cd $t && wall a2-$n-det-$d env PYTHONPATH=starter_code timeout 200 \
    python3 -m onenode.cli bench $R --set train.deterministic=$d --out $OUT/a2-$n-det-$d.json > /tmp/a2-$n-$d.log 2>&1; grep -E "^(tokens/s|MFU|launches|kernel mix)" /tmp/a2-$n-$d.log; \
    grep -E "indexing_backward|FillFunctor|flash_bwd" /tmp/a2-$n-$d.log | head -3); done 2>&1 | tee $OUT/a2-deterministic.log
cp /tmp/a2-after-true.log $OUT/a2-after-det-true-table.log
python3 -c "
import json; a=json.load(open('$OUT/a2-before-det-true.json'))['steps']['losses']; b=json.load(open('$OUT/a2-after-det-true.json'))['steps']['losses']
print('losses before', a); print('losses after ', b); print('bit for bit:', a == b)" | tee -a $OUT/a2-deterministic.log
# issue 43: int8 moments against float32 at 1 x 4096 (compiled blocks + CUDA graphs)
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet"
(cd $S && for m in int8 float32; do wall $m-1x4096 env PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench $B \
    --set optimizer.moments=$m --out $OUT/m-$m.json 2>&1 | grep -E "^(tokens/s|MFU|step time|peak|WALL)"; done) 2>&1 | tee $OUT/moments.log
