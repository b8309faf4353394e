"""Mamba2's SSD scan alone: every implementation at hand, its speed and its error against float64.

    PYTHONPATH=starter_code python3 benchmarks/ssd_probe.py --preset a1-1gpu --seq-len 4096 --out ssd.json

Candidates: the kit's torch `ssd_chunked` eager, the same under `torch.compile`, both again with
the states carried across chunks by a recurrence (`carry_by_recurrence`: one pass a chunk, as
mamba_ssm's state passing, where the kit's `carry_across_chunks` is one float32 product with the
matrix of decays) or by that product on bf16 operands (`carry_on_bf16`), and mamba_ssm's Triton
SSD where it imports (the kit's op around it, `model/mamba_ssm_scan.py`, eager and under
`torch.compile(fullgraph=True)`). Each runs forward +
backward on the shapes of one Mamba layer of the preset (bf16 x, B, C as the bf16 model makes
them; float32 dt, A, D), timed with CUDA events after warm-up; output and input-gradient errors
are relative to `ssd_chunked` in float64. The fastest candidate whose errors stay within bf16
rounding is the one to use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from onenode.model import get_preset, mamba2, mamba_ssm_scan
from onenode.model.mamba2 import ssd_chunked

MAX_RELATIVE_ERROR = 2e-2  # bf16 inputs: about 1e-3 is typical, a wrong scan is off by O(1)


def inputs(preset: str, batch: int, seq_len: int, device: torch.device) -> tuple[dict, int, torch.Tensor]:
    config = get_preset(preset)
    h, p, g, n = config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors = {
        "x": randn(batch, seq_len, h, p).to(low),
        "dt": F.softplus(randn(batch, seq_len, h) - 4.0),  # around 0.02, like the initialised dt
        "A": -torch.arange(1, h + 1, device=device, dtype=torch.float32),  # the initialised A
        "B": randn(batch, seq_len, g, n).to(low),
        "C": randn(batch, seq_len, g, n).to(low),
        "D": torch.ones(h, device=device),
    }
    return tensors, config.chunk_size, randn(batch, seq_len, h, p)


def carry_by_recurrence(chunk_states: torch.Tensor, chunk_logdecay: torch.Tensor) -> torch.Tensor:
    """`mamba2.carry_across_chunks` as a recurrence over the chunks: the state entering chunk z+1 is
    the one entering z, decayed over z, plus z's own; a pass over the states a chunk, no matrix."""
    decay = torch.exp(chunk_logdecay).permute(0, 3, 1, 2)[..., None, None]  # [b, c, g, r, 1, 1]
    state = torch.zeros_like(chunk_states[:, 0])
    entering = []
    for z in range(chunk_states.shape[1]):
        entering.append(state)
        state = state * decay[:, z] + chunk_states[:, z]
    return torch.stack(entering, dim=1)


KIT_CARRY = mamba2.carry_across_chunks  # the probes below replace the module's name; this one stays


def carry_on_bf16(chunk_states: torch.Tensor, chunk_logdecay: torch.Tensor) -> torch.Tensor:
    """`mamba2.carry_across_chunks` under bf16 autocast: its product takes bf16 operands (float32
    accumulation, on tensor cores), its decays stay float32, the result returns in float32. The kit's
    float32 product runs on CUDA cores: three GEMMs of the A2 baseline's step, about 13 ms of 293 on
    one H100 (benchmarks/results/2026-12-06-h100-deterministic-scan-microbatch/f-torch-det-kernels.json).
    The states it carries are bf16 values already (the chunk products round them) and the scan rounds
    the states it returns to bf16 before it uses them: only the decays round anew."""
    with torch.autocast(chunk_states.device.type, dtype=torch.bfloat16):
        return KIT_CARRY(chunk_states, chunk_logdecay).to(chunk_states.dtype)


def with_mamba2(fn, **replaced):
    """`fn` run with `mamba2`'s functions of these names replaced (compiled functions trace them)."""
    def run(*args, **kwargs):
        kept = {name: getattr(mamba2, name) for name in replaced}
        for name, value in replaced.items():
            setattr(mamba2, name, value)
        try:
            return fn(*args, **kwargs)
        finally:
            for name, value in kept.items():
                setattr(mamba2, name, value)
    return run


def forward_backward(fn, tensors: dict, chunk: int, grad_out: torch.Tensor) -> tuple[torch.Tensor, list]:
    leaves = {k: v.detach().clone().requires_grad_(k in ("x", "dt", "B", "C")) for k, v in tensors.items()}
    y = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk, D=leaves["D"])
    y.backward(grad_out.to(y.dtype))
    return y.detach(), [leaves[k].grad for k in ("x", "dt", "B", "C")]


def relative_error(a: torch.Tensor, reference: torch.Tensor) -> float:
    return float((a.double() - reference).norm() / reference.norm().clamp_min(1e-30))


def time_ms(fn, tensors: dict, chunk: int, grad_out: torch.Tensor, device: torch.device, reps: int) -> float:
    for _ in range(3):
        forward_backward(fn, tensors, chunk, grad_out)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward_backward(fn, tensors, chunk, grad_out)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            forward_backward(fn, tensors, chunk, grad_out)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="a1-1gpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidate")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    tensors, chunk, grad_out = inputs(args.preset, args.batch, args.seq_len, device)
    reference = forward_backward(ssd_chunked, {k: v.double() for k, v in tensors.items()}, chunk, grad_out.double())
    carries = {"": None, "-recurrence": carry_by_recurrence, "-carry-bf16": carry_on_bf16}
    candidates = {}
    for suffix, carry in carries.items():
        for compiled in [False] if args.no_compile else [False, True]:
            scan = torch.compile(ssd_chunked) if compiled else ssd_chunked
            candidates[f"torch{suffix}{'-compiled' * compiled}"] = (
                with_mamba2(scan, carry_across_chunks=carry) if carry else scan)
    loaded, why_not = mamba_ssm_scan.load_kernels()
    if loaded is not None and device.type == "cuda":
        candidates["mamba_ssm"] = mamba_ssm_scan.chunk_scan
        if not args.no_compile:  # fullgraph: the op must not break the graph it sits in
            candidates["mamba_ssm-compiled"] = torch.compile(mamba_ssm_scan.chunk_scan, fullgraph=True)
    results = {"preset": args.preset, "batch": args.batch, "seq_len": args.seq_len, "device": str(device),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "torch": torch.__version__, "mamba_ssm": why_not or "imported", "candidates": {}}
    for name, fn in candidates.items():
        y, grads = forward_backward(fn, tensors, chunk, grad_out)
        errors = {"y": relative_error(y, reference[0])}
        errors |= {f"grad_{k}": relative_error(g, r) for k, g, r in zip(("x", "dt", "B", "C"), grads, reference[1])}
        ms = time_ms(fn, tensors, chunk, grad_out, device, args.reps)
        correct = max(errors.values()) < MAX_RELATIVE_ERROR
        results["candidates"][name] = {"fwd_bwd_ms": ms, "relative_errors": errors, "correct": correct}
        print(f"{name:<16} {ms:>9.2f} ms fwd+bwd   max relative error {max(errors.values()):.1e}"
              + ("" if correct else "   WRONG"), flush=True)
    good = {n: c for n, c in results["candidates"].items() if c["correct"]}
    results["fastest_correct"] = min(good, key=lambda n: good[n]["fwd_bwd_ms"]) if good else None
    print(f"fastest correct: {results['fastest_correct']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
