source .gpujob/common.sh
echo "code $ONENODE_COMMIT"
# issue 43: int8 moments at 1 x 4096 (compiled blocks + CUDA graphs) before f61ba00 (bucketize's binary search in the
# encode) and after (the map's formula), float32 beside them; then the compiled int8 update against eager on CUDA
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
for run in before:$P/.cache/before/tree:int8 after:$S:int8 after:$S:float32; do IFS=: read n t m <<< "$run"; (cd $t && wall $n-$m env PYTHONPATH=starter_code timeout 170 python3 -m onenode.cli bench $B \
    --set optimizer.moments=$m --out $OUT/m-$n-$m.json > $OUT/m-$n-$m-table.log 2>&1; grep -E "^(tokens/s|step time|MFU|peak|launches|kernel mix)" $OUT/m-$n-$m-table.log; grep -A5 "top kernels" $OUT/m-$n-$m-table.log); done 2>&1 | tee $OUT/moments.log
python3 -c "
import json; a=json.load(open('$OUT/m-before-int8.json'))['steps']['losses']; b=json.load(open('$OUT/m-after-int8.json'))['steps']['losses']
print('losses before', a); print('losses after ', b); print('bit for bit:', a == b)" | tee -a $OUT/moments.log
wall int8-check env PYTHONPATH=$S/starter_code timeout 200 python3 benchmarks/int8_update_check.py $OUT/int8-update-check.json 2>&1 | tail -5 | tee -a $OUT/moments.log
