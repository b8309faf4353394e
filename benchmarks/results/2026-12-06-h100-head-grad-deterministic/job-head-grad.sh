source .gpujob/common.sh
echo "code $ONENODE_COMMIT"
# the head's weight gradient accumulated inside the GEMM: its GPU test, then the best layout before and after
wall gpu-test env PYTHONPATH=$S/starter_code timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -k "float32_on_a_gpu or chunked_head" 2>&1 | tail -2
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); MB=$([ "$MEM" -gt 100000 ] && echo 24 || echo 10)
L="--preset a1-1gpu --seq-len 4096 --micro-batch $MB --steps 8 --warmup 3 --compile blocks --mamba-kernel mamba_ssm --quiet --profile /tmp/prof --profile-steps 1"
for t in before:$P/.cache/before/tree after:$S; do n=${t%%:*}; (cd ${t#*:} && wall best-$n env PYTHONPATH=starter_code timeout 260 \
    python3 -m onenode.cli bench $L --out $OUT/best-$n.json > /tmp/best-$n.log 2>&1; grep -E "^(tokens/s|MFU|step time|peak|kernel mix|launches)" /tmp/best-$n.log; \
    grep -E "CUDAFunctor_add<float>|logsumexp|gemm" /tmp/best-$n.log | head -4); done 2>&1 | tee $OUT/best.log
cp /tmp/best-after.log $OUT/best-after-table.log
