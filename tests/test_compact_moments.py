"""`optimizer.moments: bfloat16` (issue 43: low-bit optimizer state): AdamW's two moments stored in
bfloat16 (`train/master_update.AdamWCompactMoments`), 4 bytes of state a parameter instead of 8.
It must be torch's AdamW with its moments rounded to bfloat16 once a step, resume bit for bit from
a checkpoint (torch's `load_state_dict` casts state to the parameters' dtype), and train the tiny
model like float32 moments on the fused bf16 path and the unfused float32 path alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onenode.train.master_update import AdamWCompactMoments
from onenode.train.recipe import RecipeError, load_recipe
from onenode.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((16, 8), (8,), (4, 4, 3))]


def _grads(step: int, params) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) * 0.1 for p in params]


OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def test_bfloat16_moments_are_adamw_with_its_moments_rounded_each_step():
    """Against torch's own AdamW whose moments are rounded to bfloat16 after every step: the same
    parameters to float32 rounding; against plain float32 moments: another trajectory (so the
    rounding is really there), and half the state's bytes."""
    compact_params, rounded_params, full_params = _params(), _params(), _params()
    compact = AdamWCompactMoments(compact_params, **OPTIONS)
    rounded = torch.optim.AdamW(rounded_params, foreach=False, **OPTIONS)
    full = torch.optim.AdamW(full_params, foreach=False, **OPTIONS)
    for step in range(6):
        for params, optimizer in ((compact_params, compact), (rounded_params, rounded), (full_params, full)):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            optimizer.step()
        for state in rounded.state.values():
            for moment in ("exp_avg", "exp_avg_sq"):
                state[moment].copy_(state[moment].bfloat16())
    for a, b, c in zip(compact_params, rounded_params, full_params):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, c)
    for p, reference in zip(compact_params, rounded_params):
        state = compact.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.allclose(state["exp_avg"].float(), rounded.state[reference]["exp_avg"], rtol=1e-2, atol=0)
    def state_bytes(optimizer):
        return sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    assert state_bytes(compact) * 2 == state_bytes(full)


def test_bfloat16_moments_resume_from_a_state_dict_bit_for_bit():
    """torch's `load_state_dict` casts the moments to float32; the optimizer casts them back as it
    loads, so a resumed run takes the uninterrupted run's steps exactly, in bfloat16 state."""
    straight_params, resumed_params = _params(), _params()
    straight = AdamWCompactMoments(straight_params, **OPTIONS)
    first = AdamWCompactMoments(resumed_params, **OPTIONS)
    for step in range(3):
        for params, optimizer in ((straight_params, straight), (resumed_params, first)):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            optimizer.step()
    resumed = AdamWCompactMoments(resumed_params, **OPTIONS)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state[resumed_params[0]]["exp_avg"].dtype == torch.bfloat16  # torch's cast undone on load
    for step in range(3, 5):
        for params, optimizer in ((straight_params, straight), (resumed_params, resumed)):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(straight_params, resumed_params))
    assert resumed.state[resumed_params[0]]["exp_avg"].dtype == torch.bfloat16


def test_the_recipe_says_what_bfloat16_moments_need():
    with pytest.raises(RecipeError, match=r"optimizer.moments: is float32, bfloat16 or int8"):
        load_recipe(TINY, {"optimizer.moments": "float16"})
    with pytest.raises(RecipeError, match=r"bfloat16 moments need betas\[1\] <= 0.99 .*use float32"):
        load_recipe(TINY, {"optimizer.moments": "bfloat16", "optimizer.betas": [0.9, 0.999]})
    default, explicit = load_recipe(TINY), load_recipe(TINY, {"optimizer.moments": "float32"})
    compact = load_recipe(TINY, {"optimizer.moments": "bfloat16"})
    assert default.training_sha256 == explicit.training_sha256 != compact.training_sha256


@pytest.mark.slow  # about 20 s each: four short runs of the tiny model
@pytest.mark.parametrize("precision", ["bf16", "fp32"], ids=["fused-update", "unfused"])
def test_bfloat16_moments_train_the_tiny_model_like_float32_moments(tmp_path, precision):
    """bf16 with one micro-batch takes the fused update (`master_update.clip_and_update`); fp32
    takes torch's clip and the optimizer's own step. Either way the state is bfloat16 and the
    losses stay within a few hundredths of float32 moments' over 12 steps."""
    settings = {"train.precision": precision, "train.seq_len": 32, "train.global_batch_size": 4,
                "train.micro_batch_size": 4, "train.token_budget": 12 * 4 * 32, "checkpoint.enabled": False,
                "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False,
                "optimizer.lr": 3e-3}
    runs = {}
    for moments in ("float32", "bfloat16"):
        trainer = Trainer(load_recipe(TINY, {**settings, "optimizer.moments": moments}), tmp_path / moments,
                          resume=None)
        assert trainer.fit()["status"] == "finished"
        runs[moments] = trainer
    states = [s for s in runs["bfloat16"].optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.bfloat16 for s in states)
    full, compact = runs["float32"].losses, runs["bfloat16"].losses
    assert len(full) == len(compact) == 12 and compact[-1] < compact[0] - 0.1
    assert max(abs(a - b) for a, b in zip(full, compact)) < 0.05
    assert full != compact  # the option changed the run


def test_the_optimizer_state_bound_allows_bfloat16_rounding_only_where_the_recipe_stores_it():
    """A2's optimizer-state check (`verify/replay_harness.optimizer_state_problem`): |exp_avg| <=
    ratio x sqrt(exp_avg_sq) holds exactly for float32 moments; bfloat16 moments round each once a
    step, which may put one 0.4% over (seen on the tiny model's embeddings). That slack is allowed
    only for a recipe with `optimizer.moments: bfloat16`, and nothing near a forgery's excess."""
    from onenode.verify.replay_harness import adam_moment_ratio, optimizer_state_problem

    group = {"params": ["w"], "betas": (0.9, 0.95), "lr": 0.1, "eps": 1e-8}
    zeros = torch.zeros(4, dtype=torch.float64)
    fresh = {"param_groups": [group], "state": {"w": {"step": torch.tensor(1.0), "exp_avg": zeros,
                                                      "exp_avg_sq": zeros}}}
    v = torch.full((4,), 2.59e-6, dtype=torch.float64)

    def stored(excess: float) -> dict:
        m = excess * adam_moment_ratio(0.9, 0.95, 2) * v.sqrt()
        return {"param_groups": [dict(group)], "state": {"w": {"step": torch.tensor(3.0), "exp_avg": m,
                                                               "exp_avg_sq": v}}}

    assert optimizer_state_problem(stored(0.999), fresh, 2, 0.0) is None
    assert "steps of any gradients give" in optimizer_state_problem(stored(1.004), fresh, 2, 0.0)
    assert optimizer_state_problem(stored(1.004), fresh, 2, 0.0, "bfloat16") is None
    assert "steps of any gradients give" in optimizer_state_problem(stored(1.05), fresh, 2, 0.0, "bfloat16")


@pytest.mark.slow  # about 40 s: 20 steps of the tiny model, then the spans the profile draws replayed
def test_a_run_with_bfloat16_moments_verifies(tmp_path):
    """`onenode verify` on a tiny run with bfloat16 moments: the replay loads each checkpoint's
    state (cast to float32 by torch) and takes the same bfloat16-rounded steps, bit for bit."""
    from onenode import cli

    run = tmp_path / "run"
    settings = ["optimizer.moments=bfloat16", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                "train.token_budget=10240", "log.progress_bar=false"]
    assert cli.main(["train", str(TINY), "--out", str(run), *[a for s in settings for a in ("--set", s)]]) == 0
    assert cli.main(["verify", str(run), "--profile", "cpu-tiny"]) == 0
