source .gpujob/common.sh
python3 -m pip install -q --no-index --no-deps dist/*.whl 2>&1 | tail -2
# issue 43: int8 moments through adamw_kernel's int8 kernel (one pass), against float32, a1-1gpu 1 x 4096
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
(cd $S && PYTHONPATH=starter_code timeout 200 python3 -m pytest -q -p no:cacheprovider $P/tests/test_adamw_kernel.py -k cuda 2>&1 | tail -4)
cd $S
wall k-int8 env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --set optimizer.moments=int8 --top-kernels 40 --out $OUT/k-int8.json > $OUT/k-int8-table.log 2>&1
wall k-float32 env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --set optimizer.moments=float32 --top-kernels 40 --out $OUT/k-float32.json > $OUT/k-float32-table.log 2>&1
grep -hE "^(tokens/s|MFU)|WALL" $OUT/*-table.log
grep -A8 "top kernels" $OUT/k-int8-table.log
