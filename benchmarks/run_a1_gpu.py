"""A1 on one H200, side by side in one job: the starter, the reference solution at one sequence and
at its best layout, transformers' and NeMo Automodel's peers, and optionally the solution as an
earlier commit had it.

    python3 benchmarks/run_a1_gpu.py OUTDIR --commit SHA            # on the GPU machine, about 6 minutes
    python3 benchmarks/run_a1_gpu.py --prepare --before REV ...     # where git works: build the trees, print them
    python3 benchmarks/run_a1_gpu.py OUTDIR --solution-tree S --before-tree B ...   # with trees built by --prepare
    python3 benchmarks/run_a1_gpu.py OUTDIR --preset tiny --seq-len 64 --best-micro-batch 2 --device cpu \
        --dtype bf16 --timeout 600 --budget 1800                    # the same job on a CPU, tiny (a smoke test)

Every run is `onenode bench` on the `a1-1gpu` preset with the same seeded synthetic batches and the
same initial weights, in the kit's precision (float32 master weights, bf16 copies for the forward and
backward: `parallel/mixed_precision.py`), in order of importance:

- `solution`: `solutions/a1/submission.patch` applied to a copy, micro-batch x seq-len (1 x 4096), eager;
- `solution-compiled`: the same with `--compile blocks` (every block one graph);
- `solution-cuda-graphs` (on a GPU): the same, each compiled block replayed as a CUDA graph
  (`--cuda-graphs`): at one sequence the host's kernel launches are what limits the step;
- `solution-best`: the best layout measured (`--best-micro-batch` 12 sequences, `--compile blocks`, no
  activation checkpointing: 27.2% MFU at 107 GiB, against 25.6% at 8 and 26.4% at 16 sequences, and
  22.9% at 16 with checkpointing; benchmarks/results/2026-12-01-h200-best-layout);
- `solution-best-mamba-ssm` (where mamba_ssm's Triton SSD imports, `make mamba-ssm`): the best layout
  with that scan (`--mamba-kernel mamba_ssm`), at `--mamba-ssm-micro-batch` 24 sequences: its scan
  keeps less for the backward (75.7 GiB at 12 sequences against the torch scan's 107), so twice the
  batch fits: 31.0% MFU at 117.8 GiB (benchmarks/results/2026-12-01-h200-one-process);
- `starter`: the unpatched `starter_code/` (per-expert loop), eager;
- `part-1-moe`, `part-2-ep`, `part-3-pp`: the starter with one part of `solutions/a1/parts/` applied,
  eager, at micro-batch x seq-len: what each fix alone does on one GPU (parts 2 and 3 change
  layouts of several processes, so here they should run as the starter does);
- `transformers`: transformers' `NemotronHForCausalLM`, `grouped_mm` experts, the same weights;
- `automodel` (on a GPU): NeMo Automodel's NemotronV3 trained as Automodel trains it (bf16 weights,
  fused AdamW) on the best backends that install, from the same weights and batches, at micro-batch x
  seq-len: `automodel_peer.py` (not `onenode bench`; its record has the same figures and the backends);
- `at-<sha>` (one per `--before REV` or `--before-tree`): the solution as commit REV had it, eager,
  at micro-batch x seq-len: what the commits since then changed (one REV per step: each step's effect);
- `ssd` (with `--ssd-probe`, first): `ssd_probe.py`, the Mamba2 scan alone per implementation.

Each run's record (tokens/s, MFU against 989 TFLOP/s and against a measured bf16 matmul, peak
memory, losses, top kernels) goes to OUTDIR/<name>.json; OUTDIR/summary.json holds the exact
commands, the table and the ratios (to the starter, the peer and the solution); OUTDIR/log.txt every
run's output. Runs at the same batch as `solution` must start from its first loss (same weights and
batch); the starter initialises its per-expert weights under other names, so only its speed counts.
A run gets its own timeout (`--timeout`, twice that compiled) and what is left of `--budget`.
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
# The kit's own package, last: a PYTHONPATH (a patched tree's ranks) or an install comes first.
sys.path.append(str(KIT_ROOT / "starter_code"))
from patched_copy import git_apply, patched_tree  # noqa: E402  (the kit's helpers: solutions/a1 patches)

PARTS = ("1-moe", "2-ep", "3-pp")  # solutions/a1/parts/: each slow path's fix alone
LOSS_TOLERANCE = 0.02  # bf16, different kernels: the first losses agree to about 1e-3
AUTOMODEL_PEER = KIT_ROOT / "benchmarks" / "automodel_peer.py"  # the `automodel` run's script


def solution_tree(prebuilt: str | None, patch: str = "submission") -> Path:
    """The reference solution's tree (`patch`: the full patch, or one part of `PARTS`): `prebuilt` (a
    folder `--prepare` printed; relative to where the job starts, as the runs start elsewhere), or the
    patch applied to a copy here."""
    if prebuilt:
        tree = Path(prebuilt).resolve()
        if not (tree / "starter_code" / "onenode").is_dir():
            raise SystemExit(f"--solution-tree {tree} holds no starter_code/onenode: build it with --prepare")
        return tree
    try:
        return patched_tree([patch])
    except (OSError, RuntimeError) as e:
        raise SystemExit(f"could not apply solutions/a1 patch {patch} ({e}): run --prepare where git works "
                         "and carry the printed folders") from None


def tree_at_commit(rev: str) -> Path:
    """The solution as commit `rev` had it: that commit's `starter_code/` with its own
    `solutions/a1/submission.patch` applied, under .cache/patched/ (needs git)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", rev], cwd=KIT_ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--before {rev}: not a commit of this repository ({e}): build the tree where git works "
                         "(--prepare) and pass it as --before-tree") from None
    tree = KIT_ROOT / ".cache" / "patched" / f"solution-at-{sha}"
    if (tree / "starter_code").is_dir():
        return tree
    staging = tree.with_name(tree.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha, "starter_code", "solutions/a1/submission.patch"],
                             cwd=KIT_ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(staging)], input=archive, check=True)
    patch = staging / "solutions" / "a1" / "submission.patch"
    result = git_apply(staging, patch)
    if result.returncode != 0:
        raise SystemExit(f"--before {rev}: its submission.patch does not apply to its starter: {result.stderr.strip()}")
    shutil.rmtree(staging / "solutions")
    staging.rename(tree)
    return tree


def existing_tree(option: str, folder: str) -> Path:
    tree = Path(folder).resolve()
    if not (tree / "starter_code" / "onenode").is_dir():
        raise SystemExit(f"{option} {tree} holds no starter_code/onenode: build it with --prepare")
    return tree


def mamba_ssm_imports(env: dict) -> bool:
    probe = "from onenode.model.mamba_ssm_scan import load_kernels; raise SystemExit(load_kernels()[0] is None)"
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


def run_bench(name: str, tree: Path, options: list[str], timeout: int, log, script: Path | None = None) -> dict:
    """One `onenode bench` (or `script`, whose record has the bench's figures) in `tree`, its output
    appended to `log`; the summary entry."""
    record_path = Path(options[options.index("--out") + 1])
    argv = [sys.executable, *([str(script)] if script else ["-m", "onenode.cli", "bench"]), *options]
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
        if "backends" in record:
            entry["backends"] = record["backends"]
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="folder for the JSON records")
    parser.add_argument("--preset", default="a1-1gpu")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per step of every run but the best")
    parser.add_argument("--best-micro-batch", type=int, default=12, help="sequences per step of solution-best")
    parser.add_argument("--mamba-ssm-micro-batch", type=int, default=24,
                        help="sequences per step of solution-best-mamba-ssm")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default=None, help="bench's --device (default: the GPU)")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="bench's --dtype (default: its own)")
    parser.add_argument("--timeout", type=int, default=150, help="seconds per run (compiled runs get twice that)")
    parser.add_argument("--budget", type=int, default=450,
                        help="seconds for the whole job: later runs get what is left, or are skipped")
    parser.add_argument("--only", nargs="*", default=None, help="run only these names")
    parser.add_argument("--traces", action="store_true", help="keep the profiler traces in OUT/traces")
    parser.add_argument("--ssd-probe", action="store_true", help="first time the Mamba2 scan alone (ssd_probe.py)")
    parser.add_argument("--solution-tree", default=None, help="a prebuilt patched copy (see --prepare)")
    parser.add_argument("--before", action="append", default=[], metavar="REV",
                        help="also run the solution as commit REV had it (repeatable)")
    parser.add_argument("--before-tree", action="append", default=[],
                        help="such a solution, prebuilt by --prepare --before REV (repeatable)")
    parser.add_argument("--before-layouts", nargs="+", default=["eager"], choices=["eager", "compiled", "best"],
                        help="the layouts each earlier solution runs in: eager and compiled at --micro-batch, "
                             "best as solution-best (default: eager)")
    parser.add_argument("--prepare", action="store_true", help="build the patched copies, print their folders, stop")
    parser.add_argument("--commit", default=None,
                        help="the kit's commit, for a machine where the tree arrives without .git "
                             "(default: the records' own)")
    args = parser.parse_args()
    if args.prepare:  # relative to the kit's root: what a copy of the kit elsewhere carries
        for tree in [solution_tree(None), *(solution_tree(None, part) for part in PARTS),
                     *(tree_at_commit(rev) for rev in args.before)]:
            print(tree.relative_to(KIT_ROOT))
        return 0
    if not args.out:
        parser.error("give the output folder")
    job_start = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    starter, solution = KIT_ROOT, solution_tree(args.solution_tree)
    befores = [existing_tree("--before-tree", t) for t in args.before_tree] + [tree_at_commit(r) for r in args.before]
    befores = list(dict.fromkeys(befores))  # a commit given twice runs once

    shared = ["--preset", args.preset, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--measure-ceiling", "--quiet"]
    shared += [option for flag, value in (("--device", args.device), ("--dtype", args.dtype)) if value
               for option in (flag, value)]
    common = [*shared, "--profile-steps", "1"]
    one, best = ["--micro-batch", str(args.micro_batch)], ["--micro-batch", str(args.best_micro_batch)]
    runs = [  # name, tree, extra options; the most important first
        ("solution", solution, one),
        ("solution-compiled", solution, [*one, "--compile", "blocks"]),
        ("solution-best", solution, [*best, "--compile", "blocks"]),
        *([("solution-cuda-graphs", solution, [*one, "--compile", "blocks", "--cuda-graphs"])]
          if args.device != "cpu" else []),  # refused on a CPU
        ("starter", starter, one),
        *((f"part-{part}", solution_tree(None, part), one) for part in PARTS),  # the same bench, one fix each
        ("transformers", solution, [*one, "--impl", "transformers", "--experts-implementation", "grouped_mm"]),
        *([("automodel", solution, one)] if args.device != "cpu" else []),  # its Mamba layers need a GPU
    ]
    layouts = {"eager": one, "compiled": [*one, "--compile", "blocks"],
               "best": [*best, "--compile", "blocks"]}
    runs += [(tree.name.removeprefix("solution-") + ("" if layout == "eager" else f"-{layout}"), tree, layouts[layout])
             for tree in befores for layout in args.before_layouts]
    if mamba_ssm_imports(bench_env(solution)):
        runs.append(("solution-best-mamba-ssm", solution, ["--micro-batch", str(args.mamba_ssm_micro_batch),
                                                           "--compile", "blocks", "--mamba-kernel", "mamba_ssm"]))
    if args.only:
        runs = [r for r in runs if r[0] in args.only]

    traces = out / "traces" if args.traces else Path(tempfile.mkdtemp(prefix="onenode-traces-"))
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}}
    with open(out / "log.txt", "w") as log:
        if args.ssd_probe:
            summary["ssd"] = run_ssd_probe(args, out / "ssd.json", log)
            print(f"{'ssd probe':<20} fastest correct: {summary['ssd'].get('fastest_correct')}", flush=True)
        for name, tree, extra in runs:
            if name == "automodel":  # automodel_peer.py: the bench's options, without a profiled window
                script, argv = AUTOMODEL_PEER, [*shared, *extra]
            else:
                script, argv = None, [*common, *extra, "--profile", str(traces / name)]
            argv += ["--out", str(out / f"{name}.json")]
            left = args.budget - (time.monotonic() - job_start)
            # compiled runs, and the peer's Triton autotuning: twice the time
            timeout = int(min(args.timeout * (2 if "--compile" in extra or script else 1), left))
            summary["runs"][name] = run_bench(name, tree, argv, timeout, log, script)
            summary["runs"][name]["micro_batch"] = int(extra[extra.index("--micro-batch") + 1])
            print(f"{name:<20} {summary['runs'][name]['status']}", flush=True)
    summary["wall_s"] = time.monotonic() - job_start

    if not args.traces:
        shutil.rmtree(traces, ignore_errors=True)
    ok = {n: e for n, e in summary["runs"].items() if e["status"] == "ok"}
    if ok:
        first = json.loads((out / f"{next(iter(ok))}.json").read_text())
        summary |= {"commit": args.commit or first["commit"], "env": first["env"],
                    "solution_patch": "solutions/a1/submission.patch", "config": first["config"]}
    reference = ok.get("solution")
    for name, entry in ok.items():
        same_batch = reference and entry["micro_batch"] == reference["micro_batch"]
        if same_batch and name not in ("solution", "starter"):
            entry["loss_agrees"] = abs(entry["first_loss"] - reference["first_loss"]) < LOSS_TOLERANCE
        for other in ("starter", "transformers", "automodel", "solution"):
            if other in ok and other != name:
                entry[f"speedup_vs_{other}"] = entry["tokens_per_s"] / ok[other]["tokens_per_s"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    print(f"\n{'run':<20} {'tok/s':>9} {'MFU':>7} {'vs ceil':>8} {'peak GiB':>9} {'x starter':>9} {'x peer':>7} "
          f"{'x autom.':>8} {'x sol.':>7} {'loss0':>8}")
    for name, e in ok.items():
        print(f"{name:<20} {e['tokens_per_s']:>9,.0f} {e['mfu']:>7.2%} {e['mfu_vs_ceiling']:>8.2%} "
              f"{e['peak_memory_gib']:>9.1f} {e.get('speedup_vs_starter', float('nan')):>9.2f} "
              f"{e.get('speedup_vs_transformers', float('nan')):>7.2f} "
              f"{e.get('speedup_vs_automodel', float('nan')):>8.2f} "
              f"{e.get('speedup_vs_solution', float('nan')):>7.2f} {e['first_loss']:>8.4f}"
              + ("" if e.get("loss_agrees", True) else "  LOSS DIFFERS"))
    print(f"\nrecords, summary.json and log.txt in {out} ({summary['wall_s']:.0f} s)")
    return 0 if len(ok) == len(runs) and all(e.get("loss_agrees", True) for e in ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
