source .gpujob/common.sh
echo "code $ONENODE_COMMIT"
# issue 41: the A2 baseline's model compiled, one GPU, 8 x 4096 a step (two micro-batches of 4): default kernels
# against the deterministic mode graded runs use, each profiled
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --steps 6 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1"
(cd $S && for d in false true; do wall a2-det-$d env PYTHONPATH=starter_code timeout 280 python3 -m onenode.cli bench $R \
    --set train.deterministic=$d --out $OUT/a2-deterministic-$d.json > /tmp/a2-det-$d.log 2>&1; grep -E "^(tokens/s|MFU|step time|peak|kernel mix|launches)" /tmp/a2-det-$d.log; \
    tail -1 /tmp/a2-det-$d.log; done) 2>&1 | tee $OUT/a2-deterministic.log
cp /tmp/a2-det-true.log $OUT/a2-deterministic-true-table.log; cp /tmp/a2-det-false.log $OUT/a2-deterministic-false-table.log
