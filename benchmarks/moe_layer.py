"""MoE layer microbenchmark (A1 part 1): the starter's per-expert loop against a fixed moe.py.

    python benchmarks/moe_layer.py --out benchmarks/results/moe_layer_h200.json   # GPU, a1-1gpu shapes
    python benchmarks/moe_layer.py --tiny                                       # CPU smoke test

One MoE layer of the a1-1gpu preset (128 experts, top-6, H=1024, I=704, one shared expert), bf16,
16384 tokens, forward+backward. Each implementation runs in its own process on its own copy of
starter_code (the pristine starter, and the starter with solutions/a1/parts/1-moe.patch, built
with `git apply` by tests/patched_copy.py; where git is missing, pass prebuilt folders with
`--trees LOOP GROUPED`), from the same weights (the second loads the first's through
`adapt_state_dict`), and their outputs and input gradients are compared. Reported per
implementation: the layer's median time; the routed experts' median time (fixed routing); the time
of their matmul kernels (profiler, aten mm/_grouped_mm); the expert matmul FLOPs (2*m*n*k per
GEMM, x3 for forward+backward, over the top-k assignments) as TFLOP/s over each time, and as a
share of the 989 TFLOP/s dense bf16 peak of H100/H200. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM / H200 datasheet
MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm"}


# -- measuring (runs in a child whose `onenode` is one implementation) --------------------------
def _timer(device):
    import torch

    if device.type == "cuda":
        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
    return timed


def _median_seconds(fn, device, warmup: int, repeats: int) -> float:
    timed = _timer(device)
    for _ in range(warmup):
        timed(fn)
    return statistics.median(timed(fn) for _ in range(repeats))


def _matmul_seconds(fn, device) -> float:
    """Device (or CPU) time of the matmul ops in one call of `fn`, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        if event.key in MATMUL_OPS:
            total_us += event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
    return total_us / 1e6


def measure(args) -> dict:
    import torch

    import onenode
    from onenode.model import build_model, get_preset

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        torch.set_num_threads(1)
        config = get_preset("tiny", hybrid_override_pattern="E", n_routed_experts=16, num_experts_per_tok=2,
                            n_group=1, topk_group=1)
    else:
        config = get_preset("a1-1gpu", hybrid_override_pattern="E")
    model = build_model(config, seed=0, device=device, dtype=dtype)
    if args.weights.exists():  # the same weights as the implementation measured before
        from onenode.model.hf_io import adapt_state_dict

        model.load_state_dict(adapt_state_dict(torch.load(args.weights, map_location=device), model))
    else:
        torch.save(model.state_dict(), args.weights)
    moe = model.backbone.layers[0].mixer
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(args.tokens, config.hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    grad_out, probe = (torch.randn(x.shape, device=device, dtype=dtype, generator=gen) for _ in range(2))
    with torch.no_grad():
        topk_idx, topk_weight = moe.gate(x)
    y = moe(x)
    y.backward(grad_out)
    check = [float((t.double() * probe.double()).sum()) for t in (y.detach(), x.grad)]

    def layer():
        moe(x).backward(grad_out)

    def routed():
        moe.routed_experts(x, topk_idx, topk_weight).backward(grad_out)

    layer_s = _median_seconds(layer, device, args.warmup, args.repeats)
    routed_s = _median_seconds(routed, device, args.warmup, args.repeats)
    matmul_s = _matmul_seconds(routed, device)
    flops = 3 * topk_idx.numel() * 2 * (2 * config.hidden_size * config.moe_intermediate_size)

    def rate(seconds: float) -> dict:
        tflops = flops / seconds / 1e12
        return {"tflops": tflops, "pct_of_peak": None if args.tiny else 100 * tflops / PEAK_TFLOPS}

    return {
        "onenode": onenode.__file__,
        "check": check,  # projections of the output and the input gradient on a random direction
        "layer_ms": 1e3 * layer_s,
        "routed_experts_ms": 1e3 * routed_s,
        "expert_matmuls_ms": 1e3 * matmul_s,
        "expert_matmul_flops": flops,
        "over_layer": rate(layer_s),
        "over_routed_experts": rate(routed_s),
        "in_matmul_kernels": rate(matmul_s) if matmul_s > 0 else None,
        "shapes": {"tokens": args.tokens, "experts": config.n_routed_experts, "top_k": config.num_experts_per_tok,
                   "hidden": config.hidden_size, "intermediate": config.moe_intermediate_size, "dtype": str(dtype)},
    }


# -- driving: one child per implementation -----------------------------------------------------
def _trees(args) -> dict[str, Path]:
    if args.trees:
        trees = dict(zip(("loop", "grouped"), args.trees))
        for name, tree in trees.items():
            if not (tree / "starter_code" / "onenode").is_dir():
                sys.exit(f"--trees: {tree} holds no starter_code/onenode (the {name} implementation)")
        return trees
    sys.path.insert(0, str(KIT_ROOT / "tests"))
    from patched_copy import patched_tree

    return {"loop": patched_tree([]), "grouped": patched_tree(["1-moe"])}


def _environment() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=KIT_ROOT, capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit or None,
            "torch": torch.__version__, "python": platform.python_version(), "gpu": gpu,
            "host": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def compare(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        for name, tree in _trees(args).items():
            env = dict(os.environ, PYTHONPATH=str(tree / "starter_code"))
            argv = [sys.executable, __file__, "--measure", "--weights", f"{tmp}/weights.pt", *sys.argv[1:]]
            proc = subprocess.run(argv, env=env, cwd=KIT_ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name} ({tree}) failed:\n{proc.stderr[-3000:]}")
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    loop, grouped = results["loop"], results["grouped"]
    mismatch = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(loop["check"], grouped["check"]))
    return {
        **_environment(),
        "benchmark": "moe_layer",
        "results": results,
        "outputs_rel_diff": mismatch,  # output and input gradient, loop vs grouped
        "speedup_layer": loop["layer_ms"] / grouped["layer_ms"],
        "speedup_routed_experts": loop["routed_experts_ms"] / grouped["routed_experts_ms"],
        "targets": {"speedup_layer": 4.0, "grouped_pct_of_peak_in_matmul_kernels": 40.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (16 experts, top-2): a smoke test")
    parser.add_argument("--tokens", type=int, help="tokens per step (default 16384; 256 with --tiny)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--trees", type=Path, nargs=2, metavar=("LOOP", "GROUPED"),
                        help="folders holding starter_code/ of each implementation (default: built here)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)  # shared by the children
    args = parser.parse_args()
    args.tokens = args.tokens or (256 if args.tiny else 16384)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run on a GPU node, or pass --tiny for the CPU smoke test")
    report = compare(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
