source .gpujob/common.sh
# issue 41: the routers' float32 GEMMs (CUDA cores): every kernel of a profiled step (--top-kernels 80), default
# precision against TF32 (step_probes.py tf32), on the A2 baseline's model (8 x 4096, compiled) and a1-1gpu at 1 x 4096
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --set train.deterministic=false --steps 6 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1"
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
cd $S
wall a2-highest env PYTHONPATH=starter_code timeout 150 python3 -m onenode.cli bench $R --top-kernels 80 --out $OUT/a2-highest.json > $OUT/a2-highest-table.log 2>&1
wall a2-tf32 env PYTHONPATH=starter_code timeout 150 python3 $P/benchmarks/step_probes.py tf32 -- $R --out $OUT/a2-tf32.json > $OUT/a2-tf32-table.log 2>&1
wall b-tf32 env PYTHONPATH=starter_code timeout 150 python3 $P/benchmarks/step_probes.py tf32 -- $B --out $OUT/b-tf32.json > $OUT/b-tf32-table.log 2>&1
grep -hE "^(tokens/s|MFU)|f32f32|WALL" $OUT/*-table.log
