source .gpujob/common.sh
# issue 43: the int8 kernel's tiles and warps, few elements a thread (fewer registers, more programs in flight)
(cd $S && wall configs env PYTHONPATH=starter_code timeout 240 python3 $P/benchmarks/int8_kernel_configs.py $OUT/int8-kernel-configs-2.json --configs 1x1 1x2 1x4 2x4 2x8 4x16 1x8)
