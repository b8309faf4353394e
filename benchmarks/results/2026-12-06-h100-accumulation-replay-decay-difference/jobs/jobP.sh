# 0b: the solution at 1 x 4096 under CUDA graphs, the torch scan and mamba_ssm's (beside jobO's peer on this machine)
source .gpujob/common.sh > $OUT/common.log 2>&1
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet"
for k in torch mamba_ssm; do
  (cd $S && wall kit-mb1-$k env PYTHONPATH=starter_code timeout 110 python3 -m onenode.cli bench $B --mamba-kernel $k --out $OUT/kit-mb1-$k.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
done
grep -E "WALL|tokens/s|MFU|peak|rror" $OUT/tables.log | tail -12
