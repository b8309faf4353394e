"""Every block compiles as one graph: `torch.compile(block, fullgraph=True)` (which fails on any graph
break) on the tiny preset, forward and backward, with and without activation checkpointing, and
computes what the eager block computes. AOT autograd traces the backward as inductor would; the
aot_eager backend runs it without generating kernels, so this takes seconds on a CPU.

The starter's MoE block is A1's first slow path (a Python loop over the experts with a host sync
each): it breaks the graph by design, so the MoE block is checked in the reference solution's tree
(in bf16, as it runs on the GPU).
"""

from __future__ import annotations

import pytest
from patched_copy import patched_tree, run_in_tree


def compile_block(kind: str, checkpointed: bool, dtype: str = "float32", fullgraph: bool = True) -> dict:
    """Compile the first block of `kind` (fullgraph: no graph break allowed), run forward and
    backward; the largest difference from eager, relative to the largest value (also called in a
    patched tree)."""
    import torch._dynamo
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from onenode.model import build_model, get_preset

    torch._dynamo.reset()
    config = get_preset("tiny")
    model = build_model(config, seed=0, dtype=getattr(torch, dtype))
    block = model.backbone.layers[config.layer_kinds.index(kind)]
    if checkpointed:
        block = checkpoint_wrapper(block, preserve_rng_state=False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, config.hidden_size, generator=gen).to(getattr(torch, dtype))  # 40: not a multiple of
    grad_out = torch.randn(x.shape, generator=gen).to(x.dtype)  # the 16-step chunk

    def run(fn):
        inp = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        y = fn(inp)
        y.backward(grad_out)
        return [y.detach(), inp.grad, *(p.grad for p in block.parameters())]

    eager = run(block)
    compiled = run(torch.compile(block, fullgraph=fullgraph, backend="aot_eager"))
    return {"error": max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(eager, compiled))}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("kind", ["mamba", "attention", "mlp"])
def test_block_compiles_without_graph_breaks(kind, checkpointed):
    assert compile_block(kind, checkpointed)["error"] < 1e-5


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_reference_moe_block_compiles_without_graph_breaks(checkpointed):
    """In bfloat16, as on the GPU: the compiler's shape check of `torch._grouped_mm` wants bf16."""
    result = run_in_tree(patched_tree(["1-moe"]), "test_compile:compile_block", kind="moe",
                         checkpointed=checkpointed, dtype="bfloat16")
    assert result["error"] < 1e-2


def test_reference_moe_block_compiles_in_float32():
    """In float32 (a CPU run with --compile) the compiler refuses `torch._grouped_mm`, which eager
    CPU takes in float32: the block falls back to the loop over experts, with a graph break."""
    result = run_in_tree(patched_tree(["1-moe"]), "test_compile:compile_block", kind="moe",
                         checkpointed=False, dtype="float32", fullgraph=False)
    assert result["error"] < 1e-5


def compiled_calls() -> dict:
    """Forward calls of compiled graphs in one training step of a Mamba + attention model laid out
    as the stack lays it out (`prepare_layers` compiling blocks, then FSDP2 in bf16 on a one-rank
    group), without and with activation checkpointing."""
    import torch
    import torch._dynamo
    from torch.profiler import profile

    from onenode.model import build_model, get_preset
    from onenode.parallel import ParallelDims, parallelize
    from onenode.parallel.compile_and_checkpoint import prepare_layers

    config = get_preset("tiny", hybrid_override_pattern="M*M")
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    calls = {"layers": config.num_hidden_layers}
    for checkpointed in (False, True):
        torch._dynamo.reset()
        model = build_model(config, seed=0)
        prepare_layers(model, compile="blocks", activation_checkpointing=checkpointed, backend="aot_eager")
        model = parallelize(model, ParallelDims(dp=1), param_dtype=torch.bfloat16).model
        model(ids, labels=ids).loss.backward()  # compiles
        with profile() as prof:
            model(ids, labels=ids).loss.backward()
        calls["checkpointed" if checkpointed else "plain"] = [e.name for e in prof.events()].count("CompiledFunction")
    return calls


def test_sharded_checkpointed_blocks_run_compiled():
    """Each layer's forward runs as one compiled graph, and with checkpointing its recompute in
    backward too: the checkpoint wraps the compiled block (traced the other way round, every block
    ran eagerly), and FSDP2's hooks stay outside the graph."""
    from patched_copy import KIT_ROOT

    calls = run_in_tree(KIT_ROOT, "test_compile:compiled_calls")
    assert calls["plain"] == calls["layers"]
    assert calls["checkpointed"] == 2 * calls["layers"]


def _bf16_step_graph_breaks(lay_out, checkpointed: bool = False) -> dict:
    """Graph breaks and compiled graphs when the tiny model, MoE blocks included, runs a bf16
    forward and backward with every block compiled (and checkpointed), laid out by `lay_out(model)`
    and with the trainer's router balancing hooked on; the loads the balancer counted, and the
    count one forward makes (each token's top-k choices, in every MoE layer)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from onenode.model import build_model, get_preset
    from onenode.parallel.compile_and_checkpoint import prepare_layers
    from onenode.train.balance import RouterBalancer

    torch._dynamo.reset()
    counters.clear()
    config = get_preset("tiny")
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model = build_model(config, seed=0)
    prepare_layers(model, compile="blocks", activation_checkpointing=checkpointed, backend="aot_eager")
    lay_out(model)
    balancer = RouterBalancer(model)
    model(ids, labels=ids).loss.backward()
    balancer.finish_step(rate=1e-3)
    moe_layers = config.layer_kinds.count("moe")
    return {"breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"],
            "moe_layers": moe_layers, "load_counted": float(balancer.last_loads.sum()),
            "load_of_one_forward": ids.numel() * config.num_experts_per_tok * moe_layers}


def sharded_step_graph_breaks(checkpointed: bool = False) -> dict:
    """FSDP2 as every multi-rank layout applies it (float32 masters gathered bf16), on a group of one."""
    import torch

    from onenode.parallel.fsdp import apply_fsdp_on_one_rank

    return _bf16_step_graph_breaks(lambda model: apply_fsdp_on_one_rank(model, torch.bfloat16), checkpointed)


def one_process_step_graph_breaks(checkpointed: bool = False) -> dict:
    """One process as `parallelize` lays it out: bf16 copies over float32 masters, no FSDP."""
    import torch

    from onenode.parallel import ParallelDims, parallelize

    return _bf16_step_graph_breaks(lambda model: parallelize(model, ParallelDims(), param_dtype=torch.bfloat16),
                                   checkpointed)


def test_cuda_graphs_compile_every_block_to_replay(monkeypatch):
    """`prepare_layers(compile_mode="reduce-overhead")` compiles each block with CUDA graphs, those of
    changing shapes left without them (on a GPU only, so the wiring is what a CPU can check), and
    refuses without compile; another mode is passed through as torch.compile's mode."""
    import torch

    from onenode.model import build_model, get_preset
    from onenode.parallel import compile_and_checkpoint as layers

    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, backend, mode=None, options=None:
                        modes.append(mode if options is None else tuple(sorted(options.items()))) or fn)
    model = build_model(get_preset("tiny"), seed=0)
    layers.prepare_layers(model, compile="blocks", compile_mode="reduce-overhead")
    graphs = tuple(sorted({"triton.cudagraphs": True, "triton.cudagraph_skip_dynamic_graphs": True,
                           "graph_partition": False}.items()))
    assert modes == [graphs] * len(model.backbone.layers)
    modes.clear()
    layers.prepare_layers(build_model(get_preset("tiny"), seed=0), compile="blocks")
    assert set(modes) == {None}
    modes.clear()
    layers.prepare_layers(build_model(get_preset("tiny"), seed=0), compile="mixers",
                          compile_mode="max-autotune-no-cudagraphs")
    assert set(modes) == {"max-autotune-no-cudagraphs"} and 0 < len(modes) < len(model.backbone.layers)
    with pytest.raises(ValueError, match="CUDA graphs replay compiled layers"):
        layers.prepare_layers(model, compile_mode="reduce-overhead")
    assert layers.uses_cuda_graphs("max-autotune") and not layers.uses_cuda_graphs("max-autotune-no-cudagraphs")


@pytest.mark.parametrize(("layout", "checkpointed"), [("sharded_step_graph_breaks", False),
                                                     ("one_process_step_graph_breaks", True)],
                         ids=["sharded-plain", "one-process-checkpointed"])
def test_moe_blocks_compile_without_graph_breaks(layout, checkpointed):
    """In the reference solution's tree (the starter's MoE breaks the graph by design), both ways the
    kit lays out a bf16 model, with the trainer's router balancing on. Sharded: a router sharded as
    an FSDP unit of its own would put FSDP's hooks inside the compiled MoE block, two graph breaks
    per MoE block; it is gathered with its layer instead. One process: the bf16 copies are swapped
    in outside the compiled blocks. The balancing hook compiles into the MoE block (its check for a
    recompute, once a graph break in every MoE block, runs inside an op) and still counts each
    forward once, the checkpoint's recompute not again."""
    result = run_in_tree(patched_tree(["1-moe"]), f"test_compile:{layout}", checkpointed=checkpointed)
    assert result["moe_layers"] >= 1
    assert result["breaks"] == {}, result
    assert result["load_counted"] == result["load_of_one_forward"]


def test_deterministic_tiled_reductions_keep_their_largest_tile(monkeypatch):
    """Under deterministic algorithms inductor keeps one config of each reduction's candidates; for a
    tiled reduction (YBLOCK and XBLOCK) the kit's rule keeps the largest tile, not inductor's
    smallest (one row a program), and an untiled reduction keeps inductor's pick. Kernels then
    compile in this process, where the rule is, and the rule changes inductor's cache key. Read from
    inductor's own heuristics for an H100."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.hints import DeviceProperties, ReductionHint

    from onenode.parallel.compile_and_checkpoint import tile_deterministic_reductions

    installed = triton_heuristics.filter_reduction_configs_for_determinism  # by an earlier test, maybe
    monkeypatch.setattr(triton_heuristics, "filter_reduction_configs_for_determinism",
                        getattr(installed, "inductors_rule", installed))
    h100 = DeviceProperties(type="cuda", index=0, multi_processor_count=132, cc=90, major=9,
                            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            max_threads_per_block=1024, warp_size=32)

    def kept(size_hints, deterministic=True):
        configs = triton_heuristics.persistent_reduction(
            size_hints, reduction_hint=ReductionHint.INNER, triton_meta={"device": h100, "signature": {}},
            inductor_meta={"are_deterministic_algorithms_enabled": deterministic}, return_configs=True)
        return [(c.kwargs, c.num_warps) for c in configs]

    graph = torch.fx.symbolic_trace(lambda x: (x.sin() * 2).sum(-1))
    saved = inductor_config.compile_threads, inductor_config.post_grad_custom_post_pass
    try:  # inductor's config is restored by hand: pytest's monkeypatch deletes the option on undo
        inductor_config.post_grad_custom_post_pass = None
        key_before = codecache.compiled_fx_graph_hash(graph, [torch.ones(4, 4)], {}, [])[0]
        tiled, untiled = {"y": 16384, "x": 32, "r0_": 64}, {"x": 1 << 20, "r0_": 64}
        every_tile, inductors_tile, inductors_row = kept(tiled, False), kept(tiled), kept(untiled)
        assert len(every_tile) > 1 and len(inductors_tile) == 1
        assert tile_deterministic_reductions() and inductor_config.compile_threads == 1
        largest = max(every_tile, key=lambda c: (c[0]["XBLOCK"] * c[0]["YBLOCK"], c[1]))
        assert kept(tiled) == [largest] != inductors_tile
        assert kept(untiled) == inductors_row and kept(tiled, False) == every_tile
        assert tile_deterministic_reductions() and kept(tiled) == [largest]  # installed once
        assert codecache.compiled_fx_graph_hash(graph, [torch.ones(4, 4)], {}, [])[0] != key_before
    finally:
        inductor_config.compile_threads, inductor_config.post_grad_custom_post_pass = saved
