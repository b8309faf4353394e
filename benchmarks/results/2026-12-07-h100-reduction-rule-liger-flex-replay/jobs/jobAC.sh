# 0t: liger-kernel's fused linear cross-entropy against the kit's chunked head at the best layout, one job
source .gpujob/common.sh > $OUT/common-ac.log 2>&1
wall gpu-tests env PYTHONPATH=starter_code timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_bench.py -k liger > $OUT/gpu-tests.log 2>&1; tail -2 $OUT/gpu-tests.log
MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? 24 : 8}')
B="--preset a1-1gpu --seq-len 4096 --micro-batch $MB --steps 5 --warmup 3 --compile blocks --mamba-kernel mamba_ssm --quiet"
(cd $S && wall best-liger env PYTHONPATH=starter_code timeout 200 python3 $P/benchmarks/step_probes.py liger-loss -- $B --profile /tmp/p1 --out $OUT/best-liger.json > $OUT/liger.log 2>&1)
(cd $S && wall best-kit-head env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --profile /tmp/p2 --top-kernels 80 --out $OUT/best-kit-head.json > $OUT/kit.log 2>&1)
python3 .gpujob/summary.py
