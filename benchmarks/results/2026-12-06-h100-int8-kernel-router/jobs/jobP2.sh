source .gpujob/common.sh
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --set train.deterministic=false --steps 6 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1"
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
cd $S
wall a2-router-f32 env PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench $R --top-kernels 80 --out $OUT/a2-router-f32.json > $OUT/a2-router-f32-table.log 2>&1
wall a2-router-bf16 env PYTHONPATH=starter_code timeout 150 python3 $P/benchmarks/step_probes.py router-bf16-gemm -- $R --top-kernels 80 --out $OUT/a2-router-bf16.json > $OUT/a2-router-bf16-table.log 2>&1
wall b-router-bf16 env PYTHONPATH=starter_code timeout 150 python3 $P/benchmarks/step_probes.py router-bf16-gemm -- $B --out $OUT/b-router-bf16.json > $OUT/b-router-bf16-table.log 2>&1
grep -hE "^(tokens/s|MFU)|WALL|loss" $OUT/*-table.log
