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

from grader.a2.audit import audit_run
from grader.a2.intake import load_submission
from grader.a2.job import new_job
from grader.a2.rubric import load_rubric
from grader.a2.scoring import verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grader" / "a2"))
import replay_harness  # noqa: E402  (a script the grader copies into the sandbox)


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
