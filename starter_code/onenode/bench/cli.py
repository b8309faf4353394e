"""`onenode bench`'s options and what it prints and writes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .. import bench
from ..flops import H100_H200_BF16_PEAK
from ..model.config import PRESETS
from ..profiling import format_top_kernels
from . import measure
from .device import is_main_process
from .record import format_table, json_safe


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time training steps of a preset: tokens/s, MFU, memory",
                              description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--impl", default="onenode", choices=["onenode", "transformers"],
                   help="this kit's model, or transformers' NemotronHForCausalLM with the same weights")
    p.add_argument("--experts-implementation", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                   help="transformers' MoE kernel, with --impl transformers")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run first and not measured")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per data-parallel rank per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: processes / pp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (inside dp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--pp-schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved_1f1b")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches per step (default: pp; --micro-batch must be a multiple)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", default="off", choices=["off", "mixers", "blocks"],
                   help="torch.compile per layer: mixers = all but MoE mixers, blocks = every block")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay each compiled layer as a CUDA graph (one GPU, one process, with --compile): "
                        "--compile-mode reduce-overhead")
    p.add_argument("--compile-mode", default=None,
                   choices=["reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode for every compiled layer (default: its default)")
    p.add_argument("--unfused-update", action="store_true",
                   help="one process in bf16: float32 gradients on the masters and torch's AdamW, not the fused "
                        "update (train/master_update.py)")
    p.add_argument("--mamba-kernel", default=None, choices=["auto", "torch", "mamba_ssm"],
                   help="override the preset's Mamba2 scan")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                   help="compute dtype; parameters and optimizer state stay fp32 (default: bf16 on CUDA, "
                        "fp32 on CPU)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="override the device (default: this rank's GPU, else cpu)")
    p.add_argument("--peak", type=float, default=H100_H200_BF16_PEAK, help="peak FLOP/s per GPU for MFU")
    p.add_argument("--measure-ceiling", action="store_true", help="also report MFU against a measured matmul")
    p.add_argument("--profile", metavar="DIR", default=None, help="write a torch.profiler trace per rank here")
    p.add_argument("--profile-steps", type=int, default=2, help="steps in the profiled window")
    p.add_argument("--top-kernels", type=int, default=15, help="kernels (CPU: ops) in the top-kernels table")
    p.add_argument("--out", metavar="FILE", default=None, help="write the JSON record here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.steps < 1 or args.warmup < 0 or args.micro_batch < 1 or args.seq_len < 1 or args.profile_steps < 1:
        raise SystemExit("onenode bench: --steps, --micro-batch, --seq-len and --profile-steps must be >= 1, "
                         "--warmup >= 0")
    if args.cuda_graphs:
        if args.compile_mode not in (None, "reduce-overhead"):
            raise SystemExit(f"onenode bench: --cuda-graphs is --compile-mode reduce-overhead, not "
                             f"{args.compile_mode}: give one of them")
        args.compile_mode = "reduce-overhead"
    try:
        record = measure.run(args)
    except torch.OutOfMemoryError as error:
        reason = str(error).split(". ")[0]
        raise SystemExit(f"onenode bench: out of memory at {args.micro_batch} x {args.seq_len} tokens per rank "
                         f"({reason}): lower --micro-batch or --seq-len, or add --activation-checkpointing") from None
    if is_main_process():
        print(format_table(record))
        if record["top_kernels"]:
            print("\ntop kernels in the profiled window:\n" + format_top_kernels(record["top_kernels"]))
        if record["trace"]:
            print(f"\ntrace: {record['trace']} (open in https://ui.perfetto.dev)")
        if args.out:
            path = Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(json_safe(record), indent=2, allow_nan=False) + "\n")
            print(f"record: {path}")
    return 0
