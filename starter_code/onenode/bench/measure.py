"""The benchmark itself: the model as the options lay it out, trained for the warm-up and measured
steps (and a profiled window), and the record of what was measured."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..flops import mfu, model_flops
from ..parallel.distributed import init_distributed
from ..parallel.float8 import summary as float8_summary
from ..profiling import kernel_mix, launches, profiled, self_times, time_split, top_kernels, write_trace
from ..train import master_update
from ..train.assembly import assemble, data_parallel_size
from ..train.logging import environment, git_commit
from ..train.recipe import Recipe, RecipeError, from_dict, load_recipe, parse_override
from .device import matmul_ceiling, max_over_ranks, peak_memory_bytes, peak_resident_bytes, sync, synthetic_batches
from .peer import build_transformers_peer
from .record import RECORD_VERSION, command_line

# `onenode bench`'s shorthand options: each sets one recipe field (None: not given)
SHORTHANDS = {"preset": "model.preset", "mamba_kernel": "model.mamba_kernel",
              "attention_kernel": "model.attention_kernel", "seed": "seed",
              "seq_len": "train.seq_len", "micro_batch": "train.micro_batch_size", "dtype": "train.precision",
              "activation_checkpointing": "train.activation_checkpointing", "compile": "train.compile",
              "cuda_graphs": "train.cuda_graphs", "device": "train.device", "lr": "optimizer.lr",
              "dp": "parallel.dp", "ep": "parallel.ep", "pp": "parallel.pp", "pp_schedule": "parallel.pp_schedule",
              "microbatches": "parallel.microbatches"}


def bench_recipe(args, world: int, steps: int) -> Recipe:
    """The recipe this bench runs: `--recipe` (else the tiny preset with the kit's defaults), then
    the shorthand options, then each `--set key=value`, in that order. Without a recipe file the
    global batch is `--micro-batch` sequences per data-parallel rank, and the precision bf16 on a
    GPU and float32 on a CPU. The token budget is the steps it runs."""
    overrides = {field: getattr(args, name) for name, field in SHORTHANDS.items()
                 if getattr(args, name, None) not in (None, False)}
    if args.unfused_update:
        overrides["train.fused_update"] = False
    for text in args.set or ():
        key, value = parse_override(text)
        overrides[key] = value
    if args.recipe:
        recipe = load_recipe(args.recipe)
    else:
        on_gpu = torch.cuda.is_available() and overrides.get("train.device", "auto") != "cpu"
        recipe = from_dict({"name": "bench", "model": {"preset": "tiny"}, "data": {"source": "synthetic"},
                            "train": {"token_budget": 1 << 40, "seq_len": 256, "micro_batch_size": 1,
                                      "precision": "bf16" if on_gpu else "fp32"}})
    recipe = recipe.with_overrides({**overrides, "train.token_budget": 1 << 40})
    if not args.recipe and "train.global_batch_size" not in overrides:
        dp = max(1, data_parallel_size(recipe, world))
        recipe = recipe.with_overrides({"train.global_batch_size": recipe.train.micro_batch_size * dp})
    return recipe.with_overrides({"train.token_budget": recipe.tokens_per_step * steps})


def _qualified_name(module) -> str:
    """The trained module's class, as `module.Class`: which implementation the record timed."""
    module = getattr(module, "_orig_mod", module)
    return f"{type(module).__module__}.{type(module).__qualname__}"


def compile_note(training, warmup: int) -> str | None:
    """What the first step compiles on a GPU with torch.compile, and what that costs (a cold first
    step took 90 to 145 s on one H200, benchmarks/results/): a bench that prints nothing that long
    looks hung. None: nothing (the fused update's Triton kernel compiles in seconds)."""
    t = training.recipe.train
    fused = t.fused_update and master_update.applies(training.parallel.master_weights, training.optimizer)
    compiled_update = fused and master_update.compiled_on_gpu(t.update_kernel())
    compiled = (["the fused optimizer update"] * compiled_update
                + ["the layers"] * (t.compile != "off"))
    if training.device.type != "cuda" or not compiled:
        return None
    measured = "it is warm-up, not measured" if warmup else "--warmup 0 measures it: pass --warmup 1 or more"
    return (f"the first step compiles {' and '.join(compiled)} with torch.compile: a minute or two with a cold cache, "
            "less once $TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER) holds this command's kernels; "
            f"{measured}")


def run(args) -> dict:
    started = time.perf_counter()
    phases = {}  # wall seconds of each part of the bench: where the time to a first number goes

    def phase_done(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = now - since
        return now

    _, world = init_distributed()
    steps = args.warmup + args.steps + (args.profile_steps if args.profile or world > 1 else 0)
    try:
        recipe = bench_recipe(args, world, steps)
        if args.impl == "transformers" and (world > 1 or recipe.train.compile != "off"
                                            or recipe.train.activation_checkpointing):
            raise RecipeError("--impl transformers runs on one device, eager, without activation checkpointing: "
                              "drop --compile/--activation-checkpointing and run one process")
        peer = (lambda model: build_transformers_peer(model, args.experts_implementation)) \
            if args.impl == "transformers" else None
        training = assemble(recipe, replace_model=peer)
    except RecipeError as e:
        raise SystemExit(f"onenode bench: {e}") from None
    mark = phase_done("assemble", started)
    config, device, layout, rank = training.config, training.device, training.layout, training.rank
    if training.float8 and rank == 0 and not args.quiet:
        print(f"onenode bench: {float8_summary(training.float8)}", flush=True)
    batches = synthetic_batches(config.vocab_size, recipe.train.global_batch_size, recipe.train.seq_len, recipe.seed,
                                training.dp_rank, layout.dp)
    tokens_per_step = recipe.tokens_per_step
    step_times, warmup_times, losses = [], [], []  # warm-up: the first step compiles (the time to a first number)

    def step() -> dict:
        input_ids, labels = (t.to(device, non_blocking=True) for t in next(batches))
        return training.step(input_ids, labels)

    from tqdm import tqdm

    show = rank == 0 and not args.quiet
    if show and (note := compile_note(training, args.warmup)):
        print(f"onenode bench: {note}", flush=True)
    if not args.warmup:
        phases["warmup"] = 0.0
    with tqdm(total=args.warmup + args.steps, desc=f"bench {recipe.model.preset or recipe.name}", disable=not show,
              unit="step") as bar:
        for i in range(args.warmup + args.steps):
            sync(device)
            start = time.perf_counter()
            out = step()
            sync(device)
            elapsed = time.perf_counter() - start
            losses.append(out["loss"])
            (step_times if i >= args.warmup else warmup_times).append(elapsed)
            bar.set_postfix(loss=f"{out['loss']:.3f}" if out["loss"] is not None else "-",
                            tok_s=f"{tokens_per_step / elapsed:,.0f}")
            bar.update()
            if i == args.warmup - 1 and (note := training.cuda_graph_note()) and show:
                print(f"onenode bench: {note}", flush=True)
            if i == args.warmup - 1:
                mark = phase_done("warmup", mark)
    mark = phase_done("measured", mark)

    split, kernels, mix, launched, trace = None, [], None, None, None
    if args.profile or world > 1:
        with profiled(device) as prof:
            start = time.perf_counter()
            for _ in range(args.profile_steps):
                step()
            sync(device)
            window = time.perf_counter() - start
        mark = phase_done("profile", mark)
        split = {"window_s": window, **time_split(prof, device)}
        times = self_times(prof, device)
        kernels, mix = top_kernels(times, limit=args.top_kernels), kernel_mix(times)
        launched = launches(times, args.profile_steps)
        mark = phase_done("profile_read", mark)
        if args.profile:
            trace = str(write_trace(prof, args.profile, rank))
            mark = phase_done("trace", mark)

    median = statistics.median(step_times)
    report = model_flops(config, recipe.train.seq_len, layout.micro_batch)
    tokens_per_s = tokens_per_step / median
    memory, memory_kind = peak_memory_bytes(device)
    memory = max_over_ranks(memory, world, device)
    n_gpus = world  # GPUs, or CPU processes
    t = recipe.train
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
        "peak_cpu_memory_gib": max_over_ranks(peak_resident_bytes(), world, device) / 2**30,
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
        mark = time.perf_counter()
        ceiling = matmul_ceiling(device)
        results["ceiling_tflops"] = ceiling / 1e12
        results["mfu_vs_ceiling"] = mfu(tokens_per_s, report.matmul_flops_per_token, n_gpus, ceiling)
        phase_done("ceiling", mark)
    phases["total"] = time.perf_counter() - started
    return {
        "record": "onenode-bench",
        "version": RECORD_VERSION,
        "command": command_line(args, world),
        "commit": git_commit() or "unknown",
        "impl": args.impl if args.impl == "onenode" else f"transformers/{args.experts_implementation}",
        "preset": recipe.model.preset,
        "config": dataclasses.asdict(config),
        "recipe": recipe.to_dict(),
        "layout": {"world_size": world, "dp": layout.dp, "ep": layout.ep, "pp": layout.pp,
                   "micro_batch": layout.micro_batch, "accumulation": layout.accumulation, "seq_len": t.seq_len,
                   "activation_checkpointing": t.activation_checkpointing, "compile": t.compile,
                   "cuda_graphs": t.cuda_graphs, "cuda_graph_note": training.cuda_graph_note(),
                   "float8": training.float8 and float8_summary(training.float8),
                   "unfused_update": not t.fused_update, "update_kernel": t.update_kernel(), "dtype": t.precision,
                   "optimizer": recipe.optimizer.name, "lr": recipe.optimizer.lr, "seed": recipe.seed,
                   "mamba_kernel": config.mamba_kernel, "attention_kernel": config.attention_kernel,
                   "module": _qualified_name(training.parallel.model)},
        "env": environment(world) | {"cuda": torch.version.cuda, "device_type": device.type},
        "steps": {"warmup": args.warmup, "measured": args.steps, "step_times_s": step_times,
                  "warmup_step_times_s": warmup_times,
                  "losses": losses, "profiled": args.profile_steps if split else 0,
                  # wall seconds: assemble (model built, laid out), warmup, measured, profile (the profiled
                  # window), profile_read (its kernels tallied), trace (written: --profile), ceiling
                  # (--measure-ceiling), total (from the bench's start to its record; the interpreter's
                  # start and imports come before)
                  "phases_s": phases},
        "results": results,
        "flops": {"per_kind_forward": report.per_kind(), "causal_attention": True},
        "top_kernels": kernels,
        "kernel_mix": mix,
        "trace": trace,
    }
