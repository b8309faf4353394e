source .gpujob/common.sh
# issue 43, an experiment: the int8 kernel with its encode's division by each block's scale as a product with its
# reciprocal, and the formula's divisions as products (.cache/patched2), against the kernel as committed (cb8ca54)
S2=$(ls -d $PWD/.cache/patched2/submission-* | head -1)
(cd $S && wall configs-committed env PYTHONPATH=starter_code timeout 200 python3 $P/benchmarks/int8_kernel_configs.py $OUT/configs-committed.json --configs 16x1x1 16x1x2)
(cd $S2 && wall configs-products env PYTHONPATH=starter_code timeout 200 python3 $P/benchmarks/int8_kernel_configs.py $OUT/configs-products.json --configs 16x1x1 16x1x2)
