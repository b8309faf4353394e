"""The replay of a DiLoCo run's span (`parallel.diloco`; `parallel/diloco.py`): from every replica
group's checkpoint at one sync to the next checkpoint, a multiple of `inner_steps` later.

A DiLoCo run's checkpoints fall on syncs, where every group holds the same weights and the same
outer momentum, and each its own inner optimizer state and data position. A span of it is
replayed in one process, window by window: each group's inner steps trained again from its own
checkpoint (its weights, its AdamW state) on its own slice of the data (the grader's batches, a
fresh loader stepped to the sync, as the replay harness reads them; the loader state a
checkpoint stores is compared, never used), then the sync by hand with the kit's own outer step
(`diloco.outer_step`: the pseudo-gradients averaged in group order, the outer Nesterov SGD step
from the outer momentum the checkpoint stores) and the routers' biases averaged as the groups
average them. The result must be the next checkpoint of every group: its weights, its outer
momentum and its inner optimizer state (bit for bit with two groups, whose sum torchft's
all-reduce takes in either order alike). A group hidden, or trained on other batches, or steps
not taken, does not give it back.

It runs in-process (`replay_span`); the verification does not plan it yet (`audit.replica_groups`
refuses DiLoCo runs): `replay_span`'s docstring says what that needs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .replay_harness import loader_difference, optimizer_state, relative_error, state_tensors


def group_folders(run: Path, replicas: int) -> list[Path]:
    """The run folder of every replica group, in group order (the trainer writes group r > 0 in
    `replica_{r}/`)."""
    return [run, *(run / f"replica_{r}" for r in range(1, replicas))]


def _group_trainer(run: Path, recipe, replica: int, data: Path | None, out: Path):
    """A trainer of replica group `replica`'s inner steps without torchft: the run's recipe as one
    group sees it (DiLoCo off, its share of the global batch and of the budget, so that its
    micro-batches, accumulation and learning rates are the group's), reading the group's slice."""
    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    d, t = recipe.parallel.diloco, recipe.train
    overrides = {"parallel.diloco.inner_steps": 0, "train.global_batch_size": t.global_batch_size // d.replicas,
                 "train.token_budget": t.token_budget // d.replicas, "log.tensorboard": False,
                 "log.progress_bar": False}
    if data is not None:
        overrides.update({"data.source": "shards", "data.path": str(data)})
    trainer = Trainer(load_recipe(run / "recipe.yaml", overrides), out, resume=None)
    trainer.data_rank, trainer.data_ranks = replica * trainer.dp + trainer.dp_rank, d.replicas * trainer.dp
    trainer.loader = trainer._loader("train")
    return trainer


def _weights(trainer) -> dict:
    from onenode.train.checkpoint import full_model_state_dict

    return {k: v.clone() for k, v in full_model_state_dict(trainer.parallel.model).items()}


def _set_weights(trainer, state: dict) -> None:
    trainer.parallel.model.load_state_dict(state)
    if trainer.parallel.master_weights is not None:
        trainer.parallel.master_weights.masters_changed()


def replay_span(run: Path, start: str, end: str, data: Path | None = None, threads: int | None = None) -> dict:
    """Replay the DiLoCo run at `run` (group 0's folder, the others in its `replica_{r}/`; `data`: the
    data folder it trained on, None for synthetic tokens) from its checkpoints `start` to `end`
    (step folder names, a multiple of `inner_steps` apart), in one process on `threads` CPU threads
    (default: the run's own): {"steps", "windows", "bitwise", "relative_error" (against every group's
    `end`), "outer_momentum_bitwise", "inner_bitwise": per group, "loader": per group, None or what
    differs from the grader's position}.

    What the verification needs to plan it (not built): the intake reading every group's chain
    (`onenode pack a2` copying `replica_*/`), the chains of all groups linked alike and their
    weights equal at each checkpoint, the replay harness calling this for the drawn spans, and the
    per-span checks redone for DiLoCo: a span's movement bound grown by the outer step (lr x (1 +
    momentum) x the inner bound, plus the stored momentum's share), each group's inner optimizer
    state bounded as one run's, and each group's logged losses on its own slice."""
    import torch

    from onenode.parallel.diloco import load_outer_momentum, outer_momentum, outer_optimizer, outer_step
    from onenode.train.checkpoint import load_checkpoint, rng_state, set_rng_state, weights_sha256
    from onenode.train.recipe import load_recipe

    recipe = load_recipe(run / "recipe.yaml")
    d = recipe.parallel.diloco
    begin, finish = (int(name.removeprefix("step_")) for name in (start, end))
    if not d.inner_steps or begin >= finish or (finish - begin) % d.inner_steps:
        raise ValueError(f"{start} -> {end} is not a whole number of outer windows of parallel.diloco.inner_steps "
                         f"{d.inner_steps}")
    folders = group_folders(run, d.replicas)
    meta = json.loads((run / "checkpoints" / start / "meta.json").read_text())
    torch.set_num_threads(int(threads or meta["layout"]["threads"]))  # the threads decide the bits too
    trainers, loaders, rngs = [], [], []
    scratch = tempfile.TemporaryDirectory(prefix="onenode-diloco-replay-")
    for replica, folder in enumerate(folders):
        trainer = _group_trainer(run, recipe, replica, data, Path(scratch.name) / f"group-{replica}")
        for _ in range(begin * trainer.accumulation):  # the grader's batches of this group, read to the sync
            next(trainer.loader)
        position = trainer.loader.state_dict()
        _, stored = load_checkpoint(folder / "checkpoints" / start, trainer.parallel, trainer.optimizer)
        trainer.loader.load_state_dict(position)
        trainer.step = stored["step"]
        loaders.append(loader_difference(stored["loader"], position))
        rngs.append(stored["rng"])  # each group's own process's generators
        trainers.append(trainer)
        if replica == 0:
            momentum = stored["diloco"]["outer_momentum"]
    lead = trainers[0]
    params = dict(lead.parallel.named_parameters())
    sgd = outer_optimizer(params.values(), d.outer_lr, d.outer_momentum)
    load_outer_momentum(sgd, params.items(), momentum)
    began = _weights(lead)
    report = {"steps": finish - begin, "windows": (finish - begin) // d.inner_steps, "loader": loaders}
    for _ in range(report["windows"]):
        synced_state = _weights(lead)
        synced = {name: param.detach().clone() for name, param in params.items()}
        trained, biases = [], []
        for replica, trainer in enumerate(trainers):  # each group's inner steps from the sync, in group order
            _set_weights(trainer, synced_state)
            set_rng_state(rngs[replica])
            for _ in range(d.inner_steps):
                trainer.train_step()
            rngs[replica] = rng_state()
            trained.append({name: p.detach().clone() for name, p in trainer.parallel.named_parameters()})
            biases.append([router.e_score_correction_bias.clone() for router in trainer.balancer.routers.values()])
        outer_step(sgd, params, synced, trained)
        with torch.no_grad():  # the routers' biases averaged over the groups (`ReplicaGroups._synced`)
            for i, router in enumerate(lead.balancer.routers.values()):
                total = biases[0][i].clone()
                for group in biases[1:]:
                    total += group[i]
                router.e_score_correction_bias.copy_(total / len(trainers))
        if lead.parallel.master_weights is not None:
            lead.parallel.master_weights.masters_changed()
    replayed, replayed_momentum = _weights(lead), outer_momentum(sgd, params.items())
    report.update(bitwise=True, relative_error=0.0, inner_bitwise=[])
    for replica, (trainer, folder) in enumerate(zip(trainers, folders)):
        inner = weights_sha256(state_tensors(optimizer_state(trainer)))
        _, stored = load_checkpoint(folder / "checkpoints" / end, trainer.parallel, trainer.optimizer)
        report["inner_bitwise"].append(inner == weights_sha256(state_tensors(optimizer_state(trainer))))
        recorded = _weights(trainer)
        if weights_sha256(recorded) != weights_sha256(replayed):
            report["bitwise"] = False
            report["relative_error"] = max(report["relative_error"], relative_error(replayed, recorded, began))
        if replica == 0:
            recorded_momentum = stored["diloco"]["outer_momentum"]
            report["outer_momentum_bitwise"] = set(recorded_momentum) == set(replayed_momentum) and all(
                torch.equal(recorded_momentum[name], replayed_momentum[name]) for name in replayed_momentum)
    scratch.cleanup()
    return report
