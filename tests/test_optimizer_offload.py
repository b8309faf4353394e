"""`optimizer.state: cpu` (issue 43: optimizer state in CPU memory) and the `group6-7b` preset it is for.

The float32 masters and AdamW's moments live in host memory; each step streams them through the
device a chunk at a time (`train/offload.py`). On a CPU the "device" is the CPU, so the same code
runs here: it must take the non-offloaded fused step's numbers bit for bit, save and resume the same
optimizer state, and verify under A2's replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onenode.model import count_parameters, get_preset
from onenode.train import offload
from onenode.train.offload import AdamWOffloaded
from onenode.train.recipe import RecipeError, load_recipe
from onenode.train.trainer import Trainer


def test_group6_preset_is_about_7b_total_and_1b_active():
    """Group 6's shape (issue 43), counted by the kit on the meta-device model: 7B total (within
    10%), 1B active per token (within 20%), 38 layers in the NemotronH hybrid layout, 64 experts top-4."""
    config = get_preset("group6-7b")
    total, active = count_parameters(config)
    assert abs(total - 7e9) <= 0.7e9, total
    assert abs(active - 1e9) <= 0.2e9, active
    assert config.num_hidden_layers == 38 and set(config.layer_kinds) == {"mamba", "moe", "attention"}
    assert (config.n_routed_experts, config.num_experts_per_tok) == (64, 4)


ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"
# one process in bf16, one micro-batch a step: the fused step that `optimizer.state: cpu` streams
SETTINGS = {"train.precision": "bf16", "train.seq_len": 32, "train.global_batch_size": 4,
            "train.micro_batch_size": 0, "train.token_budget": 4 * 4 * 32, "eval.every_steps": 0,
            "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False, "optimizer.lr": 3e-3,
            "checkpoint.export_hf": False}


def _run(tmp_path: Path, name: str, stop_after_steps: int | None = None, resume: str | None = None,
         **overrides) -> Trainer:
    trainer = Trainer(load_recipe(TINY, {**SETTINGS, **overrides}), tmp_path / name, resume=resume)
    trainer.fit(stop_after_steps=stop_after_steps)
    return trainer


def _optimizer_state(trainer: Trainer) -> list[torch.Tensor]:
    return [tensor for state in trainer.optimizer.state.values() for tensor in state.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("moments", ["float32", "bfloat16", "int8"])
def test_the_offloaded_step_is_the_fused_step_bit_for_bit(tmp_path, monkeypatch, moments):
    """Four steps of the tiny model with the state offloaded, each chunk cut to a few KiB so that
    every parameter is its own upload: the same losses, masters and optimizer state, bit for bit,
    as the fused step on the device (here both the CPU), in float32, bfloat16 and int8 moments (the
    codes and their block scales streamed alike)."""
    uploads = []
    upload = offload._upload
    monkeypatch.setattr(offload, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(offload, "_upload", lambda chunk, *a, **k: uploads.append(len(chunk)) or upload(chunk, *a, **k))
    device = _run(tmp_path, "device", **{"optimizer.moments": moments})
    assert not uploads
    host = _run(tmp_path, "cpu", **{"optimizer.moments": moments, "optimizer.state": "cpu"})
    assert isinstance(host.optimizer, AdamWOffloaded) and not isinstance(device.optimizer, AdamWOffloaded)
    params = len(list(host.parallel.parameters()))
    assert len(uploads) > 4 * params // 2 and sum(uploads) >= 4 * params  # every step, in many pieces
    assert len(host.losses) == 4 and host.losses == device.losses
    assert _same(list(host.parallel.model.state_dict().values()), list(device.parallel.model.state_dict().values()))
    assert _same(_optimizer_state(host), _optimizer_state(device))
    stored = {t.dtype for s in host.optimizer.state.values() for k, t in s.items() if k != "step"}
    assert stored == ({torch.uint8, torch.float32} if moments == "int8" else {getattr(torch, moments)})


def test_an_offloaded_run_resumes_bit_for_bit(tmp_path):
    """Stopped after 2 of 4 steps and resumed from its checkpoint (DCP: the masters and the state
    saved from and loaded into host memory): the uninterrupted run's losses, weights and state."""
    straight = _run(tmp_path, "straight", **{"optimizer.state": "cpu"})
    _run(tmp_path, "resumed", stop_after_steps=2, **{"optimizer.state": "cpu"})
    resumed = _run(tmp_path, "resumed", resume="auto", **{"optimizer.state": "cpu"})
    assert resumed.losses == straight.losses and len(resumed.losses) == 4
    assert _same(list(resumed.parallel.model.state_dict().values()),
                 list(straight.parallel.model.state_dict().values()))
    assert _same(_optimizer_state(resumed), _optimizer_state(straight))


@pytest.mark.parametrize(("override", "says"), [
    ({"optimizer.name": "muon"}, "is AdamW's: set optimizer.name adamw"),
    ({"train.precision": "fp32"}, "set train.precision bf16"),
    ({"train.fused_update": False}, "set train.fused_update true"),
    ({"parallel.dp": 2}, "launch one process"),
    ({"parallel.ep": 2}, "launch one process"),
])
def test_the_recipe_refuses_what_offloaded_state_cannot_run_in_one_line(override, says):
    with pytest.raises(RecipeError, match=r"optimizer.state: cpu ") as refused:
        load_recipe(TINY, {**SETTINGS, "optimizer.state": "cpu", **override})
    assert says in str(refused.value) and "\n" not in str(refused.value)
    load_recipe(TINY, {**SETTINGS, **override})  # the same recipe with the state on the device runs


def test_an_offloaded_step_takes_one_micro_batch():
    """Accumulated gradients add up in float32 on the masters, in host memory: refused where the
    layout is known, in one line."""
    from onenode.train.assembly import assemble

    with pytest.raises(RecipeError, match=r"optimizer.state: cpu takes one micro-batch a step \(2 would .*"
                                          r"set train.micro_batch_size 0$"):
        assemble(load_recipe(TINY, {**SETTINGS, "optimizer.state": "cpu", "train.micro_batch_size": 2}))


def test_the_option_is_out_of_the_training_hash_at_its_default():
    with pytest.raises(RecipeError, match=r"optimizer.state: is device or cpu"):
        load_recipe(TINY, {**SETTINGS, "optimizer.state": "host"})
    default, explicit = load_recipe(TINY, SETTINGS), load_recipe(TINY, {**SETTINGS, "optimizer.state": "device"})
    offloaded = load_recipe(TINY, {**SETTINGS, "optimizer.state": "cpu"})
    assert default.training_sha256 == explicit.training_sha256 != offloaded.training_sha256


def test_bench_records_the_offloaded_step_and_peak_host_memory(tmp_path):
    """`onenode bench ... --set optimizer.state=cpu`, the GPU record's command, on the tiny model:
    the record names the option and carries the process's peak resident host memory (on a CPU the
    same figure as its peak memory), which the GPU record compares with and without offload."""
    from onenode import cli

    out = tmp_path / "record.json"
    assert cli.main(["bench", "--preset", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--quiet",
                     "--dtype", "bf16", "--set", "optimizer.state=cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["recipe"]["optimizer"]["state"] == "cpu" and record["layout"]["dtype"] == "bf16"
    results = record["results"]
    assert results["peak_cpu_memory_gib"] > 0.1
    assert results["peak_cpu_memory_gib"] == pytest.approx(results["peak_memory_gib"], rel=0.05)


def test_host_memory_carves_disjoint_aligned_tensors_out_of_whole_blocks(monkeypatch):
    """Pinned host memory comes in `BLOCK_BYTES` blocks (torch rounds each pinned allocation up to a
    power of two: up to twice group6-7b's 84 GB of state); each tensor a slice that overlaps no
    other, aligned, holding its values; one larger than a block gets its own allocation. (Here the
    blocks are plain memory: pinning needs a GPU.)"""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(offload, "BLOCK_BYTES", 4096)
    host = offload.HostMemory(pinned=True)
    sources = [torch.randn(10, 10), torch.randn(7).bfloat16(), torch.tensor(3.0), torch.randn(30, 30),
               torch.randn(2000), torch.randn(5, 5).bfloat16()]
    copies = [host.copy_of(t) for t in sources]
    assert all(c.dtype == t.dtype and torch.equal(c, t) for c, t in zip(copies, sources))
    assert len(host.blocks) == 2 and all(used <= 4096 for _, used in host.blocks)
    carved = [c for c, t in zip(copies, sources) if t.numel() * t.element_size() <= 4096]
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in carved)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # disjoint
    assert all((c.data_ptr() - c.untyped_storage().data_ptr()) % offload.ALIGN == 0 for c in carved)  # in its block
    bases = {b.data_ptr() for b, _ in host.blocks}
    assert copies[4].data_ptr() not in bases and len(carved) == 5  # 8000 bytes: an allocation of its own
