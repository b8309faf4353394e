# issue 41: the fused update overlapped with the next forward (benchmarks/update_overlap.py) against the fused update
# as it is, by turns in one process, a1-1gpu at 1 x 4096 with compiled blocks, mamba_ssm's scan and CUDA graphs; its
# GPU test first; then jobA with what is left of BUDGET.
source .gpujob/common.sh > $OUT/common-o.log 2>&1
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
L1="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 6 --warmup 4 --compile blocks --mamba-kernel mamba_ssm --cuda-graphs"
wall overlap-test env PYTHONPATH=starter_code timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_bench.py -k update_overlap > $OUT/overlap-test.log 2>&1; tail -3 $OUT/overlap-test.log
cd $S
wall overlap-ab env PYTHONPATH=starter_code timeout 220 python3 $P/benchmarks/update_overlap.py --rounds 3 --out $OUT/overlap-ab.json -- $L1 > $OUT/overlap.log 2>&1
tail -4 $OUT/overlap.log
cd $P
python3 -c "
import json, os; r = json.load(open(os.environ['OUT'] + '/overlap-ab.json'))
print([(x['overlapped'], round(x['tokens_per_s']), x['units_queued']) for x in r['rounds']], r['overlapped_over_fused'])" 2>&1 | tail -1
BUDGET=$(left) bash .gpujob/jobA.sh
# the compile cache back, for the next call's warm-ups (one file, at most 15 MiB)
(cd /tmp && tar czf $OUT/inductor-cache.tgz torchinductor_$(whoami)) && ls -la $OUT/inductor-cache.tgz
[ $(stat -c %s $OUT/inductor-cache.tgz) -lt 15000000 ] || rm -f $OUT/inductor-cache.tgz
ls $OUT
