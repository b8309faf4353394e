"""A1 part 2: with ep > 1 each rank keeps its share of the routed experts, and tokens travel to them.

What is measured: the losses of a few optimizer steps on 2 gloo processes with
`ParallelDims(dp=2, ep=2)` against one process, and the bytes all-gathered per step, counted by
wrapping `torch.distributed`'s collectives, for two models that differ only in the experts'
intermediate size: the difference between the two is expert weights being all-gathered.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

DP = EP = 2
BATCH, SEQ = 4, 16
STEPS = 3
MIB = 2**20


EXPERT_SIZES = (32, 64)  # moe_intermediate_size of the two models


def _config(expert_size: int = EXPERT_SIZES[0]):
    from onenode.model import get_preset

    return get_preset("tiny", moe_intermediate_size=expert_size)


def _batch(vocab: int, step: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _steps(model, vocab: int, rows: slice = slice(None), counter=None, lr: float = 1e-2) -> tuple[list[float], dict]:
    """STEPS optimizer steps on `rows` of each batch: the losses, and the bytes moved per step."""
    from onenode.train.step import build_optimizer, train_step

    optimizer, losses, moved = build_optimizer(model, lr=lr), [], {}
    for step in range(STEPS):
        tokens = _batch(vocab, step)[rows]
        if counter is not None:
            counter.take()
        losses.append(train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], grad_clip=1.0)["loss"])
        if counter is not None:
            for family, n in counter.take().items():
                moved[family] = moved.get(family, 0) + n / STEPS
    return losses, moved


def ep_worker() -> list[dict]:
    """STEPS optimizer steps with dp=2, ep=2 per expert size: this rank's losses and collective bytes."""
    import torch.distributed as dist
    from collectives import CollectiveCounter

    counter = CollectiveCounter()  # before onenode is imported, so every binding is wrapped
    from onenode.model import build_model
    from onenode.parallel import ParallelDims, parallelize

    runs = []
    for size in EXPERT_SIZES:
        config = _config(size)
        model = parallelize(build_model(config, seed=0), ParallelDims(dp=DP, ep=EP))
        rows = BATCH // DP
        mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
        losses, moved = _steps(model, config.vocab_size, mine, counter)
        runs.append({"losses": losses, "bytes": moved})
    return runs


@pytest.fixture(scope="module")
def ep_run() -> dict:
    from onenode.model import build_model

    expert_bytes = []
    for size in EXPERT_SIZES:
        model = build_model(_config(size), seed=0)
        expert_bytes.append(sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n))
    reference, _ = _steps(build_model(_config(), seed=0), model.config.vocab_size)
    ranks = run_distributed(ep_worker, DP)
    return {"reference_loss": reference, "ranks": ranks, "expert_bytes": expert_bytes}


@pytest.mark.slow
@pytest.mark.dist
def test_ep_losses_match_one_process(ep_run):
    losses = [sum(r[0]["losses"][step] for r in ep_run["ranks"]) / DP for step in range(STEPS)]
    assert losses == pytest.approx(ep_run["reference_loss"], rel=1e-5), (
        f"dp={DP}, ep={EP}: mean losses over {STEPS} optimizer steps {[round(x, 6) for x in losses]}, one process "
        f"{[round(x, 6) for x in ep_run['reference_loss']]}: with expert parallelism the training must stay the same"
    )


@pytest.mark.slow
@pytest.mark.dist
def test_ep_keeps_experts_local(ep_run):
    def per_step(family: str) -> list[float]:  # per expert size, the most any rank moved
        return [max(r[i]["bytes"].get(family, 0) for r in ep_run["ranks"]) for i in range(len(EXPERT_SIZES))]

    gathered, moved = per_step("all_gather"), per_step("all_to_all")
    small, large = ep_run["expert_bytes"]
    per_expert_byte = (gathered[1] - gathered[0]) / (large - small)
    assert per_expert_byte <= 0.01, (
        f"expert weights all-gathered: about {per_expert_byte * small / MIB:.2f} MiB per step and rank with "
        f"ep={EP} (experts of {small / MIB:.2f} MiB in all; doubling their size grew the all-gathers from "
        f"{gathered[0] / MIB:.2f} to {gathered[1] / MIB:.2f} MiB; all_to_all moved {moved[0] / MIB:.2f} MiB). "
        f"Expected about 0 MiB of expert weights all-gathered per step with ep={EP}."
    )
