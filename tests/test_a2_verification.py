"""A2 verification by design: every span of the chain examined, some replayed, the data the
grader's. Each forgery of tests/redteam/a2_forgeries.py tells one story in its files and is caught
whatever spans the seed draws; the bounds the per-span check rests on hold for any gradients."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from redteam.a2_forgeries import BUDGET, FORGERIES, Forgery, Runs

from grader.a2.intake import load_submission
from grader.a2.job import new_job
from grader.a2.rubric import load_rubric
from grader.a2.scoring import verify
from onenode.verify import replay_harness
from onenode.verify.audit import audit_run


@pytest.fixture(scope="module")
def runs() -> Runs:
    return Runs()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job = new_job(load_rubric(), "cpu-tiny", tmp_path_factory.mktemp("job"), seed=0)
    job.eval_texts = ["no training document holds this sentence"]
    return job


@pytest.mark.parametrize("forgery", [pytest.param(f, id=f.name, marks=[pytest.mark.slow] if f.slow else [])
                                     for f in FORGERIES])
def test_forgery_is_caught(forgery: Forgery, runs, job, tmp_path):
    sub = forgery.build(runs, tmp_path)
    audit = [c for c in audit_run(load_submission(sub), BUDGET) if not c.ok]
    assert not audit, [c.detail for c in audit]  # the files tell one story: only the weights and the data tell
    logs = tmp_path / "logs"
    logs.mkdir()
    checks = {c.name: c for c in verify(job, load_submission(sub), logs)[0]}
    for name, reason in forgery.caught_by.items():
        assert not checks[name].ok, f"{name}: {checks[name].detail}"
        assert re.search(reason, checks[name].detail), checks[name].detail


@pytest.mark.slow
def test_the_gpu_measurement_verifies_honest_runs_at_tiny_scale(tmp_path):
    """benchmarks/a2_verification.py, whose GPU record the GPU tolerances come from, on a CPU: an
    honest run (the one the tests above train) verified with every span replayed bit for bit (the
    deterministic mode's run: tests/test_a2_grader.py)."""
    kit = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(kit / "benchmarks" / "a2_verification.py"), str(tmp_path), "honest",
                           "--cpu", "--only", "default-every-2"], cwd=kit, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert set(record["honest"]) == {"default-every-2"}
    for name, entry in record["honest"].items():
        assert entry.get("verified"), (name, entry)
        assert len(entry["spans"]) == 10 and all(span["bitwise"] for span in entry["spans"]), entry["spans"]
        assert entry["loss_relative_errors"] == [0.0] * 10


# -- the bounds ------------------------------------------------------------------------------------
def test_no_adamw_step_moves_a_weight_further_than_the_bound():
    """Gradients chosen to push Adam's step up (growing, sign-steady, then flipping, some zero)."""
    steps, lr, betas = 60, 1e-2, (0.9, 0.95)
    bound = replay_harness.adamw_step_bound(*betas, steps)
    weight = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float64))
    optimizer = torch.optim.AdamW([weight], lr=lr, betas=betas, eps=1e-12, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for t in range(steps):
        scale = torch.rand(4096, generator=generator, dtype=torch.float64) * 10.0 ** (t % 7)
        sign = torch.where(torch.rand(4096, generator=generator) < 0.9, 1.0, -1.0).double()
        weight.grad = scale * sign * (torch.rand(4096, generator=generator) > 0.1)
        before = weight.detach().clone()
        optimizer.step()
        worst = max(worst, float((weight.detach() - before).abs().max()) / lr)
    assert 1.0 <= worst <= bound, (worst, bound)
    assert bound < 1.2  # Adam's (0.9, 0.95): a step is about one learning rate, which is what makes the bound bite


def test_no_muon_update_entry_exceeds_the_newton_schulz_gain():
    from onenode.train.optim import orthogonalize

    coefficients, steps = (3.4445, -4.775, 2.0315), 5
    gain = replay_harness.newton_schulz_gain(coefficients, steps)
    generator = torch.Generator().manual_seed(0)
    for shape in ((64, 64), (32, 128), (256, 16)):
        matrix = torch.randn(*shape, generator=generator)
        matrix[0] *= 1e3  # one dominant row: the update's entries at their largest
        update = orthogonalize(matrix, steps, coefficients, 1e-7, torch.float32)
        assert float(update.abs().max()) <= gain, shape
        assert float(torch.linalg.matrix_norm(update, 2)) <= gain * 1.001, shape


def test_movement_is_measured_against_the_schedules_learning_rates():
    allowances = {"w": (1.0, 0.0)}
    start = {"w": torch.zeros(3), "buffer": torch.ones(2), "layer.e_score_correction_bias": torch.zeros(2)}
    allowed = replay_harness.movement_allowance(allowances, [1e-3, 1e-3], bias_rate=1e-3)
    near = {"w": torch.tensor([2e-3, -1e-3, 0.0]), "buffer": torch.ones(2),
            "layer.e_score_correction_bias": torch.tensor([2e-3, -2e-3])}
    worst, _ = replay_harness.movement(start, near, allowed)
    assert 0.9 < worst <= 1.0  # two steps of one lr each: at the bound, within the rounding slack
    far = {**near, "w": torch.tensor([3e-3, 0.0, 0.0])}
    worst, where = replay_harness.movement(start, far, allowed)
    assert worst > 1.4 and where == "w"
    moved_buffer = {**near, "buffer": torch.tensor([1.0, 1.5])}
    worst, where = replay_harness.movement(start, moved_buffer, allowed)
    assert worst > 1e3 and where == "buffer"  # a buffer training leaves alone may move by its rounding only


# -- the optimizer state a span starts from --------------------------------------------------------
def _stepped_states(optimizer_name: str, gradient, steps: int, clip: float = 1.0) -> list[dict]:
    """A small model's optimizer (the kit's AdamW, or Muon on its matrices and AdamW on the rest)
    stepped `steps` times on `gradient(step, name, parameter)`, clipped to global norm `clip` as
    `train_step` clips: the state a checkpoint stores before the first step (DCP makes it: counters
    1, moments 0) and after each step."""
    import copy

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from onenode.train.optim import optimizers_of
    from onenode.train.step import build_optimizer, clip_grad_norm_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    optimizer = build_optimizer(model, optimizer_name, lr=1e-2)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    states = [copy.deepcopy(get_optimizer_state_dict(model, optimizers_of(optimizer), options=options))]
    for step in range(steps):
        for name, param in model.named_parameters():
            param.grad = gradient(step, name, param)
        clip_grad_norm_(list(model.parameters()), clip)
        optimizer.step()
        states.append(copy.deepcopy(get_optimizer_state_dict(model, optimizers_of(optimizer), options=options)))
    return states


def _steady(step, name, param):  # one direction every step, far above the clip: AdamW's bounds are reached
    return torch.full_like(param, 1e3)


def _steady_matrices(step, name, param):  # the same on the matrices alone (Muon's): its bound is reached
    return torch.full_like(param, 1e3 * (param.ndim == 2))


STEADY = {"adamw": _steady, "muon": _steady_matrices}


def _wild(step, name, param):  # norms from far below the clip to far above, signs flipping, some zero
    generator = torch.Generator().manual_seed(step * 100 + len(name))
    sign = torch.where(torch.rand(param.shape, generator=generator) < 0.7, 1.0, -1.0)
    return torch.rand(param.shape, generator=generator) * sign * 10.0 ** (step % 5 - 2) * (step % 7 != 3)


def _norms(state: dict) -> dict[str, float]:
    tensors = [entry for entry in state["state"].values()]
    return {"||exp_avg||": sum(float(e["exp_avg"].double().square().sum()) for e in tensors if "exp_avg" in e) ** 0.5,
            "sum(exp_avg_sq)": sum(float(e["exp_avg_sq"].double().sum()) for e in tensors if "exp_avg" in e),
            "||momentum_buffer||": sum(float(e["momentum_buffer"].double().square().sum())
                                       for e in tensors if "momentum_buffer" in e) ** 0.5}


@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_every_trained_optimizer_state_is_within_the_clipped_bounds_which_it_can_reach(optimizer_name):
    """Any gradients, clipped to global norm c: every state is within the bounds; gradients of one
    direction above the clip reach them (so they are tight: 1.001 over is refused, below)."""
    steps, clip = 20, 1.0
    for gradient in (_wild, STEADY[optimizer_name]):
        states = _stepped_states(optimizer_name, gradient, steps, clip)
        for t, state in enumerate(states):
            assert replay_harness.optimizer_state_problem(state, states[0], t, clip) is None, (gradient.__name__, t)
    found = _norms(states[-1])
    for what, bound in {"||exp_avg||": 1 - 0.9 ** steps, "sum(exp_avg_sq)": 1 - 0.95 ** steps,
                        "||momentum_buffer||": 1 - 0.95 ** steps}.items():
        if found[what]:
            assert 0.999 < found[what] / bound <= replay_harness.MOMENT_ROUNDING, (what, found[what], bound)
    assert found["||momentum_buffer||"] > 0 if optimizer_name == "muon" else found["||momentum_buffer||"] == 0


def _scaled(key: str, factor: float):
    def forge(state):
        for entry in state["state"].values():
            if key in entry:
                entry[key] = entry[key] * factor
    return forge


def _set_first(key: str, value: float):
    def forge(state):
        entry = next(e for e in state["state"].values() if key in e)
        entry[key] = entry[key].clone()
        entry[key].view(-1)[0] = value
    return forge


def _setting(key: str, value):
    def forge(state):
        state["param_groups"][0][key] = value
    return forge


@pytest.mark.parametrize("optimizer_name, forge, reason", [
    ("adamw", _scaled("exp_avg", 1.002), r"^\|\|exp_avg\|\| .* over its parameters \(beta 0.9\); 20 steps of gradients "
                                         r"clipped to global norm 1 give at most 0.8784"),
    ("adamw", _scaled("exp_avg_sq", 1.002), r"^sum\(exp_avg_sq\) .* 20 steps of gradients clipped to global norm 1"),
    ("adamw", _set_first("exp_avg_sq", 0.0), r"^0\.weight's exp_avg .* against exp_avg_sq 0: 20 steps of any "
                                             r"gradients give \|exp_avg\| <= 1.14 x sqrt\(exp_avg_sq\)"),
    ("adamw", _set_first("exp_avg", float("nan")), r"^0\.weight's optimizer state is not finite"),
    ("adamw", _set_first("step", 20.0), r"^0\.weight's optimizer step counter is 20, not 21 \(the step-0 state's 1 "
                                        r"plus its 20 steps\)"),
    ("adamw", _setting("weight_decay", 0.0), r"^optimizer setting weight_decay 0.0 where the recipe's optimizer has"),
    ("adamw", _setting("betas", (0.5, 0.95)), r"^optimizer setting betas \(0.5, 0.95\)"),
    ("muon", _scaled("momentum_buffer", 1.002), r"^\|\|momentum_buffer\|\| .* \(beta 0.95\); 20 steps of gradients"),
    ("muon", _setting("nesterov", False), r"^optimizer setting nesterov False"),
])
def test_an_optimizer_state_no_training_makes_is_refused_in_one_line(optimizer_name, forge, reason):
    states = _stepped_states(optimizer_name, STEADY[optimizer_name], 20)
    forged = states[-1]
    forge(forged)
    problem = replay_harness.optimizer_state_problem(forged, states[0], 20, 1.0)
    assert problem and "\n" not in problem and re.search(reason, problem), problem


def test_the_state_before_the_first_step_is_the_fresh_one():
    """At step 0 no gradient has been seen: any moment is refused, and any other counter."""
    states = _stepped_states("adamw", _steady, 1)
    assert replay_harness.optimizer_state_problem(states[0], states[0], 0, 1.0) is None
    problem = replay_harness.optimizer_state_problem(states[1], states[0], 0, 1.0)
    assert problem.startswith("0.weight's optimizer step counter is 2, not 1"), problem
    moved = states[0]
    _set_first("exp_avg", 1e-6)(moved)
    problem = replay_harness.optimizer_state_problem(moved, states[0], 0, 1.0)
    assert re.search(r"exp_avg 1e-06 against exp_avg_sq 0: 0 steps of any gradients give", problem), problem
