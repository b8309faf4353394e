"""NCCL all-reduce smoke test for one node: every GPU joins, the sum is checked, bandwidth printed.

    torchrun --standalone --nproc_per_node=8 cluster/nccl_smoke.py [--mib 256]

Exits non-zero (with the reason) if a rank cannot join, the sum is wrong, or CUDA is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="size of the all-reduced tensor")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("nccl_smoke: CUDA is not available to torch", file=sys.stderr)
        return 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    x = torch.full((args.mib * 2**20 // 4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)  # warm-up, and the check
    expected = world * (world + 1) / 2
    ok = bool(torch.all(x == expected))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    # Bus bandwidth of a ring all-reduce, as nccl-tests reports it.
    busbw = 2 * (world - 1) / world * x.numel() * 4 / seconds / 1e9
    flags = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        status = "ok" if flags.item() else "WRONG SUM"
        print(f"nccl_smoke: {world} GPUs, {args.mib} MiB all-reduce: {status}, {seconds * 1e3:.1f} ms, "
              f"bus {busbw:.0f} GB/s")
    dist.destroy_process_group()
    return 0 if flags.item() else 1


if __name__ == "__main__":
    sys.exit(main())
