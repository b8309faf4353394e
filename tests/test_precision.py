"""The kit's one precision design on one CPU process: float32 master weights, bf16 copies made once
per step (the routers' too, whose math stays float32), with the numbers of FSDP2's mixed precision
on a mesh of one rank but no FSDP (`parallel/mixed_precision.py`); through `train_step`, the trainer
(exact resume) and `onenode bench`."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from onenode import cli
from onenode.model import build_model, get_preset
from onenode.model.moe import TopKRouter
from onenode.parallel import ParallelDims, ParallelModel, fsdp, parallelize
from onenode.parallel.compile_and_checkpoint import prepare_layers
from onenode.parallel.fsdp import apply_fsdp_on_one_rank
from onenode.train.recipe import load_recipe
from onenode.train.step import build_optimizer, clip_grad_norm_, train_step
from onenode.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_rank_group():
    """One thread; leave no process group behind for other tests (the FSDP comparison makes one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if dist.is_initialized():
        dist.destroy_process_group()


def _batch(config, batch=2, seq=32, seed=0):
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].clone(), ids[:, 1:].clone()


def test_bf16_casts_once_per_step_over_float32_masters():
    config = get_preset("tiny")
    ids, labels = _batch(config)
    reference = build_model(config, seed=0)
    reference_loss = reference(ids, labels=labels).loss.item()
    parallel = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=torch.bfloat16)
    assert not dist.is_initialized() and parallel.dp_mesh is None  # one process: no FSDP, no group

    seen = {}

    def record(module, args):
        kind = "router" if isinstance(module, TopKRouter) else "linear"
        seen.setdefault(kind, set()).update(p.dtype for p in module.parameters(recurse=False))

    def record_routing(module, args, output):
        seen.setdefault("routing", set()).add(output[1].dtype)

    hooks = [m.register_forward_pre_hook(record) for m in parallel.model.modules()
             if isinstance(m, (TopKRouter, torch.nn.Linear))]
    hooks += [m.register_forward_hook(record_routing) for m in parallel.model.modules() if isinstance(m, TopKRouter)]
    out = parallel.model(ids, labels=labels)
    for hook in hooks:
        hook.remove()
    # cast once, the routers with their layers; the routing weights computed in float32
    assert seen == {"router": {torch.bfloat16}, "linear": {torch.bfloat16}, "routing": {torch.float32}}
    assert abs(out.loss.item() - reference_loss) < 0.02
    # outside a forward the parameters are the masters (an optimizer built now updates them)
    assert {p.dtype for p in parallel.parameters()} == {torch.float32}
    out.loss.backward()
    for name, param in parallel.named_parameters():  # masters and their gradients stay float32
        assert param.dtype == torch.float32, name
        assert param.grad is not None and param.grad.dtype == torch.float32, name


def _fsdp_on_one_rank(model: torch.nn.Module) -> ParallelModel:
    """FSDP2's mixed precision over a mesh of one: the layout several ranks get, in one process."""
    return ParallelModel(model, dp_mesh=apply_fsdp_on_one_rank(model, torch.bfloat16))


def test_one_process_matches_fsdp_on_one_rank_bit_for_bit():
    """Same losses, gradient norms and float32 masters as FSDP2 on one rank, step after step, with
    gradient accumulation and checkpointed, compiled layers; and the bf16 copies never move. Both
    take torch's AdamW (`fused_update=False`): the fused update rounds its own way, held to this step
    in `test_fused_update_takes_the_unfused_step`."""
    config = get_preset("tiny")
    ids, labels = _batch(config, batch=4)

    def train(parallel: ParallelModel, addresses: list | None = None):
        if addresses is not None:
            layer = parallel.model.backbone.layers[0]
            layer.register_forward_pre_hook(lambda m, args: addresses.append(m.norm.weight.data_ptr()))
        optimizer = build_optimizer(parallel, lr=3e-3)
        steps = [train_step(parallel, optimizer, ids, labels, accumulation_steps=2, fused_update=False)
                 for _ in range(3)]
        return steps, parallel.model.state_dict()

    def prepared():
        model = build_model(config, seed=0)
        prepare_layers(model, compile="blocks", activation_checkpointing=True, backend="eager")
        return model

    addresses = []
    steps, state = train(parallelize(prepared(), ParallelDims(), param_dtype=torch.bfloat16), addresses)
    fsdp_steps, fsdp_state = train(_fsdp_on_one_rank(prepared()))
    assert steps == fsdp_steps
    assert state.keys() == fsdp_state.keys()
    for name, value in state.items():
        fsdp_value = fsdp_state[name]
        fsdp_value = fsdp_value.full_tensor() if isinstance(fsdp_value, DTensor) else fsdp_value  # buffers are not
        assert value.dtype == fsdp_value.dtype and torch.equal(value, fsdp_value), name
    assert len(addresses) == 6 and len(set(addresses)) == 1, addresses


def test_fsdp_units_group_the_parameters_as_asked(monkeypatch):
    """`fsdp.UNITS`: a unit per layer and the root (routers with their layer), the whole model one
    unit, or every router a unit of its own."""
    from torch.distributed.fsdp import FSDPModule

    config = get_preset("tiny")

    def units(grouping: fsdp.Units) -> set[str]:
        monkeypatch.setattr(fsdp, "UNITS", grouping)
        model = build_model(config, seed=0)
        apply_fsdp_on_one_rank(model, torch.bfloat16)
        return {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}

    layers = {f"backbone.layers.{i}" for i in range(config.num_hidden_layers)}
    routers = {name for name, m in build_model(config, device="meta").named_modules() if isinstance(m, TopKRouter)}
    assert routers and units(fsdp.Units()) == {""} | layers
    assert units(fsdp.Units(per_layer=False)) == {""}
    assert units(fsdp.Units(routers_apart=True)) == {""} | layers | routers


def test_bf16_train_step_trains_and_accumulates():
    config = get_preset("tiny")
    ids, labels = _batch(config, batch=4)
    parallel = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=torch.bfloat16)
    optimizer = build_optimizer(parallel, lr=3e-3)
    losses = [train_step(parallel, optimizer, ids, labels, accumulation_steps=2)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1, losses
    routers = [m for m in parallel.model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(m.weight.dtype == torch.float32 for m in routers)


@pytest.mark.parametrize("micro_batch", [2, 4], ids=["accumulated", "fused-update"])
def test_bf16_trainer_resumes_exactly(tmp_path, micro_batch):
    """With two micro-batches a step is the unfused one; with one, `train/master_update.py`'s."""
    recipe = load_recipe(ROOT / "a2_pretrain" / "recipes" / "tiny.yaml", {
        "train.precision": "bf16", "train.seq_len": 32, "train.global_batch_size": 4,
        "train.micro_batch_size": micro_batch,
        "train.token_budget": 512, "checkpoint.every_steps": 0, "eval.every_steps": 0, "eval.batches": 1,
        "log.every_steps": 1, "log.progress_bar": False})
    straight = Trainer(recipe, tmp_path / "a", resume=None)
    manifest = straight.fit()
    assert manifest["status"] == "finished" and manifest["final_losses"]["val"] is not None
    assert Trainer(recipe, tmp_path / "b", resume=None).fit(stop_after_steps=2)["status"] == "stopped"
    resumed = Trainer(recipe, tmp_path / "b", resume="auto")
    assert resumed.step == 2
    resumed.fit()
    assert resumed.losses == straight.losses  # bitwise on CPU
    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    for a, b in zip(straight.parallel.model.state_dict().values(), resumed.parallel.model.state_dict().values()):
        assert a.dtype == torch.float32 or not a.is_floating_point()
        assert torch.equal(whole(a), whole(b))
    exported = json.loads((tmp_path / "a" / "final" / "config.json").read_text())
    assert exported["hidden_size"] == recipe.model_config().hidden_size


def test_bench_bf16_on_cpu(tmp_path):
    out = tmp_path / "record.json"
    argv = ["bench", "--preset", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--quiet"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    fp32 = json.loads(out.read_text())
    assert cli.main([*argv, "--dtype", "bf16", "--out", str(out)]) == 0
    bf16 = json.loads(out.read_text())
    assert bf16["layout"]["dtype"] == "bf16" and fp32["layout"]["dtype"] == "fp32"
    assert bf16["steps"]["losses"] == pytest.approx(fp32["steps"]["losses"], abs=0.05)


def _train_bf16_steps(config, fused: bool, steps: int = 4, accumulation_steps: int = 1):
    """`steps` bf16 steps of the tiny model on one process, clipped hard; the fused update's calls."""
    from onenode.train import master_update

    ids, labels = _batch(config, batch=2)
    parallel = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=torch.bfloat16)
    optimizer = build_optimizer(parallel, lr=3e-3)
    calls = []
    original = master_update.clip_and_update
    master_update.clip_and_update = lambda *args, **options: calls.append(1) or original(*args, **options)
    try:
        records = [train_step(parallel, optimizer, ids, labels, grad_clip=0.5, accumulation_steps=accumulation_steps,
                              fused_update=fused) for _ in range(steps)]
    finally:
        master_update.clip_and_update = original
    return parallel, optimizer, records, len(calls)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_fused_update_takes_the_unfused_step(accumulation_steps):
    """bf16 on one process: the clip, AdamW and the copies' refresh fused (`train/master_update.py`)
    over the bf16 gradients of one micro-batch, or over the float32 gradients two micro-batches add
    up on the masters, take the step that the clip, torch's AdamW and the cast at the next forward
    take, to float32 rounding. The first step is fused too: it makes the optimizer's state as
    torch's AdamW would. Both runs take it from the same weights and gradients; the copies then hold
    the updated masters, and the state is torch's."""
    config = get_preset("tiny")
    fused, fused_opt, fused_steps, fused_calls = _train_bf16_steps(config, fused=True, steps=1,
                                                                        accumulation_steps=accumulation_steps)
    plain, plain_opt, plain_steps, plain_calls = _train_bf16_steps(config, fused=False, steps=1,
                                                                        accumulation_steps=accumulation_steps)
    assert (fused_calls, plain_calls) == (1, 0)
    assert all(step["grad_norm"] > 0.5 for step in plain_steps)  # the clip scales every step
    assert [s["loss"] for s in fused_steps] == [s["loss"] for s in plain_steps]
    assert fused_steps[0]["grad_norm"] == pytest.approx(plain_steps[0]["grad_norm"], rel=1e-6)
    initial = build_model(config, seed=0)
    for (name, master), reference in zip(fused.named_parameters(), plain.parameters()):
        step = (reference - initial.get_parameter(name)).abs().max()
        assert step > 0, name  # the step moved every parameter
        assert (master - reference).abs().max() <= 1e-4 * step, name  # rounding, not another step
        copy = fused.master_weights.copy_of.get(id(master))
        if copy is not None:
            assert torch.equal(copy, master.to(copy.dtype)), name
    # so the next forward takes them as they are, without casting the masters again
    assert all(unit.copied_versions == [m._version for m in unit.masters] for unit in fused.master_weights.units)
    fused_state, plain_state = fused_opt.state_dict()["state"], plain_opt.state_dict()["state"]
    assert fused_state.keys() == plain_state.keys()
    for key, entry in fused_state.items():
        assert entry.keys() == plain_state[key].keys()
        assert float(entry["step"]) == float(plain_state[key]["step"]) == 1
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(entry[moment], plain_state[key][moment], rtol=1e-5, atol=1e-12), (key, moment)
    # and it trains on: the next steps are fused too, the loss goes down
    records = [train_step(fused, fused_opt, *_batch(config, batch=2), grad_clip=0.5,
                          accumulation_steps=accumulation_steps)["loss"] for _ in range(3)]
    assert records[-1] < fused_steps[-1]["loss"]


def test_fused_update_compiles_as_one_graph():
    """The update as a GPU runs it, compiled (here with no code generation: aot_eager, fullgraph),
    computes what it computes uncompiled."""
    from onenode.train import master_update

    def inputs():  # the same every call
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(8, 4, generator=gen), torch.randn(5, generator=gen)]
        grads = [torch.randn(8, 4, generator=gen).bfloat16(), torch.randn(5, generator=gen)]
        moments = [[torch.rand(p.shape, generator=gen) for p in params] for _ in range(2)]
        return (params, grads, *moments, [torch.tensor(3.0), torch.tensor(3.0)],
                [torch.empty(8, 4, dtype=torch.bfloat16), None])

    eager, compiled = inputs(), inputs()
    scalars = (torch.tensor(1e-2), torch.tensor(0.5), 0.9, 0.95, 1e-8, 0.1)
    master_update._adamw(*eager, *scalars)
    torch.compile(master_update._adamw, backend="aot_eager", fullgraph=True)(*compiled, *scalars)
    for a, b in zip(eager, compiled):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.allclose(x, y, rtol=1e-6), (x, y)
    assert torch.equal(eager[5][0], eager[0][0].bfloat16()) and float(eager[4][0]) == 4.0


def _fused_update_graphs(count: int, update_of, shapes_of=lambda i: (4, 8)) -> tuple[list[int], list[torch.Tensor]]:
    """Two fused steps over `count` matrices of `shapes_of(i)` (as a model with one parameter per
    expert matrix has) plus a few of other shapes, in two groups, the update compiled by
    `update_of(record)` with `record(graph)` called for each graph made; the node count of each
    graph, and the masters."""
    from torch._dynamo.backends.registry import lookup_backend

    from onenode.parallel.mixed_precision import MasterWeights
    from onenode.train import master_update

    gen = torch.Generator().manual_seed(0)
    shapes = [shapes_of(i) for i in range(count)] + [(8,), (16, 8), (3,)]
    masters = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    weights = MasterWeights()
    for master in masters[:-1]:  # the last has no copy: its gradient is on the master
        weights.copy_of[id(master)] = torch.nn.Parameter(master.detach().bfloat16())
    optimizer = torch.optim.AdamW([{"params": masters[::2]}, {"params": masters[1::2], "weight_decay": 0.0}],
                                  lr=1e-2, foreach=False)
    for master in masters:  # the first step is torch's: it makes the state
        master.grad = torch.randn(master.shape, generator=gen)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sizes = []

    def record(graph, example_inputs):
        sizes.append(len(graph.graph.nodes))
        return lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    update = master_update.ChunkedUpdate(update_of(record))
    for _ in range(2):
        for master in masters:
            holder = weights.copy_of.get(id(master), master)
            holder.grad = torch.randn(master.shape, generator=gen).bfloat16().to(holder.dtype)
        master_update.clip_and_update(weights, optimizer, 1.0, update=update)
    torch._dynamo.reset()
    return sizes, [m.detach().clone() for m in masters]


@pytest.mark.slow  # about 15 s: tracing 630 parameters' chunks twice
def test_fused_update_graphs_do_not_grow_with_the_parameter_count(monkeypatch):
    """The compiled update traced (aot_eager) for 30 parameters of one shape and for 600 of two
    transposed shapes (one size): each graph holds at most one chunk, the same few graphs serve both
    (about two per size and group: full chunks and the last), none is made on the second step, and
    the update is the eager one. One graph over every parameter took minutes to compile on a GPU for
    a model with a parameter per expert matrix (the starter's bench hung). Chunks of 4 here, to keep
    the tracing cheap; the rule is the same for any size."""
    from onenode.train import master_update

    monkeypatch.setattr(master_update, "CHUNK", 4)

    def compiled(record):
        return master_update.compiled_update(record, fullgraph=True)

    def transposed(i: int) -> tuple[int, int]:
        return (4, 8) if i % 2 else (8, 4)

    small, _ = _fused_update_graphs(30, compiled)
    large, large_masters = _fused_update_graphs(600, compiled, shapes_of=transposed)
    assert max(large) <= max(small) <= 40 * master_update.CHUNK, (small, large)
    assert len(large) <= len(small) + 2 <= 8, (small, large)  # groups' last chunks differ
    _, eager_masters = _fused_update_graphs(600, lambda record: master_update._adamw, shapes_of=transposed)
    for compiled_master, eager_master in zip(large_masters, eager_masters):
        assert torch.allclose(compiled_master, eager_master, rtol=1e-6, atol=1e-7)


def test_the_fused_update_compiles_beside_the_graphs_earlier_runs_left():
    """Graphs that earlier runs of the process left in `_adamw`'s cache (here eight, of chunks of 1 to 9
    flat parameters) do not send a new model's chunks to eager: the limit counts them. Eager would
    update with other roundings than the compiled step (an offloaded step beside a device step in
    one process differed so on a GPU)."""
    from torch._dynamo.backends.registry import lookup_backend

    from onenode.parallel.mixed_precision import MasterWeights
    from onenode.train import master_update

    made = []

    def record(graph, example_inputs):
        made.append(graph)
        return lookup_backend("eager")(graph, example_inputs)

    torch._dynamo.reset()
    update = master_update.compiled_update(record)
    scalars = (torch.tensor(1e-2), torch.tensor(1.0), 0.9, 0.95, 1e-8, 0.1)
    for n in range(1, 9):
        update(*([torch.zeros(5) for _ in range(n)] for _ in range(4)), [torch.tensor(0.0)] * n, [None] * n, *scalars)
    earlier = len(made)
    assert earlier == 8  # dynamo's default limit, full
    masters = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(12)]
    weights = MasterWeights()
    for master in masters:
        weights.copy_of[id(master)] = torch.nn.Parameter(master.detach().bfloat16())
        weights.copy_of[id(master)].grad = torch.randn(6, 4).bfloat16()
    optimizer = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
    try:
        master_update.clip_and_update(weights, optimizer, 1.0, update=master_update.ChunkedUpdate(update))
        assert len(made) > earlier  # the new chunk compiled, not run eagerly past dynamo's limit
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the compiled update runs on a GPU"))])
def test_fused_update_is_torch_adamw_on_the_same_gradients(device):
    """Given the same bf16 gradients, the fused update (compiled on a GPU) and the unfused one (the
    gradients cast to float32, clipped, torch's AdamW: fused on a GPU) agree to float32 rounding, on
    two steps after the first (which makes the state). No forward runs: nothing else differs."""
    from onenode.train import master_update

    config = get_preset("tiny")

    def train(fused: bool):
        parallel = parallelize(build_model(config, seed=0, device=device), ParallelDims(), param_dtype=torch.bfloat16)
        weights = parallel.master_weights
        optimizer = build_optimizer(parallel, lr=3e-3)
        gen = torch.Generator(device=device).manual_seed(0)
        for step in range(3):
            for master in parallel.parameters():
                grad = torch.randn(master.shape, generator=gen, device=device).mul_(0.1).bfloat16()
                if fused and step > 0:
                    weights.copy_of[id(master)].grad = grad
                else:
                    master.grad = grad.float()
            if fused and step > 0:
                master_update.clip_and_update(weights, optimizer, 0.5)
            else:
                clip_grad_norm_(parallel.parameters(), 0.5)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return parallel

    fused, plain = train(fused=True), train(fused=False)
    initial = build_model(config, seed=0, device=device)
    for (name, master), reference in zip(fused.named_parameters(), plain.parameters()):
        moved = (reference - initial.get_parameter(name)).abs().max()
        assert (master - reference).abs().max() <= 1e-4 * moved, name


@pytest.mark.parametrize("fused_update", [False, True])
def test_the_copies_follow_an_optimizer_step_that_counts_no_version(fused_update):
    """torch's fused AdamW kernel (the kit's optimizer on CUDA; on a CPU with `fused=True`) updates
    the masters without bumping their version counters. The bf16 copies must follow every such step
    all the same, or the model computes with its first weights forever while the masters move (the
    loss stays flat, and a checkpoint holds weights the run never computed with). Two micro-batches
    take the unfused step through `optimizer.step`; one micro-batch alternates with them."""
    config = get_preset("tiny")
    ids, labels = _batch(config, batch=4)
    parallel = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=3e-3, fused=True)
    weights = parallel.master_weights
    losses = []
    for step in range(4):
        accumulation = 2 if step % 2 == 0 or not fused_update else 1
        losses.append(train_step(parallel, optimizer, ids, labels, accumulation_steps=accumulation)["loss"])
        parallel.model(ids)  # a forward: the copies are refreshed if the masters moved
        for master in parallel.parameters():
            copy = weights.copy_of.get(id(master))
            if copy is not None:
                assert torch.equal(copy, master.detach().to(copy.dtype)), step
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.slow
@pytest.mark.skipif(not any(map(shutil.which, ("cc", "gcc", "clang"))),
                    reason="inductor compiles for the CPU with a C++ compiler: none is installed")
def test_the_compiled_fused_update_writes_the_copies(monkeypatch):
    """The fused update as a GPU runs it, compiled (here by inductor for the CPU: the input
    mutations are AOTAutograd's either way): after each step every bf16 copy holds its master, the
    version check then skips the refresh, and the loss goes down. A compiled pass that updated the
    masters but not the copies would leave the model computing with its first weights. Each layer
    kind once: every kind of parameter the tiny model has (its 12 shapes, dtypes and copies or
    none), flattened through the few graphs of chunks of 4; each graph's compile is what this test
    costs (with chunks of 16: 58 s against 28 s, a cold inductor cache)."""
    from onenode.train import master_update

    monkeypatch.setattr(master_update, "CHUNK", 4)  # smaller graphs: half the compile; every kind still in one
    config = get_preset("tiny", hybrid_override_pattern="M*E-")
    ids, labels = _batch(config, batch=4)
    parallel = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=torch.bfloat16)
    optimizer = build_optimizer(parallel, lr=3e-3)
    weights = parallel.master_weights
    fused = master_update.clip_and_update
    compiled = master_update.ChunkedUpdate(master_update.compiled_update())
    monkeypatch.setattr(master_update, "clip_and_update", lambda w, o, m, **_: fused(w, o, m, update=compiled))
    losses = []
    for _ in range(3):
        losses.append(train_step(parallel, optimizer, ids, labels)["loss"])
        for master in parallel.parameters():
            copy = weights.copy_of.get(id(master))
            if copy is not None:
                assert torch.equal(copy, master.detach().to(copy.dtype))
    assert losses[-1] < losses[0] - 0.2, losses
