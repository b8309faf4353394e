"""A1 part 3: the hybrid model splits into pipeline stages and trains exactly as in one process.

What is measured: three optimizer steps of the tiny model (plain SGD through the kit's
`train_step`, gradient clipping included) on 2 gloo processes with `ParallelDims(pp=2)`, once per
schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank), against the same steps
in one process: the loss of every step, the global gradient norm, and every parameter's gradient
after the last step. The two processes together must hold every parameter exactly once.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

PP = 2
BATCH, SEQ, STEPS = 4, 16, 3
MICROBATCHES = 4
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]


def _config():
    from onenode.model import get_preset

    return get_preset("tiny")


def _batches(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _train(model) -> dict:
    """Losses, gradient norms and the last gradients (by name) of STEPS SGD steps."""
    from onenode.train.step import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for tokens in _batches(_config().vocab_size):
        out = train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], grad_clip=1.0)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"losses": losses, "grad_norms": norms, "grads": grads}


def pipeline_worker() -> dict:
    """Every schedule in turn on this rank: {schedule: what `_train` returns}."""
    from onenode.model import build_model
    from onenode.parallel import ParallelDims, parallelize

    results = {}
    for schedule in SCHEDULES:
        model = parallelize(build_model(_config(), seed=0), ParallelDims(pp=PP), schedule=schedule,
                            microbatches=MICROBATCHES)
        results[schedule] = _train(model)
    return results


@pytest.fixture(scope="module")
def pp_run() -> dict:
    """The one-process reference and the pipeline ranks' results, or the error that stopped them."""
    from onenode.model import build_model

    reference = _train(build_model(_config(), seed=0))
    try:
        return {"reference": reference, "ranks": run_distributed(pipeline_worker, PP), "error": None}
    except (RuntimeError, TimeoutError) as e:  # a rank raised, or hung
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return {"reference": reference, "ranks": None, "error": lines[-1]}


def _ranks(pp_run: dict) -> list[dict]:
    if pp_run["error"]:
        pytest.fail(
            f"pp={PP} did not build or train: {pp_run['error']} (print(model) shows the model's own layout)"
        )
    return pp_run["ranks"]


@pytest.mark.dist
def test_pp_builds_and_trains(pp_run):
    losses = [rank[s]["losses"] for rank in _ranks(pp_run) for s in SCHEDULES]
    assert all(len(steps) == STEPS for steps in losses)


@pytest.mark.dist
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_stages_hold_every_parameter_once(pp_run, schedule):
    held = [name for rank in _ranks(pp_run) for name in rank[schedule]["grads"]]
    expected = sorted(pp_run["reference"]["grads"])
    assert sorted(held) == expected, (
        f"pp={PP} {schedule}: the stages together hold {len(held)} parameters with gradients "
        f"({len(set(held))} distinct names), the model has {len(expected)} (missing: "
        f"{sorted(set(expected) - set(held))[:3]}); expected each parameter on exactly one stage, under its own name"
    )


@pytest.mark.dist
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_trains_like_one_process(pp_run, schedule):
    reference = pp_run["reference"]
    ranks = [rank[schedule] for rank in _ranks(pp_run)]
    losses = [r["losses"] for r in ranks if r["losses"][0] is not None]
    assert len(losses) == 1, f"pp={PP} {schedule}: exactly one rank (the last stage) reports the loss"
    assert losses[0] == pytest.approx(reference["losses"], rel=1e-5), (
        f"pp={PP} {schedule}: losses {losses[0]}, one process {reference['losses']}: "
        f"splitting the model into stages must not change the maths"
    )
    for r in ranks:
        assert r["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4), (
            f"pp={PP} {schedule}: gradient norms {r['grad_norms']}, one process {reference['grad_norms']}: "
            f"the norm must be global, over every stage"
        )
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-4, atol=1e-7,
                                       msg=lambda m, name=name: f"pp={PP} {schedule}, gradient of {name}: {m}")
