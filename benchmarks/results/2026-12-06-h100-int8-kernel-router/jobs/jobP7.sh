source .gpujob/common.sh
python3 -m pip install -q --no-index --no-deps dist/*.whl 2>&1 | tail -2
# issue 43: the int8 kernel looping over its blocks (tables read once per 16 blocks); configs alone, then the bench
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
(cd $S && PYTHONPATH=starter_code timeout 200 python3 -m pytest -q -p no:cacheprovider $P/tests/test_adamw_kernel.py -k "cuda or bucketize" 2>&1 | tail -2)
(cd $S && wall configs env PYTHONPATH=starter_code timeout 240 python3 $P/benchmarks/int8_kernel_configs.py $OUT/int8-kernel-configs-3.json)
cd $S
wall g-int8 env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --set optimizer.moments=int8 --top-kernels 40 --out $OUT/g-int8.json > $OUT/g-int8-table.log 2>&1
grep -hE "^(tokens/s|MFU|step time|peak)|WALL" $OUT/*-table.log
grep -A3 "top kernels" $OUT/g-int8-table.log
