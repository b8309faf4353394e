# The fused update's host work cut (e52d4b5: members unflattened for the kernel, offsets over all tensors at once):
# the kernel's GPU tests and the overlap's; the unpatched starter's accumulated step fused and not (4,007 against
# 4,342 tokens/s before, one H100); the solution at 1 x 4096 with CUDA graphs (60,906 fused before, ab-graphs.json).
source .gpujob/common.sh > $OUT/common-t.log 2>&1
: wall gpu-tests env PYTHONPATH=starter_code timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_adamw_kernel.py tests/test_bench.py -k "cuda or update_overlap" > $OUT/gpu-tests.log 2>&1
for f in true false; do
  wall starter-accumulated-fused-$f env PYTHONPATH=starter_code timeout 80 python3 -m onenode.cli bench --preset a1-1gpu --seq-len 4096 --micro-batch 1 \
    --set train.global_batch_size=2 --steps 4 --warmup 2 --quiet --set train.fused_update=$f --out $OUT/starter-accumulated-fused-$f.json > $OUT/starter-$f.log 2>&1
done
cd $S
wall solution-one-seq env PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench --preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 6 --warmup 4 \
  --compile blocks --mamba-kernel mamba_ssm --cuda-graphs --quiet --out $OUT/solution-one-seq.json > $OUT/solution-one-seq.log 2>&1
cd $P
python3 .gpujob/summary.py
