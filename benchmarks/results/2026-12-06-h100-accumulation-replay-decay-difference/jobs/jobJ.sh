# 0g: micro-batches 4 and 8 accumulated at 16 sequences a step, deterministic, each scan; then the tuned bench at 8
source .gpujob/common.sh > $OUT/common.log 2>&1
A="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.compile=true \
   --set train.global_batch_size=16 --set train.deterministic=true --steps 10 --warmup 3 --quiet"
T0=$(date +%s)
for run in mamba_ssm:8 mamba_ssm:4 torch:8 torch:4; do
  name=acc-${run%:*}-${run#*:}
  (cd $S && wall $name env PYTHONPATH=starter_code timeout 115 python3 -m onenode.cli bench $A --set model.mamba_kernel=${run%:*} \
    --set train.micro_batch_size=${run#*:} --out $OUT/$name.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
done
if [ $(( $(date +%s) - T0 )) -lt 440 ]; then
  (cd $S && wall mamba-tuned-mb8 env PYTHONPATH=starter_code timeout 110 python3 -m onenode.cli bench $A --set model.mamba_kernel=mamba_ssm \
    --set train.global_batch_size=8 --set train.micro_batch_size=8 --out $OUT/mamba-tuned-mb8.json >> $OUT/tables.log 2>&1) >> $OUT/tables.log
fi
grep -E "WALL|Error|error" $OUT/tables.log | tail -12
python3 .gpujob/summary.py
