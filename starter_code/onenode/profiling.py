"""torch.profiler helpers for `onenode bench`: a trace file, the top kernels, compute vs communication.

A profile is the evidence behind a speed claim: it shows which kernels the time went to and
how much of a step waited on collectives. On CUDA the kernel timeline is read (NCCL kernels run
on their own streams, so communication can overlap compute); on CPU, where gloo collectives run
inside the calling op, the CPU-side intervals of the collective ops are read instead.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# Kernels and ops that move data between ranks (NCCL kernels, gloo ops, c10d and functional
# collectives, and their waits).
COLLECTIVE = re.compile(
    r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|wait_tensor",
    re.IGNORECASE,
)


@contextmanager
def profiled(device: torch.device):
    """A torch.profiler session over the steps run inside the block (CPU, plus CUDA on a GPU)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        yield prof


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start, end in microseconds) of every kernel and copy on the GPU, read from the
    profiler's raw events: `prof.events()` and `key_averages()` first build a Python tree of every
    CPU op too (the unpatched starter's profiled window, two steps of 47,375 kernels each, took 110 s
    to read and write out on one H200: benchmarks/results/2026-12-04-h200-first-number/). Ranges the
    code annotates (the optimizer's `Optimizer.step#AdamW.step`) are mirrored on the GPU's timeline
    spanning their kernels: counted as kernels they would count those kernels' time twice and cover
    the idle gaps between them."""
    kernels = getattr(prof, "_onenode_device_kernels", None)  # read once: `time_split` and `self_times` both ask
    if kernels is None:
        kernels = [(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == DeviceType.CUDA and not e.is_user_annotation()]
        prof._onenode_device_kernels = kernels
    return kernels


def time_split(prof, device: torch.device) -> dict[str, float]:
    """Seconds of the profiled window busy with compute, with communication, and with both.

    CUDA: union of the kernel intervals on the GPU, collective kernels apart from the rest;
    `exposed_comm_s` is communication that no compute kernel overlapped. CPU: the intervals of
    the top-level collective ops against the whole window (gloo blocks the calling thread, so
    nothing overlaps).
    """
    if device.type == "cuda":
        kernels = device_kernels(prof)
        comm = [(start, end) for name, start, end in kernels if COLLECTIVE.search(name)]
        compute = [(start, end) for name, start, end in kernels if not COLLECTIVE.search(name)]
        busy = union_us(comm + compute)
        comm_us, compute_us = union_us(comm), union_us(compute)
        exposed_us = busy - compute_us
    else:
        events = prof.events()
        spans = [(e.time_range.start, e.time_range.end) for e in events if e.time_range.end > e.time_range.start]
        comm = [(e.time_range.start, e.time_range.end) for e in events if COLLECTIVE.search(e.name)]
        busy = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
        comm_us = exposed_us = union_us(comm)
        compute_us = busy - comm_us
    return {"busy_s": busy / 1e6, "compute_s": compute_us / 1e6, "comm_s": comm_us / 1e6,
            "exposed_comm_s": exposed_us / 1e6}


def self_times(prof, device: torch.device) -> list[tuple[str, int, float]]:
    """(name, calls, self seconds) of every kernel (CUDA: a kernel's self time is its duration) or
    op (CPU: its time less its children's, from `key_averages`) in the window, largest first: what
    `top_kernels` and `kernel_mix` read."""
    if device.type == "cuda":
        totals: dict[str, list] = {}
        for name, start, end in device_kernels(prof):
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += (end - start) / 1e6
        rows = [(name, calls, seconds) for name, (calls, seconds) in totals.items() if seconds > 0]
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in prof.key_averages()
                if e.device_type != DeviceType.CUDA and e.self_cpu_time_total > 0]
    return sorted(rows, key=lambda row: row[2], reverse=True)


def launches(rows: list[tuple[str, int, float]], steps: int) -> dict[str, float]:
    """Kernels (CUDA) or ops (CPU) per step, and their mean self time: thousands of kernels of a
    few microseconds each make a step bound by launching them (the host's time per launch), not by
    the GPU's work, which fewer kernels (fusion, CUDA graphs) fix."""
    calls = sum(count for _, count, _ in rows)
    seconds = sum(self_s for _, _, self_s in rows)
    return {"kernels_per_step": calls / steps, "mean_kernel_s": seconds / calls if calls else 0.0}


def top_kernels(rows: list[tuple[str, int, float]], limit: int = 15) -> list[dict]:
    """The `limit` kernels (CUDA) or ops (CPU) of `self_times` with the most self time, with their share."""
    total = sum(seconds for _, _, seconds in rows) or 1.0
    return [{"name": name, "calls": calls, "self_s": seconds, "share": seconds / total}
            for name, calls, seconds in rows[:limit]]


# What a kernel (CUDA) or op (CPU) is, by its name; the first match wins. Triton kernels are the
# compiler's fusions (their names list the ops fused, copies and matmul epilogues among them);
# attention kernels before matmuls (cuDNN's flash attention names its wgmma instructions).
KERNEL_KINDS = {
    "communication": COLLECTIVE,
    "compiled": re.compile(r"^triton_"),
    "attention": re.compile(r"flash|sdpa|fmha|scaled_dot_product|attention", re.IGNORECASE),
    "matmul": re.compile(r"gemm|nvjet|cutlass|cublas|wgmma|xmma|grouped_mm|aten::(mm|addmm|bmm|baddbmm|matmul|linear)$",
                         re.IGNORECASE),
    "optimizer": re.compile(r"multi_tensor_apply|adam|_foreach", re.IGNORECASE),
    "copy": re.compile(r"memcpy|memset|copy|chunk_cat|aten::(cat|to|_to_copy|clone|contiguous)$", re.IGNORECASE),
}


def kernel_mix(rows: list[tuple[str, int, float]]) -> dict[str, float]:
    """Each kind's share of the kernel (CUDA) or op (CPU) self time of `self_times`, largest first:
    where the time went, over every kernel and not only the top ones. Kinds: KERNEL_KINDS, else
    "other"."""
    totals = dict.fromkeys([*KERNEL_KINDS, "other"], 0.0)
    for name, _, seconds in rows:
        kind = next((kind for kind, pattern in KERNEL_KINDS.items() if pattern.search(name)), "other")
        totals[kind] += seconds
    whole = sum(totals.values()) or 1.0
    return {kind: seconds / whole for kind, seconds in sorted(totals.items(), key=lambda kv: -kv[1]) if seconds}


def write_trace(prof, folder: str | Path, rank: int) -> Path:
    """The Chrome/Perfetto JSON trace of this rank (open it at https://ui.perfetto.dev)."""
    path = Path(folder) / f"trace_rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def format_top_kernels(rows: list[dict]) -> str:
    lines = [f"{'self time':>10} {'share':>6} {'calls':>6}  kernel"]
    for r in rows:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(f"{r['self_s'] * 1e3:>8.2f}ms {r['share']:>6.1%} {r['calls']:>6}  {name}")
    return "\n".join(lines)
