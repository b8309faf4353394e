"""`onenode bench`: train a preset for a few steps on synthetic tokens and report how fast it ran.

    onenode bench --preset tiny --steps 5                       # CPU, seconds
    onenode bench --preset a1-1gpu --seq-len 4096 --out run.json --profile prof/
    torchrun --nproc-per-node 2 -m onenode.cli bench --preset a1-1gpu --dp 2 --ep 2

Reports tokens/s (total and per GPU), step time (median and spread, warm-up excluded), MFU from
the tensor-core FLOP model (`onenode.flops`) against the 989 TFLOP/s bf16 peak of H100/H200
(and, with `--measure-ceiling`, against a large bf16 matmul measured on the spot), peak memory,
and the share of a short profiled window spent in compute and in collectives.

Precision follows torchtitan: parameters and optimizer state stay float32 (the master copy) and
each layer computes on bf16 copies made once per step (over several ranks, gathered by FSDP2's
mixed-precision policy; on one GPU, kept by `parallel/mixed_precision.py` with no FSDP), reducing
gradients in float32; nothing runs under autocast. The data are random
token ids from a seeded generator, so no dataset is needed and every run sees the same batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import statistics
import time
from pathlib import Path

import torch

from .flops import H100_H200_BF16_PEAK, mfu, model_flops
from .model import build_model, cross_entropy_loss, get_preset
from .model.config import PRESETS
from .model.nemotron_h import CausalLMOutput
from .parallel import ParallelDims, ParallelModel, parallelize
from .parallel.compile_and_checkpoint import prepare_layers, uses_cuda_graphs
from .parallel.distributed import init_distributed, local_device
from .profiling import (
    format_top_kernels,
    kernel_mix,
    launches,
    profiled,
    self_times,
    time_split,
    top_kernels,
    write_trace,
)
from .train.logging import environment, git_commit
from .train.step import build_optimizer, train_step

RECORD_VERSION = 1


def is_main_process() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


# -- model ---------------------------------------------------------------------------------------
class TransformersPeer(torch.nn.Module):
    """A transformers causal LM behind this kit's call: `peer(input_ids, labels)` with the labels
    already shifted (transformers would shift them again), the loss the kit's plain one over the
    model's logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        logits = self.model(input_ids).logits
        return CausalLMOutput(logits=logits, loss=None if labels is None else cross_entropy_loss(logits, labels))


def build_transformers_peer(model: torch.nn.Module, experts_implementation: str) -> TransformersPeer:
    """transformers' own `NemotronHForCausalLM` with the same config and the same weights.

    This is the peer a student would try first; its MoE runs `experts_implementation`
    (`grouped_mm` by default in transformers, `eager` for the per-expert loop).
    """
    try:
        import transformers
    except ImportError:
        raise SystemExit("--impl transformers needs transformers >= 5.3: pip install 'transformers>=5.3'") from None
    from .model.hf_io import adapt_state_dict

    device = next(model.parameters()).device
    hf_config = transformers.NemotronHConfig(
        **model.config.to_hf_dict() | {"use_cache": False},  # training: no inference cache
        experts_implementation=experts_implementation, attn_implementation="sdpa")
    with torch.device(device):
        peer = transformers.NemotronHForCausalLM(hf_config)
    peer.load_state_dict(adapt_state_dict(model.state_dict(), peer), strict=True)
    return TransformersPeer(peer)


def prepare_model(args, config, world: int, device: torch.device,
                  dtype: torch.dtype | None) -> tuple[ParallelModel | torch.nn.Module, dict]:
    """Build, compile, checkpoint and parallelize the model (`prepare_layers` says why in that
    order), computing in `dtype` (`parallelize` sets the precision, on one process too); returns it
    and its layout."""
    if args.impl == "transformers" and (world > 1 or args.compile != "off" or args.activation_checkpointing):
        raise SystemExit("--impl transformers runs on one device, eager, without activation checkpointing: "
                         "drop --compile/--activation-checkpointing and run one process")
    dp = args.dp or world // args.pp
    if dp * args.pp != world:
        raise SystemExit(f"--dp {dp} x --pp {args.pp} must equal the number of processes ({world}): "
                         "launch with torchrun --nproc-per-node DP*PP")
    if args.ep > 1 and world == 1:
        raise SystemExit(f"--ep {args.ep} needs as many processes: launch with torchrun --nproc-per-node {args.ep}")
    if uses_cuda_graphs(args.compile_mode) and (world > 1 or device.type != "cuda" or args.compile == "off"):
        raise SystemExit("--cuda-graphs replays compiled layers on one GPU: add --compile blocks and run one "
                         "process on a CUDA device (under FSDP the graphs would be recorded again every step)")
    if args.compile_mode is not None and args.compile == "off":
        raise SystemExit(f"--compile-mode {args.compile_mode} applies to compiled layers: add --compile blocks")
    model = build_model(config, seed=args.seed, device=device)
    prepare_layers(model, compile=args.compile, activation_checkpointing=args.activation_checkpointing,
                   compile_mode=args.compile_mode)
    if args.impl == "transformers":
        model = build_transformers_peer(model, args.experts_implementation)
    pipeline = {"schedule": args.pp_schedule, "microbatches": args.microbatches} if args.pp > 1 else {}
    model = parallelize(model, ParallelDims(dp=dp, ep=args.ep, pp=args.pp), param_dtype=dtype, **pipeline)
    return model, {"world_size": world, "dp": dp, "ep": args.ep, "pp": args.pp}


# -- measuring -----------------------------------------------------------------------------------
def synthetic_batches(vocab_size: int, batch: int, seq_len: int, seed: int, rank: int):
    """Endless (input_ids, labels) of random tokens; each data-parallel rank gets its own stream."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def matmul_ceiling(device: torch.device) -> float:
    """Achieved FLOP/s of one large square matmul: bf16 8192^3 on CUDA, float32 1024^3 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 20 if device.type == "cuda" else 3
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_max_rss"  # KiB on Linux


def _max_over_ranks(value: float, world: int, device: torch.device) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([float(value)], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run(args) -> dict:
    rank, world = init_distributed()
    device = torch.device(args.device) if args.device else local_device()
    overrides = {"mamba_kernel": args.mamba_kernel} if args.mamba_kernel else {}
    config = get_preset(args.preset, **overrides)
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.dtype]
    torch.manual_seed(args.seed)

    model, layout = prepare_model(args, config, world, device, dtype)
    cuda_graphs = uses_cuda_graphs(args.compile_mode)
    optimizer = build_optimizer(model, "adamw", lr=args.lr)
    batches = synthetic_batches(config.vocab_size, args.micro_batch, args.seq_len, args.seed, rank)
    tokens_per_step = (world // args.pp) * args.micro_batch * args.seq_len
    step_times, losses = [], []

    def step() -> dict:
        input_ids, labels = (t.to(device, non_blocking=True) for t in next(batches))
        if cuda_graphs:  # a new step: replay the graphs, do not wait for the last step's backwards
            torch.compiler.cudagraph_mark_step_begin()
        return train_step(model, optimizer, input_ids, labels, grad_clip=1.0, fused_update=not args.unfused_update)

    from tqdm import tqdm

    show = rank == 0 and not args.quiet
    with tqdm(total=args.warmup + args.steps, desc=f"bench {args.preset}", disable=not show, unit="step") as bar:
        for i in range(args.warmup + args.steps):
            _sync(device)
            start = time.perf_counter()
            out = step()
            _sync(device)
            elapsed = time.perf_counter() - start
            losses.append(out["loss"])
            if i >= args.warmup:
                step_times.append(elapsed)
            bar.set_postfix(loss=f"{out['loss']:.3f}" if out["loss"] is not None else "-",
                            tok_s=f"{tokens_per_step / elapsed:,.0f}")
            bar.update()

    split, kernels, mix, launched, trace = None, [], None, None, None
    if args.profile or world > 1:
        with profiled(device) as prof:
            start = time.perf_counter()
            for _ in range(args.profile_steps):
                step()
            _sync(device)
            window = time.perf_counter() - start
        split = {"window_s": window, **time_split(prof, device)}
        times = self_times(prof, device)
        kernels, mix, launched = top_kernels(times), kernel_mix(times), launches(times, args.profile_steps)
        if args.profile:
            trace = str(write_trace(prof, args.profile, rank))

    median = statistics.median(step_times)
    report = model_flops(config, args.seq_len, args.micro_batch)
    tokens_per_s = tokens_per_step / median
    memory, memory_kind = peak_memory_bytes(device)
    memory = _max_over_ranks(memory, world, device)
    n_gpus = world  # GPUs, or CPU processes
    results = {
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / n_gpus,
        "step_time_median_s": median,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "step_time_stdev_s": statistics.stdev(step_times) if len(step_times) > 1 else 0.0,
        "matmul_flops_per_token": report.matmul_flops_per_token,
        "other_flops_per_token": report.other_flops_per_token,
        "achieved_tflops_per_gpu": tokens_per_s * report.matmul_flops_per_token / n_gpus / 1e12,
        "peak_tflops": args.peak / 1e12,
        "mfu": mfu(tokens_per_s, report.matmul_flops_per_token, n_gpus, args.peak),
        "ceiling_tflops": None,
        "mfu_vs_ceiling": None,
        "peak_memory_gib": memory / 2**30,
        "memory_kind": memory_kind,
        "step_split": split,
        # shares of the profiled window's wall time (profiler overhead included)
        "compute_share": split and split["compute_s"] / split["window_s"],
        "comm_share": split and split["comm_s"] / split["window_s"],
        "exposed_comm_share": split and split["exposed_comm_s"] / split["window_s"],
        # GPU: time no kernel ran (host-bound steps, syncs); CPU: profiler bookkeeping
        "idle_share": split and max(0.0, 1 - split["busy_s"] / split["window_s"]),
        # kernels (CPU: ops) launched per profiled step, and their mean self time
        "kernels_per_step": launched and launched["kernels_per_step"],
        "mean_kernel_s": launched and launched["mean_kernel_s"],
    }
    if args.measure_ceiling:
        ceiling = matmul_ceiling(device)
        results["ceiling_tflops"] = ceiling / 1e12
        results["mfu_vs_ceiling"] = mfu(tokens_per_s, report.matmul_flops_per_token, n_gpus, ceiling)
    return {
        "record": "onenode-bench",
        "version": RECORD_VERSION,
        "command": command_line(args, world),
        "commit": git_commit() or "unknown",
        "impl": args.impl if args.impl == "onenode" else f"transformers/{args.experts_implementation}",
        "preset": args.preset,
        "config": dataclasses.asdict(config),
        "layout": {**layout, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                   "activation_checkpointing": args.activation_checkpointing, "compile": args.compile,
                   "cuda_graphs": cuda_graphs, "compile_mode": args.compile_mode,
                   "unfused_update": args.unfused_update, "dtype": args.dtype,
                   "optimizer": "adamw", "lr": args.lr, "seed": args.seed, "mamba_kernel": config.mamba_kernel},
        "env": environment(world) | {"cuda": torch.version.cuda, "device_type": device.type},
        "steps": {"warmup": args.warmup, "measured": args.steps, "step_times_s": step_times,
                  "losses": losses, "profiled": args.profile_steps if split else 0},
        "results": results,
        "flops": {"per_kind_forward": report.per_kind(), "causal_attention": True},
        "top_kernels": kernels,
        "kernel_mix": mix,
        "trace": trace,
    }


def json_safe(value):
    """`value` with infinities and NaNs as strings, so the record is strict JSON (jq, browsers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def command_line(args, world: int) -> str:
    """The command that repeats this run, every option spelled out."""
    launcher = f"torchrun --nproc-per-node {world} -m onenode.cli" if world > 1 else "onenode"
    words = [launcher, "bench"]
    for key, value in vars(args).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        words.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return " ".join(words)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


def format_table(record: dict) -> str:
    r, lay = record["results"], record["layout"]
    rows = [
        ("model", f"{record['preset']} ({record['impl']}), {lay['micro_batch']} x {lay['seq_len']} tokens per rank"),
        ("layout", f"world {lay['world_size']}: dp {lay['dp']} ep {lay['ep']} pp {lay['pp']}, "
                   f"AC {'on' if lay['activation_checkpointing'] else 'off'}, compile {lay['compile']}"
                   f"{' + CUDA graphs' if lay.get('cuda_graphs') else ''}, {lay['dtype']}"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f} total, {r['tokens_per_s_per_gpu']:,.0f} per GPU (or CPU process)"),
        ("step time", f"median {r['step_time_median_s'] * 1e3:.1f} ms (min {r['step_time_min_s'] * 1e3:.1f}, "
                      f"max {r['step_time_max_s'] * 1e3:.1f}, stdev {r['step_time_stdev_s'] * 1e3:.1f}) "
                      f"over {record['steps']['measured']} steps"),
        ("FLOPs/token", f"{r['matmul_flops_per_token'] / 1e9:.3f} G tensor-core (fwd+bwd, causal-half attention), "
                        f"{r['other_flops_per_token'] / 1e9:.3f} G other"),
        ("MFU", f"{_percent(r['mfu'])} of {r['peak_tflops']:.0f} TFLOP/s "
                f"({r['achieved_tflops_per_gpu']:.3g} TFLOP/s per GPU)"),
    ]
    if r["ceiling_tflops"]:
        rows.append(("vs ceiling", f"{_percent(r['mfu_vs_ceiling'])} of a measured "
                                   f"{r['ceiling_tflops']:.3g} TFLOP/s matmul"))
    rows.append(("peak memory", f"{r['peak_memory_gib']:.2f} GiB ({r['memory_kind']})"))
    if r["step_split"]:
        rows.append(("time split", f"compute {r['compute_share']:.1%}, communication {r['comm_share']:.1%} "
                                   f"(exposed {r['exposed_comm_share']:.1%}), idle {r['idle_share']:.1%} "
                                   f"of {r['step_split']['window_s']:.2f} s "
                                   f"profiled ({record['steps']['profiled']} steps)"))
    if r["kernels_per_step"]:
        what = "kernels" if record["env"]["device_type"] == "cuda" else "ops"
        rows.append(("launches", f"{r['kernels_per_step']:,.0f} {what} per step, "
                                 f"{r['mean_kernel_s'] * 1e6:.1f} us each on average"))
    if record["kernel_mix"]:
        rows.append(("kernel mix", ", ".join(f"{kind} {share:.1%}" for kind, share in record["kernel_mix"].items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# -- command line --------------------------------------------------------------------------------
def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time training steps of a preset: tokens/s, MFU, memory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        record = run(args)
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
