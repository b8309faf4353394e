"""The kit's one precision design on one CPU process: float32 master weights, bf16 copies made once
per step (the routers' too, whose math stays float32), with the numbers of FSDP2's mixed precision
on a mesh of one rank but no FSDP (`parallel/mixed_precision.py`); through `train_step`, the trainer
(exact resume) and `onenode bench`."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from onenode import cli
from onenode.model import build_model, get_preset
from onenode.model.moe import TopKRouter
from onenode.parallel import ParallelDims, ParallelModel, parallelize
from onenode.parallel.fsdp import apply_fsdp_on_one_rank
from onenode.parallel.layers import prepare_layers
from onenode.train.recipe import load_recipe
from onenode.train.step import build_optimizer, train_step
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
    """The kit's one-process layout before 2026-12-01: FSDP2's mixed precision over a mesh of one."""
    return ParallelModel(model, dp_mesh=apply_fsdp_on_one_rank(model, torch.bfloat16))


def test_one_process_matches_fsdp_on_one_rank_bit_for_bit():
    """Same losses, gradient norms and float32 masters as FSDP2 on one rank, step after step, with
    gradient accumulation and checkpointed, compiled layers; and the bf16 copies never move."""
    config = get_preset("tiny")
    ids, labels = _batch(config, batch=4)

    def train(parallel: ParallelModel, addresses: list | None = None):
        if addresses is not None:
            layer = parallel.model.backbone.layers[0]
            layer.register_forward_pre_hook(lambda m, args: addresses.append(m.norm.weight.data_ptr()))
        optimizer = build_optimizer(parallel, lr=3e-3)
        steps = [train_step(parallel, optimizer, ids, labels, accumulation_steps=2) for _ in range(3)]
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


def test_bf16_train_step_trains_and_accumulates():
    config = get_preset("tiny")
    ids, labels = _batch(config, batch=4)
    parallel = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=torch.bfloat16)
    optimizer = build_optimizer(parallel, lr=3e-3)
    losses = [train_step(parallel, optimizer, ids, labels, accumulation_steps=2)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1, losses
    routers = [m for m in parallel.model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(m.weight.dtype == torch.float32 for m in routers)


def test_bf16_trainer_resumes_exactly(tmp_path):
    recipe = load_recipe(ROOT / "a2_pretrain" / "recipes" / "tiny.yaml", {
        "train.precision": "bf16", "train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
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
