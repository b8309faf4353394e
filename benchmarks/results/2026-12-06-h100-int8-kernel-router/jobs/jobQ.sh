source .gpujob/common.sh
# issue 41: the SSD's carry across chunks by a recurrence: the scan alone at the A2 baseline's 4 x 4096, then the A2 step
(cd $S && wall ssd env PYTHONPATH=starter_code timeout 120 python3 $P/benchmarks/ssd_probe.py --preset a1-1gpu --batch 4 --seq-len 4096 --out $OUT/ssd-carry.json)
R="--recipe $P/a2_pretrain/recipes/baseline.yaml --set parallel.dp=1 --set parallel.ep=1 --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --set train.deterministic=false --steps 6 --warmup 3 --quiet --profile /tmp/prof --profile-steps 1"
cd $S
wall a2-einsum env PYTHONPATH=starter_code timeout 120 python3 -m onenode.cli bench $R --top-kernels 80 --out $OUT/a2-carry-einsum.json > $OUT/a2-carry-einsum-table.log 2>&1
wall a2-recurrence env PYTHONPATH=starter_code timeout 120 python3 $P/benchmarks/step_probes.py ssd-carry-recurrence -- $R --out $OUT/a2-carry-recurrence.json > $OUT/a2-carry-recurrence-table.log 2>&1
grep -hE "^(tokens/s|MFU|step time)|WALL" $OUT/*-table.log
# issue 43: the int8 kernel's encode with products (S2) against the committed one (S)
S2=$(ls -d $P/.cache/patched2/submission-* | head -1)
(cd $S && wall configs-committed env PYTHONPATH=starter_code timeout 90 python3 $P/benchmarks/int8_kernel_configs.py $OUT/configs-committed.json --configs 16x1x1)
(cd $S2 && wall configs-products env PYTHONPATH=starter_code timeout 90 python3 $P/benchmarks/int8_kernel_configs.py $OUT/configs-products.json --configs 16x1x1)
