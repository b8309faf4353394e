"""The benchmark itself: the model as the options lay it out, trained for the warm-up and measured
steps (and a profiled window), and the record of what was measured."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..flops import mfu, model_flops
from ..model import build_model, get_preset
from ..parallel import ParallelDims, ParallelModel, parallelize
from ..parallel.compile_and_checkpoint import prepare_layers, uses_cuda_graphs
from ..parallel.distributed import init_distributed, local_device
from ..profiling import kernel_mix, launches, profiled, self_times, time_split, top_kernels, write_trace
from ..train.logging import environment, git_commit
from ..train.step import build_optimizer, train_step
from .device import matmul_ceiling, max_over_ranks, peak_memory_bytes, sync, synthetic_batches
from .peer import build_transformers_peer
from .record import RECORD_VERSION, command_line


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
            sync(device)
            start = time.perf_counter()
            out = step()
            sync(device)
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
            sync(device)
            window = time.perf_counter() - start
        split = {"window_s": window, **time_split(prof, device)}
        times = self_times(prof, device)
        kernels, mix = top_kernels(times, limit=args.top_kernels), kernel_mix(times)
        launched = launches(times, args.profile_steps)
        if args.profile:
            trace = str(write_trace(prof, args.profile, rank))

    median = statistics.median(step_times)
    report = model_flops(config, args.seq_len, args.micro_batch)
    tokens_per_s = tokens_per_step / median
    memory, memory_kind = peak_memory_bytes(device)
    memory = max_over_ranks(memory, world, device)
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
