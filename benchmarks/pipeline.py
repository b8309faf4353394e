"""Pipeline parallelism on two GPUs against one: tokens/s, and the bubble each schedule implies.

    python3 benchmarks/pipeline.py --prepare                      # here: build the patched copy
    python3 benchmarks/pipeline.py OUTDIR --solution-tree DIR     # on two GPUs, a few minutes
    python3 benchmarks/pipeline.py OUTDIR --profile               # also a torch.profiler trace per rank
    python3 benchmarks/pipeline.py OUTDIR --tiny                  # CPU smoke test: tiny preset, gloo

Every run trains the reference solution (`solutions/a1/submission.patch` on a copy) with AdamW on
the same synthetic batches, each in its own process group launched by torchrun:

- `1gpu`: the whole model on one device, one sequence per step;
- `pp2-<schedule>`: two stages (pp=2) with GPipe, 1F1B and interleaved 1F1B (two virtual stages
  per rank), `--microbatches` sequences per step, one sequence per microbatch.

A schedule with p stages and m microbatches leaves each stage idle for p - 1 of its m + p - 1
microbatch slots: the bubble fraction (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
interleaved 1F1B with v virtual stages per rank. With balanced stages the best pp speedup over one
GPU is p x (1 - bubble); the measured one is lower by the stage imbalance and the p2p transfers.

Writes OUTDIR/<run>.json (command, commit, versions, GPUs, step times, losses, tokens/s, peak
memory), OUTDIR/summary.json with the table, and OUTDIR/log.txt; copy them under
`benchmarks/results/` with the date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT_ROOT / "benchmarks"))
from run_a1_gpu import bench_env, solution_tree  # noqa: E402  (the patched copy and its environment)

PP = 2
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def bubble_fraction(schedule: str, pp: int, microbatches: int) -> float:
    """Share of each stage's step time idle in the schedule's fill and drain."""
    v = STAGES_PER_RANK[schedule]
    return (pp - 1) / (v * microbatches + pp - 1)


# -- one run, under torchrun -----------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from onenode.bench.device import peak_memory_bytes, synthetic_batches
    from onenode.model import build_model, get_preset
    from onenode.parallel import ParallelDims, parallelize
    from onenode.parallel.distributed import init_distributed, local_device
    from onenode.profiling import profiled, write_trace
    from onenode.train.logging import environment, git_commit
    from onenode.train.step import build_optimizer, train_step

    rank, world = init_distributed()
    cuda = torch.cuda.is_available()
    device = local_device()
    if not cuda:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else None
    config = get_preset(args.preset)
    # Built on the device, split, dropped: each rank keeps only its stage (and its optimizer state).
    model = build_model(config, seed=0, device=device)
    pipeline = {"schedule": args.schedule, "microbatches": args.microbatches, "seq_len": args.seq_len}
    pipeline = pipeline if world > 1 else {}
    model = parallelize(model, ParallelDims(pp=world), param_dtype=dtype, **pipeline)
    sequences = args.microbatches if world > 1 else 1
    optimizer = build_optimizer(model, lr=3e-4)
    batches = synthetic_batches(config.vocab_size, sequences, args.seq_len, seed=0, dp_rank=0, dp=1)

    def step() -> float | None:
        input_ids, labels = (t.to(device) for t in next(batches))
        return train_step(model, optimizer, input_ids, labels, grad_clip=1.0)["loss"]

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        if world > 1:  # the step ends when the slowest stage is done
            dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss)
    trace = None
    if args.trace_dir:
        with profiled(device) as prof:
            step()
        trace = str(write_trace(prof, args.trace_dir, rank))
    memory, memory_kind = peak_memory_bytes(device)
    record = {
        "rank": rank, "world_size": world, "schedule": args.schedule, "preset": args.preset,
        "seq_len": args.seq_len, "sequences_per_step": sequences, "microbatches": args.microbatches if world > 1 else 1,
        "stage_layers": ([int(i) for module in model.stage_modules for i in module.backbone.layers] if world > 1
                         else list(range(config.num_hidden_layers))),
        "commit": git_commit(KIT_ROOT), "env": environment(world), "dtype": str(dtype),
        "step_times_s": times, "losses": losses, "peak_memory_gib": memory / 2**30, "memory_kind": memory_kind,
        "trace": trace,
    }
    Path(args.record).with_suffix(f".rank{rank}.json").write_text(json.dumps(record, indent=2) + "\n")


# -- the driver ------------------------------------------------------------------------------------
def merge_ranks(path: Path, world: int) -> dict:
    """One record from the ranks': the loss from the last stage, the slowest step, the most memory."""
    ranks = [json.loads(path.with_suffix(f".rank{r}.json").read_text()) for r in range(world)]
    record = dict(ranks[-1])
    record.pop("rank")
    record["stage_layers_per_rank"] = [r["stage_layers"] for r in ranks]
    record.pop("stage_layers")
    record["step_times_s"] = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))]
    record["peak_memory_gib_per_rank"] = [r["peak_memory_gib"] for r in ranks]
    record["peak_memory_gib"] = max(record["peak_memory_gib_per_rank"])
    record["traces"] = [r["trace"] for r in ranks if r["trace"]]
    record.pop("trace")
    median = statistics.median(record["step_times_s"])
    record["step_time_median_s"] = median
    record["tokens_per_s"] = record["sequences_per_step"] * record["seq_len"] / median
    for r in range(world):
        path.with_suffix(f".rank{r}.json").unlink()
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="folder for the JSON records")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny preset, 64 tokens, 2 steps")
    parser.add_argument("--preset", default="a1-1gpu")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=8, help="sequences per pipeline step, one per microbatch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--profile", action="store_true", help="keep a torch.profiler trace of one step per rank")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--solution-tree", default=None, help="a prebuilt patched copy (see --prepare)")
    parser.add_argument("--prepare", action="store_true", help="build the patched copy, print its folder, stop")
    # internal: one run under torchrun
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--record", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.seq_len, args.steps, args.warmup = "tiny", 64, 2, 1
    if args.worker:
        worker(args)
        return 0
    if args.prepare:
        print(solution_tree(None))
        return 0
    if not args.out:
        parser.error("give the output folder")
    if args.microbatches < PP:
        parser.error(f"--microbatches must be at least {PP} (one per stage)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = solution_tree(args.solution_tree)

    runs = [("1gpu", 1, SCHEDULES[0])] + [(f"pp{PP}-{s}", PP, s) for s in args.schedules]
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}}
    with open(out / "log.txt", "w") as log:
        for name, nproc, schedule in runs:
            record_path = out / f"{name}.json"
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    str(Path(__file__).resolve()), "--worker", "--schedule", schedule, "--record", str(record_path),
                    "--preset", args.preset, "--seq-len", str(args.seq_len), "--microbatches", str(args.microbatches),
                    "--steps", str(args.steps), "--warmup", str(args.warmup)]
            if args.profile:
                argv += ["--trace-dir", str(out / "traces" / name)]
            shown = f"cd {tree} && PYTHONPATH=starter_code " + " ".join(["python3", *argv[1:]])
            log.write(f"$ {shown}\n")
            log.flush()
            start = time.monotonic()
            try:
                proc = subprocess.run(argv, env=bench_env(tree), cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=args.timeout)
                status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                status = f"timed out after {args.timeout} s"
            log.write(f"# {name}: {status} in {time.monotonic() - start:.0f} s\n\n")
            log.flush()
            entry = {"command": shown, "status": status}
            if status == "ok":
                record = merge_ranks(record_path, nproc) | {"command": shown}
                record_path.write_text(json.dumps(record, indent=2) + "\n")
                entry |= {k: record[k] for k in ("tokens_per_s", "step_time_median_s", "peak_memory_gib")}
                entry["bubble_fraction"] = 0.0 if nproc == 1 else bubble_fraction(schedule, nproc, args.microbatches)
            summary["runs"][name] = entry
            print(f"{name:<22} {status}", flush=True)

    ok = {n: e for n, e in summary["runs"].items() if e["status"] == "ok"}
    baseline = ok.get("1gpu")
    for name, entry in ok.items():
        if baseline and name != "1gpu":
            entry["speedup_vs_1gpu"] = entry["tokens_per_s"] / baseline["tokens_per_s"]
            entry["ideal_speedup"] = PP * (1 - entry["bubble_fraction"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    print(f"\n{'run':<22} {'tok/s':>10} {'x 1gpu':>7} {'bubble':>7} {'ideal x':>8} {'peak GiB':>9}")
    for name, e in ok.items():
        print(f"{name:<22} {e['tokens_per_s']:>10,.0f} {e.get('speedup_vs_1gpu', 1.0):>7.2f} "
              f"{e['bubble_fraction']:>7.1%} {e.get('ideal_speedup', 1.0):>8.2f} {e['peak_memory_gib']:>9.1f}")
    print(f"\nrecords, summary.json and log.txt in {out}")
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
