"""The process group: joining the one torchrun started, and the one reduction every caller needs."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int]:
    """Join torchrun's process group when launched by it; (rank, world size)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        return dist.get_rank(), world
    return 0, 1


def local_device() -> torch.device:
    """This rank's GPU (the current CUDA device), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def mean_over_ranks(value: float | None, device: torch.device | str, group=None) -> float | None:
    """The mean of `value` over the ranks of `group` that have one (None elsewhere: with pipeline
    parallelism only the last stage computes the loss); `value` itself without a process group.
    `device` is where the collective runs (the rank's GPU under NCCL)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    both = torch.tensor([value or 0.0, 0.0 if value is None else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(both, group=group)
    return float(both[0] / both[1]) if both[1] > 0 else None
