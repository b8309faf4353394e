"""`train.float8`: chosen linear layers trained through torchao's rowwise Float8Linear
(`parallel/float8.py`), on the tiny model on a CPU, where torch runs the float8 matmuls too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from onenode.model import build_model, get_preset
from onenode.parallel.float8 import apply_float8, summary
from onenode.train.assembly import assemble
from onenode.train.recipe import RecipeError, load_recipe
from onenode.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"


def _linears(model: torch.nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_float8_converts_only_the_kinds_asked_for_and_keeps_the_parameters():
    pytest.importorskip("torchao.float8")
    model = build_model(get_preset("tiny"), seed=0)
    names_before = [name for name, _ in model.named_parameters()]
    result = apply_float8(model, ["attention", "mlp"])
    linears = _linears(model)
    converted = {name for names in result["converted"].values() for name in names}
    assert set(result["converted"]) == {"attention", "mlp"}
    assert converted == {name for name, kind in linears.items() if kind == "Float8Linear"}
    assert {name.rsplit(".", 1)[-1] for name in result["converted"]["attention"]} == {"q_proj", "k_proj", "v_proj",
                                                                                        "o_proj"}
    mlp = result["converted"]["mlp"]  # shared experts and dense MLP layers, no routed expert
    assert any(".shared_experts." in name for name in mlp) and not any(".mixer.experts." in name for name in mlp)
    unconverted = {name for name, kind in linears.items() if kind == "Linear"}
    assert "lm_head" in unconverted
    assert any(".mixer.experts." in name for name in unconverted) and any(".out_proj" in name for name in unconverted)
    assert [name for name, _ in model.named_parameters()] == names_before  # checkpoints and exports unchanged

    model = build_model(get_preset("tiny"), seed=0)
    result = apply_float8(model, ["mamba", "experts"])
    kept = result["kept_bf16"]["mamba"]
    assert kept and all(name.endswith("in_proj") for name in kept)  # tiny's in_proj: not a multiple of 16
    assert all(model.get_submodule(name).out_features % 16 for name in kept)
    assert all(".experts." in name for name in result["converted"]["experts"])
    assert "mamba 3" in summary(result) and "kept bf16" in summary(result)
    with pytest.raises(ValueError, match=r"\['lm_head'\] are not layer kinds; choose from"):
        apply_float8(model, ["lm_head"])


def test_the_recipe_says_what_float8_needs_and_keeps_the_hash_without_it(monkeypatch):
    with pytest.raises(RecipeError, match=r"train.float8: is a list of layer kinds from"):
        load_recipe(TINY, {"train.float8": ["head"]})
    with pytest.raises(RecipeError, match=r"train.float8: casts bf16 matmuls to float8: set train.precision bf16"):
        load_recipe(TINY, {"train.float8": ["mlp"], "train.precision": "fp32"})
    default, empty = load_recipe(TINY), load_recipe(TINY, {"train.float8": []})
    float8 = load_recipe(TINY, {"train.float8": ["mlp"], "train.precision": "bf16"})
    assert default.training_sha256 == empty.training_sha256 != float8.training_sha256

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as where torchao is not installed
    with pytest.raises(RecipeError, match=r"pip install 'onenode\[float8\]'"):
        assemble(float8, device="cpu")


@pytest.mark.slow  # about 15 s: two short runs of the tiny model
def test_float8_trains_the_tiny_model_like_bf16(tmp_path):
    """Every kind in float8 against none, 10 steps: the losses stay within a few hundredths of
    bf16's and fall, and the float8 layers' weights are trained (their gradients reach the masters)."""
    pytest.importorskip("torchao.float8")
    settings = {"train.precision": "bf16", "train.seq_len": 32, "train.global_batch_size": 4,
                "train.micro_batch_size": 4, "train.token_budget": 10 * 4 * 32, "checkpoint.enabled": False,
                "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False,
                "optimizer.lr": 3e-3}
    runs = {}
    for name, kinds in (("bf16", []), ("float8", ["mamba", "attention", "mlp", "experts"])):
        trainer = Trainer(load_recipe(TINY, {**settings, "train.float8": kinds}), tmp_path / name, resume=None)
        assert trainer.fit()["status"] == "finished"
        runs[name] = trainer
    model = runs["float8"].run.parallel.model
    assert sum(kind == "Float8Linear" for kind in _linears(model).values()) > 20
    before = build_model(get_preset("tiny"), seed=runs["float8"].recipe.seed).state_dict()
    after = model.state_dict()
    assert all(not torch.equal(before[name + ".weight"], after[name + ".weight"])
               for names in runs["float8"].run.float8["converted"].values() for name in names)
    bf16, float8 = runs["bf16"].losses, runs["float8"].losses
    assert len(bf16) == len(float8) == 10 and float8[-1] < float8[0] - 0.1
    assert max(abs(a - b) for a, b in zip(bf16, float8)) < 0.05
    assert bf16 != float8  # the option changed the run


@pytest.mark.slow  # about 50 s: 10 steps of the tiny model in float8, a checkpoint each, then the spans drawn replayed
def test_a_float8_run_verifies(tmp_path, capsys):
    """`onenode verify` on a tiny run with every kind in float8: the replay converts the same layers
    (the recipe names them, and its hash covers them) and takes the same steps, bit for bit."""
    pytest.importorskip("torchao.float8")
    from onenode import cli

    run = tmp_path / "run"
    settings = ["train.float8=[mamba,attention,mlp,experts]", "train.precision=bf16", "checkpoint.every_steps=1",
                "checkpoint.keep_last=0", "train.token_budget=5120", "log.progress_bar=false"]
    assert cli.main(["train", str(TINY), "--out", str(run), *[a for s in settings for a in ("--set", s)]]) == 0
    assert "float8" in (run / "recipe.yaml").read_text()
    capsys.readouterr()
    assert cli.main(["verify", str(run), "--profile", "cpu-tiny"]) == 0
    assert "replayed bit for bit" in capsys.readouterr().out
