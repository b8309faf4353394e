# issue 41: why the overlapped update was no faster at 1 x 4096 (0.960x on one H100, 2026-12-07): the A/B again with
# CUDA graphs and without (no gradient clones), each followed by profiled steps of each kind (--trace-steps 2).
source .gpujob/common.sh > $OUT/common-p.log 2>&1
L1="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 6 --warmup 4 --compile blocks --mamba-kernel mamba_ssm"
cd $S
wall ab-graphs env PYTHONPATH=starter_code timeout 200 python3 $P/benchmarks/update_overlap.py --rounds 2 --trace-steps 2 --out $OUT/ab-graphs.json -- $L1 --cuda-graphs > $OUT/ab-graphs.log 2>&1
tail -2 $OUT/ab-graphs.log
wall ab-eager-launch env PYTHONPATH=starter_code timeout 200 python3 $P/benchmarks/update_overlap.py --rounds 2 --trace-steps 2 --out $OUT/ab-nographs.json -- $L1 > $OUT/ab-nographs.log 2>&1
tail -2 $OUT/ab-nographs.log
cd $P
python3 - <<'PY'
import json, os
for n in ("ab-graphs", "ab-nographs"):
    try:
        r = json.load(open(f"{os.environ['OUT']}/{n}.json"))
    except Exception as e:
        print(n, "unreadable", e); continue
    print(n, [(x["overlapped"], round(x["tokens_per_s"])) for x in r["rounds"]], round(r["overlapped_over_fused"], 3))
    for kind, s in (r.get("streams") or {}).items():
        print("  ", kind, {k: round(v * 1e3, 2) if k.endswith("_s") else v for k, v in s.items()})
PY
