"""`onenode bench` with one thing changed, to test a guess about where a training step's time goes.

Run from a kit tree (a patched copy, for the solution), on a GPU:

    PYTHONPATH=starter_code python3 benchmarks/step_probes.py loss-chunk --logits 536870912 -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py tf32 -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py host-syncs -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py cpp-wrapper -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py compile-mode --mode reduce-overhead -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py router-own-unit -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py one-unit -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py fsdp-one-rank -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py unfused-update -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py update-chunk --chunk 4 -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py router-bf16-gemm -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py ssd-carry-recurrence -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py ssd-carry-bf16 -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py liger-loss -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py reductions-benchmarked -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py inductors-reduction-rule -- BENCH_OPTIONS
    PYTHONPATH=starter_code python3 benchmarks/step_probes.py fork-workers -- BENCH_OPTIONS

- `loss-chunk --logits N`: the fused head's chunk holds N logits (`model/loss.py`'s `CHUNK_LOGITS`);
- `tf32`: float32 matmuls (the router, the SSD's cross-chunk carry) on TF32 tensor cores;
- `host-syncs`: every call that makes the host wait for the GPU, counted by where it was made
  (`torch.cuda.set_sync_debug_mode`), printed after the bench's table;
- `cpp-wrapper`: inductor's C++ wrapper launches a compiled block's kernels (its default, a Python
  wrapper, costs host time per kernel: the launch overhead a one-sequence step is bound by);
- `compile-mode --mode reduce-overhead`: each compiled block replayed as a CUDA graph (the recipe's
  `train.cuda_graphs`; the other modes of torch.compile are no recipe field and are refused);
- `router-own-unit`: each MoE router gathered float32 as an FSDP unit of its own
  (`fsdp.Units.routers_apart`), not bf16 with the rest of its layer: the unit's hooks split a
  compiled MoE block in three graphs;
- `one-unit`: the whole model one FSDP unit, no unit per layer (`fsdp.Units.per_layer`): on one
  GPU sharding frees nothing, and each unit costs hooks and copy kernels per step;
- `fsdp-one-rank`: one process laid out with FSDP2's mixed precision over a group of one rank,
  not `parallel/mixed_precision.py`'s bf16 copies (the same numbers); `one-unit` and
  `router-own-unit` change only that layout: on one process, combine them with it;
- `unfused-update`: one process in bf16 without `train/master_update.py`'s fused step (`onenode
  bench --unfused-update`): the gradients cast to float32 on the masters, clipped, torch's fused
  AdamW, the copies cast again at the next forward;
- `update-chunk --chunk N`: the fused update compiled by inductor (`train.fused_update_kernel:
  inductor`) over chunks of N parameters (`master_update.CHUNK`, 16): smaller chunks repeat more
  often, so fewer distinct graphs of fewer nodes compile in a cold first step (one H200, a1-1gpu:
  71 s with 4 against 103 s with 16, benchmarks/results/2026-12-04-h200-first-number/), for more
  calls a step;
- `router-bf16-gemm`: each router's logits as a bf16 GEMM that accumulates and returns float32
  (`torch.mm(..., out_dtype=torch.float32)`) on tensor cores, the gradients' GEMMs likewise from the
  logits' gradient rounded to bf16, not `F.linear` on float32 copies on CUDA cores (about 3 ms of
  the A2 baseline's 257 ms step on one H100: +0.6%, results/2026-12-06-h100-int8-kernel-router/).
  Under the kit's bf16 copies the router's inputs are bf16 values, so the forward's products are the
  same and only their order of summation differs; a global TF32 (`tf32`) made the step slower there.
  A GPU only;
- `ssd-carry-recurrence`: the torch SSD scan's states carried across chunks by a recurrence
  (`ssd_probe.carry_by_recurrence`), not `model/mamba2.py`'s float32 product with the matrix of
  decays (three CUDA-core GEMMs, about 13 ms of that step);
- `ssd-carry-bf16`: that product on bf16 operands with float32 accumulation (`ssd_probe.carry_on_bf16`),
  on tensor cores;
- `liger-loss`: the LM head and its loss as liger-kernel's fused linear cross-entropy (`pip install
  liger-kernel`, 0.8.5: a Triton wheel of 0.9 MB), not `model/loss.py`'s chunked head (its logsumexp
  kernel alone was 14.5 ms of the best layout's step on one H100,
  results/2026-12-06-h100-head-grad-deterministic/). The same mean over the labels that are not -100;
  the bench's first loss shows they agree. A GPU only;
- `reductions-benchmarked`: under torch's deterministic algorithms inductor keeps one config a
  reduction kernel by a fixed rule (`triton_heuristics.filter_reduction_configs_for_determinism`:
  another config may sum a row in another order) instead of timing its candidates; this probe
  lets it time them, the bound on what that rule costs. In the A2 baseline's deterministic step two
  of the torch scan's fused sums ran five times slower than without the mode
  (results/2026-12-07-h100-deterministic-cost-int8-curve/). Its runs' bits may then differ between
  runs: a measurement, not a mode to train in. Its kernels compile in this process (inductor's
  compile workers would keep the rule). A GPU only;
- `inductors-reduction-rule`: the deterministic mode's tiled reductions keep the config inductor's
  own rule picks (the smallest tile), not the kit's largest
  (`parallel.compile_and_checkpoint.tile_deterministic_reductions`): the step before that rule;
- `fork-workers`: the kit's rule, with inductor's compile workers forked from this process (inductor's
  `worker_start_method = "fork"`, its default number of them) instead of every kernel compiled here:
  a forked worker has the rule, so a cold compile could run in parallel again (the rule's in-process
  compile took a cold first step of the A2 baseline from 29 s to 70 s on one H100). Whether a worker
  forked after CUDA started applies it is what the run shows: the torch scan's two tiled sums take
  about 1.2 ms a step with the rule, 5.3 without.

Probes combine: `fsdp-one-rank one-unit -- ...` applies both.

The record's top-kernel list holds 80 kernels instead of 15. `benchmarks/README.md` lists the
records made with these probes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import traceback
import warnings

import torch
import torch._inductor.config

import onenode.parallel
from onenode.cli import main as onenode_main
from onenode.model import loss
from onenode.parallel import fsdp
from onenode.train import master_update


def count_host_syncs() -> collections.Counter:
    """Count each synchronizing call by its innermost seven frames, from now on."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename][-7:]
            sites["\n   <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                                  for f in reversed(frames))] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    return sites


def fsdp_on_one_rank(model: torch.nn.Module, param_dtype: torch.dtype) -> None:
    """In `apply_mixed_precision`'s place: FSDP2 on a group of one, no master weights handed back
    (so no fused update either)."""
    fsdp.apply_fsdp_on_one_rank(model, param_dtype)


class _Bf16RouterLogits(torch.autograd.Function):
    """x [..., H] @ weight [E, H].T of bf16 values held as float32, computed in bf16 with float32
    accumulation and output; the backward's GEMMs take the logits' gradient rounded to bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, w = x.reshape(-1, x.shape[-1]).bfloat16(), weight.bfloat16()
        ctx.save_for_backward(rows, w)
        ctx.shapes = x.shape, weight.dtype
        return torch.mm(rows, w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, w = ctx.saved_tensors
        x_shape, weight_dtype = ctx.shapes
        g = grad.reshape(-1, grad.shape[-1]).bfloat16()
        return (torch.mm(g, w, out_dtype=torch.float32).view(x_shape),
                torch.mm(g.t(), rows, out_dtype=torch.float32).to(weight_dtype))


def _functional_with(module, **replaced) -> None:
    """`module`'s `F` (torch.nn.functional) with `replaced` names swapped in, for that module only."""
    import types

    import torch.nn.functional as F

    functional = types.ModuleType(f"functional_for_{module.__name__}")
    functional.__dict__.update(F.__dict__)
    functional.__dict__.update(replaced)
    module.F = functional


def route_on_bf16_gemms() -> None:
    """`model/moe.py`'s `F.linear`, which only its router calls, as `_Bf16RouterLogits` on a GPU."""
    import torch.nn.functional as F

    from onenode.model import moe

    def linear(x, weight, bias=None):
        if bias is not None or not x.is_cuda:
            return F.linear(x, weight, bias)
        return _Bf16RouterLogits.apply(x, weight)

    _functional_with(moe, linear=linear)


def loss_by_liger() -> None:
    """`model/nemotron_h.py`'s fused head and loss as liger-kernel's fused linear cross-entropy."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as e:
        raise SystemExit(f"liger-loss needs liger-kernel ({e}): pip install liger-kernel") from None
    from onenode.model import nemotron_h

    def linear_cross_entropy(hidden, weight, labels):
        return liger_fused_linear_cross_entropy(hidden.flatten(0, -2), weight, labels.flatten(),
                                                ignore_index=loss.IGNORE_INDEX, reduction="mean")

    nemotron_h.linear_cross_entropy = linear_cross_entropy


def reductions_benchmarked() -> None:
    """Inductor's reduction kernels choose among their candidate configs by timing them, the
    deterministic mode's one-config rule off; they compile in this process, which has the change."""
    from torch._inductor.runtime import triton_heuristics

    triton_heuristics.filter_reduction_configs_for_determinism = lambda inductor_meta, configs: configs
    torch._inductor.config.compile_threads = 1  # a compile worker would load the kernels with the rule


def forking_workers(install_rule):
    """`install_rule` (the kit's tiled-reduction rule), then inductor's compile workers forked from this
    process, as many as inductor starts by default, not none."""

    def install_then_fork() -> bool:
        installed = install_rule()
        torch._inductor.config.compile_threads = torch._inductor.config.decide_compile_threads()
        torch._inductor.config.worker_start_method = "fork"
        return installed

    return install_then_fork


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s PROBE [PROBE ...] [--logits N] [--mode M] [--chunk N] "
                                           "-- BENCH_OPTIONS")
    parser.add_argument("probes", nargs="+", metavar="PROBE",
                        choices=["loss-chunk", "tf32", "host-syncs", "cpp-wrapper", "compile-mode",
                                 "router-own-unit", "one-unit", "fsdp-one-rank", "unfused-update",
                                 "update-chunk", "router-bf16-gemm", "ssd-carry-recurrence", "ssd-carry-bf16",
                                 "liger-loss", "reductions-benchmarked", "inductors-reduction-rule",
                                 "fork-workers"])
    parser.add_argument("--logits", type=int, help="loss-chunk: logits per chunk")
    parser.add_argument("--chunk", type=int, help="update-chunk: parameters per compiled update call")
    parser.add_argument("--mode", choices=["reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                        help="compile-mode: torch.compile's mode for every compiled layer")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # after `--`: the bench's own options
    args = parser.parse_args(argv[:split])
    bench_options = [*argv[split + 1:], "--top-kernels", "80"]
    sites = None
    for probe in args.probes:
        if probe == "loss-chunk":
            if args.logits is None:
                parser.error("loss-chunk needs --logits, the logits per chunk")
            loss.CHUNK_LOGITS = args.logits
        elif probe == "tf32":
            torch.set_float32_matmul_precision("high")
        elif probe == "cpp-wrapper":
            torch._inductor.config.cpp_wrapper = True
        elif probe == "compile-mode":
            if args.mode is None:
                parser.error("compile-mode needs --mode")
            if args.mode != "reduce-overhead":
                parser.error(f"compile-mode --mode {args.mode}: only reduce-overhead is a recipe field "
                             "(train.cuda_graphs)")
            bench_options += ["--set", "train.cuda_graphs=true"]
        elif probe == "router-own-unit":
            fsdp.UNITS = dataclasses.replace(fsdp.UNITS, routers_apart=True)
        elif probe == "one-unit":
            fsdp.UNITS = dataclasses.replace(fsdp.UNITS, per_layer=False)
        elif probe == "fsdp-one-rank":
            onenode.parallel.apply_mixed_precision = fsdp_on_one_rank
        elif probe == "unfused-update":
            bench_options.append("--unfused-update")
        elif probe == "update-chunk":
            if args.chunk is None or args.chunk < 1:
                parser.error("update-chunk needs --chunk N, N >= 1: parameters per compiled update call")
            master_update.CHUNK = args.chunk
            bench_options += ["--set", "train.fused_update_kernel=inductor"]  # the Triton kernel takes no chunks
        elif probe == "router-bf16-gemm":
            route_on_bf16_gemms()
        elif probe in ("ssd-carry-recurrence", "ssd-carry-bf16"):
            import ssd_probe  # this folder's: the script's own is on sys.path

            from onenode.model import mamba2

            mamba2.carry_across_chunks = (ssd_probe.carry_by_recurrence if probe == "ssd-carry-recurrence"
                                          else ssd_probe.carry_on_bf16)
        elif probe == "inductors-reduction-rule":
            from onenode.train import assembly

            assembly.tile_deterministic_reductions = lambda: False
        elif probe == "fork-workers":
            from onenode.train import assembly

            assembly.tile_deterministic_reductions = forking_workers(assembly.tile_deterministic_reductions)
        elif not torch.cuda.is_available():
            parser.error(f"{probe} needs a CUDA GPU: none is visible here")
        elif probe == "liger-loss":
            loss_by_liger()
        elif probe == "reductions-benchmarked":
            reductions_benchmarked()
        else:
            sites = count_host_syncs()
    rc = onenode_main(["bench", *bench_options])
    if sites is not None:
        print("\nhost syncs (count, where; compilation's own included):")
        for site, count in sites.most_common(10):
            print(f"{count:6d}  {site}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
