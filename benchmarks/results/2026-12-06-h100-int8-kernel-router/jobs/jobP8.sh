source .gpujob/common.sh
# issue 43: the moments at 1 x 4096 in one job with the int8 kernel's chosen tiles (16 blocks a program, one at a time,
# one warp): int8, bfloat16, float32
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
cd $S
for m in int8 bfloat16 float32; do
wall h-$m env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --set optimizer.moments=$m --top-kernels 40 --out $OUT/h-$m.json > $OUT/h-$m-table.log 2>&1
done
grep -hE "^(tokens/s|MFU|step time|peak)|WALL" $OUT/*-table.log
for m in int8 bfloat16 float32; do grep -A3 "top kernels" $OUT/h-$m-table.log | tail -1; done
