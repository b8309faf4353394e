source .gpujob/common.sh
# issue 43: int8 moments 4.2x slower than float32 at 1 x 4096 on 2026-12-06: where the time goes (profile), with and
# without CUDA graphs, and recompiles
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 6 --warmup 3 --compile blocks --quiet --profile /tmp/prof --profile-steps 1"
(cd $S && for run in int8:--cuda-graphs int8: float32:--cuda-graphs; do IFS=: read m g <<< "$run"; wall $m$g env TORCH_LOGS=recompiles PYTHONPATH=starter_code timeout 170 python3 -m onenode.cli bench $B $g \
    --set optimizer.moments=$m --out $OUT/m-$m$g.json > $OUT/m-$m$g-table.log 2>&1; grep -E "^(tokens/s|step time|MFU|peak|launches|kernel mix)|Recompil" $OUT/m-$m$g-table.log | head -12; grep -A6 "top kernels" $OUT/m-$m$g-table.log; done) 2>&1 | tee $OUT/moments.log
