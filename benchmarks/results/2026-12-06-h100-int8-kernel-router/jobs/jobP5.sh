source .gpujob/common.sh
python3 -m pip install -q --no-index --no-deps dist/*.whl 2>&1 | tail -2
# issue 43: the int8 kernel with the map's formula (two gathers a code, not eight): its tests on CUDA, its tile sizes
# timed alone over a1-1gpu's parameters, then the bench at 1 x 4096 (int8, float32)
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
(cd $S && PYTHONPATH=starter_code timeout 200 python3 -m pytest -q -p no:cacheprovider $P/tests/test_adamw_kernel.py -k "cuda or bucketize" 2>&1 | tail -3)
(cd $S && wall configs env PYTHONPATH=starter_code timeout 240 python3 $P/benchmarks/int8_kernel_configs.py $OUT/int8-kernel-configs.json)
cd $S
wall f-int8 env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --set optimizer.moments=int8 --top-kernels 40 --out $OUT/f-int8.json > $OUT/f-int8-table.log 2>&1
wall f-float32 env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --set optimizer.moments=float32 --top-kernels 40 --out $OUT/f-float32.json > $OUT/f-float32-table.log 2>&1
grep -hE "^(tokens/s|MFU|step time)|WALL" $OUT/*-table.log
grep -A4 "top kernels" $OUT/f-int8-table.log
