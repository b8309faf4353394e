"""Which part of the one-GPU step makes its CUDA graphs record again every step.

    PYTHONPATH=starter_code python3 benchmarks/cuda_graph_probe.py OUT.json [--variants ...]

Each variant runs in a process of its own (the graphs, the compile caches and the allocator start
clean): the a1-1gpu preset at 1 x 4096, compiled blocks replayed as CUDA graphs, as `onenode bench
--set train.compile=blocks --set train.cuda_graphs=true` runs it, with one thing taken away:

- `as-benched`: nothing;
- `no-balancer`: the router balancing's forward hooks and its step (bench runs them since it calls
  `assemble`, as `onenode train` does);
- `unfused-update`: `train.fused_update=false` (torch's AdamW, then the copies refreshed);
- `partitioned`: `CUDA_GRAPH_OPTIONS` as 53b0d08 had them, with inductor's graph partitions (what
  regressed: 2,573 tokens/s against 47,759 without graphs);
- `no-graphs`: CUDA graphs off, the yardstick.

A variant whose graphs record again prints a rising `recordings` count from inductor's counters.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VARIANTS = ("as-benched", "partitioned", "no-balancer", "unfused-update", "no-graphs")


def run_variant(name: str, steps: int, warmup: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from onenode.bench.device import synthetic_batches
    from onenode.train.assembly import assemble
    from onenode.train.recipe import from_dict

    train = {"token_budget": 1 << 40, "seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 1,
             "precision": "bf16", "compile": "blocks", "cuda_graphs": name != "no-graphs",
             "fused_update": name != "unfused-update"}
    recipe = from_dict({"name": f"probe-{name}", "model": {"preset": "a1-1gpu"}, "data": {"source": "synthetic"},
                        "train": train})
    if name == "partitioned":
        from onenode.parallel import compile_and_checkpoint

        compile_and_checkpoint.CUDA_GRAPH_OPTIONS.pop("graph_partition", None)
    run = assemble(recipe)
    if name == "no-balancer":
        run.balancer.remove()
        run.balancer.routers = {}
    batches = synthetic_batches(run.config.vocab_size, 1, 4096, recipe.seed, 0, 1)
    times, recordings = [], []
    for _ in range(warmup + steps):
        input_ids, labels = (t.to(run.device) for t in next(batches))
        torch.cuda.synchronize()
        start = time.perf_counter()
        run.step(input_ids, labels)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        recordings.append(sum(v for k, v in counters["inductor"].items() if "cudagraph" in k))
    timed = sorted(times[warmup:])
    median = timed[len(timed) // 2]
    return {"variant": name, "median_s": median, "tokens_per_s": 4096 / median, "step_s": times,
            "inductor_cudagraph_counters": dict(counters["inductor"]), "counter_per_step": recordings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_variant(args.one, args.steps, args.warmup)))
        return
    results = []
    for name in args.variants:
        proc = subprocess.run([sys.executable, __file__, args.out, "--one", name, "--steps", str(args.steps),
                               "--warmup", str(args.warmup)], capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "variant": name, "error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
        results.append(result)
        print(name, result.get("tokens_per_s", result.get("error")), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
