"""The grader's replay harness: runs INSIDE the sandbox, on the grader's pristine A2 stack.

Self-contained on purpose (copied into the scratch folder and run as a script): it imports
nothing from `grader`, only the `onenode` of the scratch copy (the starter with the reference A1
patch), so what it computes does not depend on the submission's code. The submission's files
are input, read through the trainer's safe loader (no pickle runs code). Under torchrun every
rank checks its own data position; rank 0 writes the report.

    python replay_harness.py plan.json        # writes replay.json beside it

plan.json: {"run": the submission folder, "final": a copy of its final/ folder,
            "data": its data folder or null (synthetic data),
            "checkpoints": step folder names oldest first, "spans": [[i, j], ...] (indices),
            "threads": CPU threads or null (the run's own, recorded in its checkpoints)}
replay.json: {"init_sha256": the recipe's seeded initialisation,
              "final_sha256": final/'s weights,
              "checkpoints": [{"name", "weights_sha256", "loader": null or what differs}],
              "spans": [{"start", "end", "steps", "seconds", "bitwise", "relative_error",
                         "error": only when the span could not be replayed}],
              "error": one line, only when the harness could not finish}
Hashes are `onenode.train.checkpoint.weights_sha256` of the whole model. A span that does not
come back bit for bit reports ||replayed - recorded|| / ||recorded - start||: how far the
replay lands from the recorded checkpoint, relative to how far the span moved the weights.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


def gathered(value) -> list:
    """`value` from every rank (one process: just this one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def loader_positions(trainer, steps: list[int]) -> dict[int, dict]:
    """The loader's state after each of `steps` optimizer steps, from the submitted data: a
    fresh loader stepped through the run (reading every window, so the digest is recomputed)."""
    positions, done = {}, 0
    for step in sorted(set(steps)):
        for _ in range((step - done) * trainer.accumulation):
            next(trainer.loader)
        done = step
        positions[step] = trainer.loader.state_dict()
    return positions


def loader_difference(recorded: dict, expected: dict) -> str | None:
    """None when a checkpoint's loader state is the one the submitted data gives, else which keys differ."""
    if recorded == expected:
        return None
    keys = sorted(k for k in set(recorded) | set(expected) if recorded.get(k) != expected.get(k))
    settings = recorded.get("settings"), expected.get("settings")
    if "settings" in keys and isinstance(settings[0], dict) and isinstance(settings[1], dict):
        keys = [k for k in keys if k != "settings"] + [f"settings.{k}" for k in sorted(settings[1])
                                                        if settings[0].get(k) != settings[1].get(k)]
    return ", ".join(keys)


def relative_error(replayed: dict, recorded: dict, start: dict) -> float:
    """||replayed - recorded|| / ||recorded - start|| over every tensor, in float64."""
    off = sum(float((replayed[k].double() - recorded[k].double()).norm()) ** 2 for k in recorded)
    moved = sum(float((recorded[k].double() - start[k].double()).norm()) ** 2 for k in recorded)
    return (off / moved) ** 0.5 if moved > 0 else (0.0 if off == 0 else float("inf"))


def verify(plan: dict, report: dict) -> None:
    import torch

    import onenode
    from onenode.train.checkpoint import full_model_state_dict, load_weights, weights_sha256
    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    run = Path(plan["run"])
    checkpoints = [run / "checkpoints" / name for name in plan["checkpoints"]]
    metas = [json.loads((path / "meta.json").read_text()) for path in checkpoints]

    def threads_of(meta: dict) -> int:  # CPU threads decide the bits too: the run's own, unless the plan says
        return int(plan["threads"] or meta["layout"]["threads"])

    torch.set_num_threads(threads_of(metas[0]))
    overrides = {"log.tensorboard": False, "log.progress_bar": False}
    if plan["data"]:
        overrides.update({"data.source": "shards", "data.path": plan["data"]})
    recipe = load_recipe(run / "recipe.yaml", overrides)

    trainer = Trainer(recipe, Path("replay-init"), resume=None)
    report["init_sha256"] = trainer.weights_sha256()
    expected = loader_positions(trainer, [meta["step"] for meta in metas])
    report["checkpoints"] = []
    for path, meta in zip(checkpoints, metas):
        load_weights(path, trainer.parallel.model)
        state = torch.load(path / f"trainer_state_rank{trainer.rank}.pt", weights_only=True)
        differences = gathered(loader_difference(state["loader"], expected[meta["step"]]))
        problems = [f"rank {r}: {d}" for r, d in enumerate(differences) if d]
        report["checkpoints"].append({"name": path.name, "weights_sha256": trainer.weights_sha256(),
                                      "loader": "; ".join(problems) or None})
    final = onenode.load_pretrained(plan["final"])
    report["final_sha256"] = weights_sha256(full_model_state_dict(final))
    del trainer, final  # the spans build their own

    recomputed = [c["weights_sha256"] for c in report["checkpoints"]]
    report["spans"] = []
    for i, j in plan["spans"]:
        entry = {"start": checkpoints[i].name, "end": checkpoints[j].name, "steps": metas[j]["step"] - metas[i]["step"],
                 "seconds": 0.0, "bitwise": False, "relative_error": None}
        try:
            torch.set_num_threads(threads_of(metas[i]))
            replay_span(Trainer(recipe, Path(f"replay-{i}"), resume=str(checkpoints[i])), checkpoints[i],
                        checkpoints[j], recomputed[j], entry)
        except Exception as e:  # this span cannot be replayed (its checkpoint holds another data order, say)
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        report["spans"].append(entry)


def replay_span(trainer, start: Path, end: Path, end_sha256: str, entry: dict) -> None:
    """Train `trainer` (resumed from `start`) `entry["steps"]` steps and compare with `end`."""
    from onenode.train.checkpoint import full_model_state_dict, load_weights, weights_sha256

    began = time.perf_counter()
    for _ in range(entry["steps"]):
        trainer.train_step()
    entry["seconds"] = time.perf_counter() - began
    model = trainer.parallel.model
    replayed = {k: v.clone() for k, v in full_model_state_dict(model).items()}
    entry["bitwise"] = gathered(trainer.rank == 0 and weights_sha256(replayed) == end_sha256)[0]
    entry["relative_error"] = 0.0
    if not entry["bitwise"]:
        load_weights(end, model)
        recorded = {k: v.clone() for k, v in full_model_state_dict(model).items()}
        load_weights(start, model)
        if trainer.rank == 0:
            entry["relative_error"] = relative_error(replayed, recorded, full_model_state_dict(model))


def main(plan_file: str) -> int:
    plan_path = Path(plan_file)
    report: dict = {}
    try:
        verify(json.loads(plan_path.read_text()), report)
    except Exception as e:  # the report says why; the parent fails the run with it
        report["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        traceback.print_exc()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        (plan_path.parent / "replay.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
