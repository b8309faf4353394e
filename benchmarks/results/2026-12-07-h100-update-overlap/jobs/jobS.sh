# The unpatched starter's accumulated step (a parameter per expert matrix, float32 gradients on the masters) was 7.7%
# slower with the fused update than without (4,007 against 4,342 tokens/s, one H100, 2026-12-07): where the time goes,
# kernels (--profile) and the host's Python (cProfile), fused true and false.
source .gpujob/common.sh > $OUT/common-s.log 2>&1
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --set train.global_batch_size=2 --steps 3 --warmup 2 --quiet"
for f in true false; do
  wall starter-fused-$f env PYTHONPATH=starter_code timeout 120 python3 -m cProfile -o $OUT/starter-fused-$f.pstats -m onenode.cli bench $B \
    --set train.fused_update=$f --profile /tmp/prof-$f --profile-steps 1 --top-kernels 30 --out $OUT/starter-fused-$f.json > $OUT/starter-fused-$f.log 2>&1
  tail -1 $OUT/starter-fused-$f.log
done
python3 - <<'PY'
import json, os, pstats
out = os.environ["OUT"]
for f in ("true", "false"):
    try:
        r = json.load(open(f"{out}/starter-fused-{f}.json"))
    except Exception as e:
        print(f, "unreadable", e); continue
    res = r.get("results", r)
    print(f, {k: res.get(k) for k in ("tokens_per_s", "step_s", "kernels_per_step")}, {k: round(v, 3) for k, v in (r.get("kernel_mix") or {}).items()})
    print([(k["name"][:45], round(k["self_s"] * 1e3, 1), k["calls"]) for k in (r.get("top_kernels") or [])[:8]])
    s = pstats.Stats(f"{out}/starter-fused-{f}.pstats"); s.sort_stats("cumulative").print_stats(r"master_update|adamw_kernel|step\.py|optim", 14)
PY
