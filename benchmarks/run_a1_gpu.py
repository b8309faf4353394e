"""A1 on one H200, side by side in one job: the starter, the reference solution, transformers' peer.

    python3 benchmarks/run_a1_gpu.py OUTDIR                # on the GPU machine, about 5 minutes
    python3 benchmarks/run_a1_gpu.py OUTDIR --traces       # also keep the profiler traces

Every run is `onenode bench` on the `a1-1gpu` preset with the same batch (micro-batch x 4096
tokens, synthetic, seeded) and the same initial weights:

- `starter`: the unpatched `starter_code/` (per-expert loop, torch SSD), eager;
- `solution`: `solutions/a1/submission.patch` applied to a temporary copy, eager;
- `solution-compiled`: the same with `--compile mixers` (Mamba2, attention and MLP mixers under
  torch.compile), the candidate fast Mamba2 path;
- `solution-mamba-ssm`: mamba_ssm's Triton SSD, only where `mamba_ssm` imports;
- `transformers`: transformers' `NemotronHForCausalLM` with `grouped_mm` experts, the peer a
  student would try, loaded with the same weights.

First `ssd_probe.py` times the Mamba2 SSD scan alone (torch eager, torch compiled, mamba_ssm)
and checks each against float64 (OUTDIR/ssd.json). Each run's record (tokens/s, MFU against
989 TFLOP/s and against a measured bf16 matmul, peak memory, losses, top kernels) goes to
OUTDIR/<name>.json; OUTDIR/summary.json holds the
exact commands, the table and the ratios; OUTDIR/log.txt every run's output. The first loss of
every run built from the solution's tree is compared with the solution's: same weights and batch,
so they must agree (the starter initialises its per-expert weights under other names, so its
weights differ and only its speed is compared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT_ROOT / "tests"))
from patched_copy import patched_tree  # noqa: E402  (the kit's helper: solutions/a1 patches on a copy)

LOSS_TOLERANCE = 0.02  # bf16 autocast, different kernels: the first losses agree to about 1e-3


def solution_tree(prebuilt: str | None) -> Path:
    if prebuilt:
        tree = Path(prebuilt)
        if not (tree / "starter_code" / "onenode").is_dir():
            raise SystemExit(f"--solution-tree {tree} holds no starter_code/onenode: build it with --prepare")
        return tree
    try:
        return patched_tree(["submission"])
    except (OSError, RuntimeError) as e:
        raise SystemExit(f"could not apply solutions/a1/submission.patch ({e}): run --prepare where git works "
                         "and pass the printed folder as --solution-tree") from None


def mamba_ssm_imports(env: dict) -> bool:
    probe = "from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0


def bench_env(tree: Path) -> dict:
    cache = KIT_ROOT / ".cache"
    env = dict(os.environ, PYTHONPATH=str(tree / "starter_code"), PYTHONUNBUFFERED="1")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    env.setdefault("HF_HOME", str(cache / "hf"))
    return env


def run_ssd_probe(args, path: Path, log) -> dict:
    """`ssd_probe.py` on the preset's Mamba2 shapes (the starter's scan: the patches leave it)."""
    argv = [sys.executable, str(KIT_ROOT / "benchmarks" / "ssd_probe.py"), "--preset", args.preset,
            "--batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--out", str(path)]
    command = f"cd {KIT_ROOT} && PYTHONPATH=starter_code python3 " + " ".join(argv[1:])
    log.write(f"$ {command}\n")
    log.flush()
    try:
        subprocess.run(argv, env=bench_env(KIT_ROOT), cwd=KIT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                       timeout=args.timeout)
    except subprocess.TimeoutExpired:
        log.write(f"# ssd probe: timed out after {args.timeout} s\n\n")
    result = json.loads(path.read_text()) if path.is_file() else {"status": "failed: see log.txt"}
    return {"command": command, **result}


def run_bench(name: str, tree: Path, options: list[str], timeout: int, log) -> dict:
    """One `onenode bench` in `tree`, its output appended to `log`; the summary entry."""
    record_path = Path(options[options.index("--out") + 1])
    argv = [sys.executable, "-m", "onenode.cli", "bench", *options]
    entry = {"command": f"cd {tree} && PYTHONPATH=starter_code python3 " + " ".join(argv[1:])}
    log.write(f"$ {entry['command']}\n")
    log.flush()
    start = time.monotonic()
    if timeout < 30:
        entry["status"] = "skipped: the job's --budget is spent"
    else:
        try:
            proc = subprocess.run(argv, env=bench_env(tree), cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout)
            entry["status"] = "ok" if proc.returncode == 0 and record_path.is_file() else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            entry["status"] = f"timed out after {timeout} s"
    log.write(f"# {name}: {entry['status']} in {time.monotonic() - start:.0f} s\n\n")
    log.flush()
    if entry["status"] == "ok":
        record = json.loads(record_path.read_text())
        entry |= {k: record["results"][k] for k in ("tokens_per_s", "mfu", "mfu_vs_ceiling", "ceiling_tflops",
                                                    "peak_memory_gib", "step_time_median_s")}
        entry["first_loss"] = record["steps"]["losses"][0]
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="folder for the JSON records")
    parser.add_argument("--preset", default="a1-1gpu")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=150, help="seconds per run (compiled runs get twice that)")
    parser.add_argument("--budget", type=int, default=540,
                        help="seconds for the whole job: later runs get what is left, or are skipped")
    parser.add_argument("--only", nargs="*", default=None, help="run only these names")
    parser.add_argument("--traces", action="store_true", help="keep the profiler traces in OUT/traces")
    parser.add_argument("--solution-tree", default=None, help="a prebuilt patched copy (see --prepare)")
    parser.add_argument("--prepare", action="store_true", help="build the patched copy, print its folder, stop")
    parser.add_argument("--commit", default=None,
                        help="the kit's commit, for a machine where the tree arrives without .git "
                             "(default: the records' own)")
    args = parser.parse_args()
    if args.prepare:
        print(solution_tree(None))
        return 0
    if not args.out:
        parser.error("give the output folder")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    starter, solution = KIT_ROOT, solution_tree(args.solution_tree)

    common = ["--preset", args.preset, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--measure-ceiling", "--quiet",
              "--profile-steps", "1"]
    runs = [  # name, tree, extra options; the most important first
        ("solution", solution, []),
        ("starter", starter, []),
        ("transformers", solution, ["--impl", "transformers", "--experts-implementation", "grouped_mm"]),
        ("solution-compiled", solution, ["--compile", "mixers"]),
    ]
    if mamba_ssm_imports(bench_env(solution)):
        runs.append(("solution-mamba-ssm", solution, ["--mamba-kernel", "mamba_ssm"]))
    if args.only:
        runs = [r for r in runs if r[0] in args.only]

    traces = out / "traces" if args.traces else Path(tempfile.mkdtemp(prefix="onenode-traces-"))
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}}
    job_start = time.monotonic()
    with open(out / "log.txt", "w") as log:
        summary["ssd"] = run_ssd_probe(args, out / "ssd.json", log)
        print(f"{'ssd probe':<20} fastest correct: {summary['ssd'].get('fastest_correct')}", flush=True)
        for name, tree, extra in runs:
            argv = [*common, *extra, "--profile", str(traces / name), "--out", str(out / f"{name}.json")]
            left = args.budget - (time.monotonic() - job_start)
            timeout = int(min(args.timeout * (2 if "--compile" in extra else 1), left))
            summary["runs"][name] = run_bench(name, tree, argv, timeout, log)
            print(f"{name:<20} {summary['runs'][name]['status']}", flush=True)

    if not args.traces:
        shutil.rmtree(traces, ignore_errors=True)
    ok = {n: e for n, e in summary["runs"].items() if e["status"] == "ok"}
    if ok:
        first = json.loads((out / f"{next(iter(ok))}.json").read_text())
        summary |= {"commit": args.commit or first["commit"], "env": first["env"],
                    "solution_patch": "solutions/a1/submission.patch", "config": first["config"]}
    reference = ok.get("solution")
    for name, entry in ok.items():
        if reference and name not in ("solution", "starter"):
            entry["speedup_vs_solution"] = entry["tokens_per_s"] / reference["tokens_per_s"]
            entry["loss_agrees"] = abs(entry["first_loss"] - reference["first_loss"]) < LOSS_TOLERANCE
        if "starter" in ok:
            entry["speedup_vs_starter"] = entry["tokens_per_s"] / ok["starter"]["tokens_per_s"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    print(f"\n{'run':<20} {'tok/s':>9} {'MFU':>7} {'vs ceil':>8} {'peak GiB':>9} {'x starter':>9} {'loss0':>8}")
    for name, e in ok.items():
        print(f"{name:<20} {e['tokens_per_s']:>9,.0f} {e['mfu']:>7.2%} {e['mfu_vs_ceiling']:>8.2%} "
              f"{e['peak_memory_gib']:>9.1f} {e.get('speedup_vs_starter', float('nan')):>9.2f} {e['first_loss']:>8.4f}"
              + ("" if e.get("loss_agrees", True) else "  LOSS DIFFERS"))
    print(f"\nrecords, summary.json and log.txt in {out}")
    return 0 if len(ok) == len(runs) and all(e.get("loss_agrees", True) for e in ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
