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

The verification of a DiLoCo run (`verify_groups`: `python -m onenode.verify.diloco_replay
plan.json`, the harness `replay.harness_launch` picks for a recipe of `parallel.diloco`) is a
plain run's, group by group, with the outer step in the bounds:
- the audit (`audit.replica_groups`) has every group's folder, its chain linked alike and its
  weights group 0's at every checkpoint;
- every group's chain is examined as a run's (`replay_harness.examine_chain`): each checkpoint's
  weights hashed, its data position against the grader's on that group's slice, its inner
  optimizer state judged as one run's, its loss on the grader's batch of the group's next step
  against the loss that group recorded;
- the span's movement (`OuterBound`) is bounded by the outer step's: a window's pseudo-gradient
  moves no weight further than the inner steps can (A), so the Nesterov step moves it at most
  outer_lr x ((1 + momentum) x A + momentum^2 x |buffer|), the buffer's bound carried from zero at
  step 0 (buffer <- momentum x buffer + A); the outer momentum a checkpoint stores must lie within
  that bound, and be the same in every group;
- the drawn spans are replayed by `replay_span`, every group's end compared.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

from .replay_harness import (
    BIAS_BUFFER,
    MOMENT_ROUNDING,
    examine_chain,
    loader_difference,
    main,
    movement_allowance,
    optimizer_error,
    optimizer_state,
    plain_name,
    relative_error,
    state_tensors,
    step_allowances,
    threads_of,
)


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


def _inner_state(trainer) -> dict:
    """A copy of the group's inner optimizer state's tensors (`state_tensors`)."""
    return {k: v.clone() for k, v in state_tensors(optimizer_state(trainer)).items()}


def replay_span(run: Path, start: str, end: str, data: Path | None = None, threads: int | None = None) -> dict:
    """Replay the DiLoCo run at `run` (group 0's folder, the others in its `replica_{r}/`; `data`: the
    data folder it trained on, None for synthetic tokens) from its checkpoints `start` to `end`
    (step folder names, a multiple of `inner_steps` apart), in one process on `threads` CPU threads
    (default: the run's own): {"steps", "windows", "seconds", "bitwise", "relative_error" (against
    every group's `end`), "outer_momentum_bitwise", "inner_bitwise" and "inner_relative_error": per
    group, "loader": per group, None or what differs from the grader's position}."""
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
        trainer.step = begin  # the chain's step, never the trainer state's: it picks the learning rate
        loaders.append(loader_difference(stored["loader"], position))
        rngs.append(stored["rng"])  # each group's own process's generators
        trainers.append(trainer)
        if replica == 0:
            momentum = stored["diloco"]["outer_momentum"]
    lead = trainers[0]
    params = dict(lead.parallel.named_parameters())
    sgd = outer_optimizer(params.values(), d.outer_lr, d.outer_momentum)
    load_outer_momentum(sgd, params.items(), momentum)
    began, inner_began = _weights(lead), [_inner_state(trainer) for trainer in trainers]
    report = {"steps": finish - begin, "windows": (finish - begin) // d.inner_steps, "loader": loaders}
    clock = time.perf_counter()
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
    report["seconds"] = time.perf_counter() - clock
    replayed, replayed_momentum = _weights(lead), outer_momentum(sgd, params.items())
    report.update(bitwise=True, relative_error=0.0, inner_bitwise=[], inner_relative_error=[])
    for replica, (trainer, folder) in enumerate(zip(trainers, folders)):
        inner = _inner_state(trainer)
        _, stored = load_checkpoint(folder / "checkpoints" / end, trainer.parallel, trainer.optimizer)
        recorded_inner = _inner_state(trainer)
        same = weights_sha256(inner) == weights_sha256(recorded_inner)
        report["inner_bitwise"].append(same)
        report["inner_relative_error"].append(0.0 if same else optimizer_error(inner, recorded_inner,
                                                                               inner_began[replica]))
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


class OuterBound:
    """judge(step, weights, trainer state) for group 0's chain (`replay_harness.examine_chain`): each
    span's movement against the most its inner steps and outer steps can move the weights, and the
    outer momentum the checkpoint stores against the most the outer steps so far can build."""

    def __init__(self, trainer, recipe, lrs: list[float]):
        self.allowances, self.lrs, self.bias_rate = step_allowances(trainer), lrs, recipe.moe.bias_update_rate
        self.diloco = recipe.parallel.diloco
        self.names = {plain_name(name): name for name, _ in trainer.parallel.named_parameters()}
        self.buffer: dict = {}  # state-dict name -> the elementwise bound on |outer momentum| (float64)
        self.previous = None

    def __call__(self, step: int, state: dict, stored: dict) -> dict:
        import torch

        from .replay_harness import movement as movement_of

        d, found = self.diloco, {}
        if self.previous is not None:
            begin, start = self.previous
            allowed = {}
            for name in state:
                total = torch.zeros_like(state[name], dtype=torch.float64)
                bound = self.buffer.get(name, torch.zeros_like(total))
                for window in range(begin, step, d.inner_steps):  # each outer window of the span
                    inner = movement_allowance(self.allowances, self.lrs[window:window + d.inner_steps],
                                               self.bias_rate)(name, start[name], state[name]).double()
                    if name.endswith(BIAS_BUFFER) or name not in self.names:
                        total += inner  # averaged over the groups at the sync, not stepped by the outer SGD
                        continue
                    total += d.outer_lr * ((1 + d.outer_momentum) * inner + d.outer_momentum ** 2 * bound)
                    bound = d.outer_momentum * bound + inner
                self.buffer[name] = bound
                allowed[name] = total
            found["movement"], found["movement_at"] = movement_of(start, state, lambda name, a, b: allowed[name])
        momentum = (stored.get("diloco") or {}).get("outer_momentum")
        found["optimizer"] = self.momentum_problem(momentum, step)
        found["outer_momentum_sha256"] = weights_sha256_of(momentum)
        self.previous = (step, state)
        return found

    def momentum_problem(self, momentum, step: int) -> str | None:
        """Why the stored outer momentum is not one the run's outer steps can have built, or None."""
        if not isinstance(momentum, dict):
            return "its trainer state holds no DiLoCo outer momentum"
        plain = {plain_name(name): value for name, value in momentum.items()}
        for name, value in plain.items():
            if name not in self.names:
                return f"its outer momentum names {name}, which is not a trained parameter"
            bound = self.buffer.get(name)
            over = value.double().abs() - (MOMENT_ROUNDING * bound if bound is not None else 0.0)
            if bool((over > 0).any()):
                return (f"its outer momentum of {name} reaches {float(value.double().abs().max()):.3g}, past what "
                        f"{step // self.diloco.inner_steps} outer steps of the schedule's inner steps can build")
        return None


def weights_sha256_of(tensors) -> str | None:
    """`weights_sha256` of a dict of tensors (None for anything else)."""
    from onenode.train.checkpoint import weights_sha256

    return weights_sha256(tensors) if isinstance(tensors, dict) else None


def verify_groups(plan: dict, report: dict) -> None:
    """The replay harness's work for a DiLoCo run (as `replay_harness.verify`'s, the same plan.json and
    replay.json, plus "groups": the per-checkpoint entries of groups 1 .. R-1, and each entry's
    "outer_momentum_sha256"): every group's chain examined on its own slice, group 0's movement
    and outer momentum against `OuterBound`, the drawn spans replayed with every group."""
    import onenode
    from onenode.train.checkpoint import full_model_state_dict, weights_sha256
    from onenode.train.recipe import load_recipe
    from onenode.train.schedule import lr_factor

    run = Path(plan["run"])
    recipe = load_recipe(run / "recipe.yaml")
    data = Path(plan["data"]) if plan["data"] else None
    folders = group_folders(run, recipe.parallel.diloco.replicas)
    span_ends = {j for _, j in plan["spans"]}
    chains = []
    with tempfile.TemporaryDirectory(prefix="onenode-diloco-verify-") as scratch:
        for replica, folder in enumerate(folders):
            checkpoints = [folder / "checkpoints" / name for name in plan["checkpoints"]]
            metas = [json.loads((path / "meta.json").read_text()) for path in checkpoints]
            trainer = _group_trainer(run, recipe, replica, data, Path(scratch) / f"group-{replica}")
            judge = lambda step, state, stored: {  # noqa: E731 (the outer momentum, the same in every group)
                "outer_momentum_sha256": weights_sha256_of((stored.get("diloco") or {}).get("outer_momentum"))}
            if replica == 0:
                report["init_sha256"] = trainer.weights_sha256()
                lrs = [recipe.optimizer.lr * lr_factor(recipe.schedule, t, trainer.total_steps)
                       for t in range(metas[-1]["step"])]
                judge = OuterBound(trainer, recipe, lrs)
            entries, _ = examine_chain(trainer, checkpoints, metas, span_ends, judge, recipe.tokens_per_step)
            chains.append(entries)
            del trainer
    report["checkpoints"], report["groups"] = chains[0], chains[1:]
    final = onenode.load_pretrained(plan["final"])
    report["final_sha256"] = weights_sha256(full_model_state_dict(final))
    del final
    report["spans"] = []
    for i, j in plan["spans"]:
        start, end = plan["checkpoints"][i], plan["checkpoints"][j]
        entry = {"start": start, "end": end, "steps": 0, "seconds": 0.0, "bitwise": False, "relative_error": None,
                 "optimizer_bitwise": False, "optimizer_relative_error": None}
        try:
            meta = json.loads((run / "checkpoints" / start / "meta.json").read_text())
            span = replay_span(run, start, end, data, threads_of(plan, meta))  # it sets the threads
            entry.update(steps=span["steps"], seconds=span["seconds"], bitwise=span["bitwise"],
                         relative_error=span["relative_error"],
                         optimizer_bitwise=all(span["inner_bitwise"]) and span["outer_momentum_bitwise"],
                         optimizer_relative_error=max(span["inner_relative_error"]
                                                      + [0.0 if span["outer_momentum_bitwise"] else math.inf]))
        except Exception as e:  # this span cannot be replayed
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        report["spans"].append(entry)


if __name__ == "__main__":  # the replay harness of a DiLoCo run: python -m onenode.verify.diloco_replay plan.json
    sys.exit(main(sys.argv[1], verify_groups))
