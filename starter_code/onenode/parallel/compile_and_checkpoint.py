"""What is applied to every layer before the model is sharded: compile, then activation
checkpointing, then (in `parallelize`) expert parallelism and FSDP.

Compile comes first so that the checkpoint wraps an already compiled block. The other way round,
dynamo must trace the checkpoint itself, and the first graph break in that frame (FSDP's hooks,
which it skips, are one) makes it run the whole checkpointed block eagerly: a profiled step of the
tiny model held no compiled region at all.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each layer's activations in backward instead of storing them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.backbone.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_compile(model: nn.Module, mode: str, backend: str = "inductor", compile_mode: str | None = None) -> None:
    """`torch.compile` per layer, as torchtitan does (one small graph per block, reused).

    "mixers" compiles every Mamba2, attention and dense MLP mixer and leaves MoE mixers eager:
    the routed experts have data-dependent shapes (tokens per expert), and a loop over experts
    would unroll into one graph break per expert. "blocks" compiles every block, MoE included:
    for an MoE whose routed path is compile-friendly. `compile_mode` is torch.compile's `mode`
    for each compiled region (None: its default; see `prepare_layers`).
    """
    for layer in model.backbone.layers:
        if mode == "blocks":
            _compile_forward(layer, backend, compile_mode)
        elif layer.kind != "moe":
            _compile_forward(layer.mixer, backend, compile_mode)


def tile_deterministic_reductions() -> bool:
    """Under torch's deterministic algorithms inductor gives each reduction kernel one config, kept
    by a fixed rule instead of by timing its candidates (another config may sum a row in another
    order). For a tiled reduction (a YBLOCK beside XBLOCK: a sum over inputs laid out two ways)
    that rule keeps the smallest tile, one row a program on two warps, and reads the transposed
    input one element at a time: two of the torch scan's sums over head_dim ran five times slower
    in the A2 baseline's deterministic step than timed (one H100). This rule keeps the largest tile
    of those candidates instead, the most warps on a tie; other kernels keep inductor's rule. Still
    a fixed rule: the same config, so the same bits, on every run. Inductor's compile workers never
    import the kit, so its kernels compile in this process; and the rule is part of inductor's
    cache key, so kernels cached under inductor's own rule are not taken for it. False where this
    torch has no such rule to replace (an older torch)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime import triton_heuristics

    inductors_rule = getattr(triton_heuristics, "filter_reduction_configs_for_determinism", None)
    if inductors_rule is None:
        return False
    if hasattr(inductors_rule, "inductors_rule"):  # installed already
        return True

    def keep_one_config(inductor_meta, configs):
        kept = inductors_rule(inductor_meta, configs)
        if len(kept) == 1 and len(configs) > 1 and all("YBLOCK" in c.kwargs for c in configs):
            return [max(configs, key=lambda c: (math.prod(v for k, v in c.kwargs.items() if k.endswith("BLOCK")),
                                                c.num_warps))]
        return kept

    keep_one_config.inductors_rule = inductors_rule
    triton_heuristics.filter_reduction_configs_for_determinism = keep_one_config
    inductor_config.compile_threads = 1
    if inductor_config.post_grad_custom_post_pass is None:
        inductor_config.post_grad_custom_post_pass = LargestTileCacheKey()
    return True


class LargestTileCacheKey(CustomGraphPass):
    """A pass that changes no graph: its uuid puts `tile_deterministic_reductions`'s rule into
    inductor's cache key (which has the passes' uuids), so a graph compiled under another rule is
    compiled again rather than read from the cache."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return "onenode: deterministic tiled reductions keep their largest tile"


# CUDA graphs as torch.compile's "reduce-overhead" mode makes them, except that a graph whose
# shapes change from call to call (dynamic shapes: a per-expert loop's token counts) runs without
# one instead of being recorded again for every size it meets, which took minutes per step. Not
# partitioned: with inductor's graph partitions (the default since torch 2.9) that option cuts a
# graph around every op with a symbolic size instead, and the MoE block's gate partition then
# re-recorded on every call ("static input data pointer changed" for its float32 input: 2,573
# tokens/s against 47,759 without graphs on one H200; benchmarks/results/2026-12-03-h200-cuda-graph-regression/).
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True, "triton.cudagraph_skip_dynamic_graphs": True,
                      "graph_partition": False}


def _compile_forward(module: nn.Module, backend: str, compile_mode: str | None) -> None:
    """Compile `forward` alone, not the whole call (`module.compile()`): the hooks FSDP2 puts on
    the module later stay outside the graph, where dynamo would break it in two. The parameters
    keep their names (no `_orig_mod.` wrapper)."""
    if compile_mode == "reduce-overhead" and backend == "inductor":
        module.forward = torch.compile(module.forward, backend=backend, options=CUDA_GRAPH_OPTIONS)
    else:
        module.forward = torch.compile(module.forward, backend=backend, mode=compile_mode)


def cuda_graph_skips() -> int:
    """Compiled regions so far that ran without their CUDA graph (dynamic shapes, CPU tensors, ...):
    what a run with CUDA graphs reports, so a tree that cannot use them says so."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def uses_cuda_graphs(compile_mode: str | None) -> bool:
    """Whether torch.compile's `compile_mode` replays its graphs as CUDA graphs."""
    return compile_mode in ("reduce-overhead", "max-autotune")


def prepare_layers(model: nn.Module, *, compile: str = "off", activation_checkpointing: bool = False,
                   backend: str = "inductor", compile_mode: str | None = None) -> None:
    """Compile the layers (`compile`: off, mixers or blocks), then checkpoint them, in that order.

    `compile_mode` is torch.compile's mode for each compiled layer. "reduce-overhead" replays each
    as a CUDA graph: one launch instead of hundreds, for steps the host cannot feed fast enough.
    CUDA graphs need parameters at fixed addresses, so one process (`parallel/mixed_precision.py`);
    under FSDP, which gathers them into new memory each step, the graphs are recorded again every
    step. With CUDA graphs (`uses_cuda_graphs`) each training step must begin with
    `torch.compiler.cudagraph_mark_step_begin()`."""
    if compile_mode is not None and compile == "off":
        what = "CUDA graphs replay" if uses_cuda_graphs(compile_mode) else f"compile mode {compile_mode} applies to"
        raise ValueError(f"{what} compiled layers: set compile to mixers or blocks")
    if compile != "off":
        apply_compile(model, compile, backend, compile_mode)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
