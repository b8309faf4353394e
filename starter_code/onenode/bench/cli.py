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
from .record import format_table, json_safe, output_help


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time training steps of a preset: tokens/s, MFU, memory",
                              description=bench.__doc__, epilog=output_help(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", metavar="FILE", default=None,
                   help="a training recipe (a2_pretrain/recipes/): its model, batch, layout and precision; "
                        "the options below change its fields")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="a recipe field, as onenode train takes it (repeatable): e.g. --set train.compile=blocks "
                        "--set train.cuda_graphs=true; applied after every other option")
    p.add_argument("--impl", default="onenode", choices=["onenode", "transformers"],
                   help="this kit's model, or transformers' NemotronHForCausalLM with the same weights")
    p.add_argument("--experts-implementation", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                   help="transformers' MoE kernel, with --impl transformers")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run first and not measured")
    shorthand = p.add_argument_group("recipe fields", "each sets one field of the recipe (onenode train's --set)")
    shorthand.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model.preset (default tiny)")
    shorthand.add_argument("--micro-batch", type=int, default=None,
                           help="train.micro_batch_size: sequences per data-parallel rank per step (default 1)")
    shorthand.add_argument("--seq-len", type=int, default=None, help="train.seq_len (default 256)")
    shorthand.add_argument("--dp", type=int, default=None, help="parallel.dp (default: processes / pp)")
    shorthand.add_argument("--ep", type=int, default=None, help="parallel.ep: expert-parallel degree (inside dp)")
    shorthand.add_argument("--pp", type=int, default=None, help="parallel.pp: pipeline stages")
    shorthand.add_argument("--pp-schedule", default=None, help="parallel.pp_schedule: gpipe, 1f1b, interleaved_1f1b")
    shorthand.add_argument("--microbatches", type=int, default=None,
                           help="parallel.microbatches: pipeline microbatches per step (default: pp)")
    shorthand.add_argument("--activation-checkpointing", action="store_true", help="train.activation_checkpointing")
    shorthand.add_argument("--compile", default=None, choices=["off", "mixers", "blocks"],
                           help="train.compile: torch.compile per layer: mixers = all but MoE mixers, blocks = every "
                                "block")
    shorthand.add_argument("--cuda-graphs", action="store_true",
                           help="train.cuda_graphs: replay each compiled layer as a CUDA graph (one GPU, one process, "
                                "with --compile)")
    shorthand.add_argument("--unfused-update", action="store_true",
                           help="train.fused_update=false: one process in bf16, float32 gradients on the masters and "
                                "torch's AdamW, not the fused update (train/master_update.py)")
    shorthand.add_argument("--mamba-kernel", default=None, choices=["auto", "torch", "mamba_ssm"],
                           help="model.mamba_kernel: the Mamba2 scan")
    shorthand.add_argument("--attention-kernel", default=None, choices=["sdpa", "flex"],
                           help="model.attention_kernel: torch's SDPA or FlexAttention (deterministic without "
                                "flash attention's slower backward)")
    shorthand.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                           help="train.precision: bf16 computes on bf16 copies of float32 masters (default: bf16 on "
                                "CUDA, fp32 on CPU)")
    shorthand.add_argument("--seed", type=int, default=None, help="seed: the weights and the batches")
    shorthand.add_argument("--device", default=None, help="train.device (default: this rank's GPU, else cpu)")
    shorthand.add_argument("--lr", type=float, default=None, help="optimizer.lr (default 3e-4)")
    p.add_argument("--peak", type=float, default=H100_H200_BF16_PEAK, help="peak FLOP/s per GPU for MFU")
    p.add_argument("--measure-ceiling", action="store_true", help="also report MFU against a measured matmul")
    p.add_argument("--profile", metavar="DIR", default=None, help="write a torch.profiler trace per rank here")
    p.add_argument("--profile-steps", type=int, default=1,
                   help="steps in the profiled window (one: the starter's trace reads in a third of two's time)")
    p.add_argument("--top-kernels", type=int, default=15, help="kernels (CPU: ops) in the top-kernels table")
    p.add_argument("--out", metavar="FILE", default=None, help="write the JSON record here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.steps < 1 or args.warmup < 0 or args.profile_steps < 1 or any(
            value is not None and value < 1 for value in (args.micro_batch, args.seq_len)):
        raise SystemExit("onenode bench: --steps, --micro-batch, --seq-len and --profile-steps must be >= 1, "
                         "--warmup >= 0")
    try:
        record = measure.run(args)
    except torch.OutOfMemoryError as error:
        reason = str(error).split(". ")[0]
        shape = "the recipe's micro-batch" if args.recipe else \
            f"{args.micro_batch or 1} x {args.seq_len or 256} tokens per rank"
        raise SystemExit(f"onenode bench: out of memory at {shape} ({reason}): lower --micro-batch or --seq-len, or "
                         "add --activation-checkpointing") from None
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
