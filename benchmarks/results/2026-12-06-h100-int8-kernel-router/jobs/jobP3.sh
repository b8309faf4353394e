source .gpujob/common.sh
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
wall int8-check env PYTHONPATH=$S/starter_code timeout 200 python3 benchmarks/int8_update_check.py $OUT/int8-update-check.json > $OUT/int8-check.log 2>&1
cd $S
wall m-int8-kernels env PYTHONPATH=starter_code timeout 300 python3 -m onenode.cli bench $B --set optimizer.moments=int8 --top-kernels 40 --out $OUT/m-int8-kernels.json > $OUT/m-int8-kernels-table.log 2>&1
tail -5 $OUT/int8-check.log
grep -hE "^(tokens/s|MFU)|WALL" $OUT/*-table.log
