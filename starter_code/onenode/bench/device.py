"""What a benchmark asks of the device and the ranks: synthetic batches, a matmul ceiling, waits,
peak memory, the maximum over ranks."""

from __future__ import annotations

import resource
import time

import torch


def is_main_process() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def synthetic_batches(vocab_size: int, global_batch: int, seq_len: int, seed: int, dp_rank: int, dp: int):
    """Endless (input_ids, labels) of random tokens: step i's global batch is drawn from a
    generator seeded `seed + 1 + i`, and this data-parallel rank takes its rows, as the A1 grader
    draws each timed step's batch from the seed it hands out (so the two give the same losses)."""
    rows = global_batch // dp
    step = 0
    while True:
        gen = torch.Generator().manual_seed(seed + 1 + step)
        tokens = torch.randint(0, vocab_size, (global_batch, seq_len + 1), generator=gen)
        shard = tokens[dp_rank * rows:(dp_rank + 1) * rows]
        step += 1
        yield shard[:, :-1].contiguous(), shard[:, 1:].contiguous()


def matmul_ceiling(device: torch.device) -> float:
    """Achieved FLOP/s of one large square matmul: bf16 8192^3 on CUDA, float32 1024^3 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 20 if device.type == "cuda" else 3
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return peak_resident_bytes(), "cpu_max_rss"


def peak_resident_bytes() -> int:
    """This process's peak resident host memory (pinned memory included): on a GPU, where
    `optimizer.state: cpu` keeps the optimizer state."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def max_over_ranks(value: float, world: int, device: torch.device) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([float(value)], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
