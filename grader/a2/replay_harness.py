"""The grader's replay harness: runs INSIDE the sandbox, on the grader's pristine A2 stack.

Self-contained on purpose (copied into the scratch folder and run as a script): it imports
nothing from `grader`, only the `onenode` of the scratch copy (the starter with the reference A1
patch), so what it computes does not depend on the submission's code. The submission's files
are input, read through the trainer's safe loader (no pickle runs code). Under torchrun every
rank reads its own batches; rank 0 writes the report.

    python replay_harness.py plan.json        # writes replay.json beside it

plan.json: {"run": the submission folder, "final": a copy of its final/ folder,
            "data": its data folder or null (synthetic data),
            "checkpoints": step folder names oldest first, "spans": [[i, j], ...] (indices),
            "threads": CPU threads or null (the run's own, recorded in its checkpoints)}
replay.json: {"init_sha256": the recipe's seeded initialisation,
              "final_sha256": final/'s weights,
              "checkpoints": [{"name", "weights_sha256", "loader": null or what differs,
                               "movement": the span up to it against the most training can move
                                           (null for step 0), "movement_at": the tensor nearest it,
                               "next_loss": its loss on the grader's batch of the next step
                                            (null for the last),
                               "stored_next_loss": the loss of that step as the next checkpoint's
                                                   trainer state records it}],
              "spans": [{"start", "end", "steps", "seconds", "bitwise", "relative_error",
                         "error": only when the span could not be replayed}],
              "error": one line, only when the harness could not finish}

The data is the grader's: one fresh loader on the submitted shards (or the recipe's synthetic
tokens) is stepped through the run; its batches give each checkpoint's `next_loss`, and its
positions are where each replayed span starts reading. The loader state a checkpoint stores is
only compared (`loader`), never used.

`movement` is max over every weight of |end - start| / allowed, where allowed is the most any
training of the span at the schedule's learning rates could move it (`movement_allowance`):
above 1, no training at those rates made that checkpoint from the one before.

Hashes are `onenode.train.checkpoint.weights_sha256` of the whole model. A span that does not
come back bit for bit reports ||replayed - recorded|| / ||recorded - start||: how far the
replay lands from the recorded checkpoint, relative to how far the span moved the weights.
"""

from __future__ import annotations

import json
import math
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


def adamw_step_bound(beta1: float, beta2: float, steps: int) -> float:
    """The most one AdamW step can move a weight, in learning rates (before weight decay), over
    the optimizer's first `steps` steps, whatever the gradients: by Cauchy-Schwarz over the
    moments' sums, |m_t| / sqrt(v_t) <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_j<t (b1^2 / b2)^j),
    times the bias corrections sqrt(1 - b2^t) / (1 - b1^t)."""
    ratio, total, best = beta1 ** 2 / beta2, 0.0, 0.0
    for t in range(1, min(steps, 100_000) + 1):
        total = total * ratio + 1.0
        best = max(best, math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) * (1 - beta1) / math.sqrt(1 - beta2)
                   * math.sqrt(total))
    return best


def newton_schulz_gain(coefficients, steps: int) -> float:
    """The largest singular value Muon's Newton-Schulz iteration gives a matrix whose singular
    values start in [0, 1]: a bound on every entry of the orthogonalised update."""
    import torch

    a, b, c = coefficients
    x = torch.linspace(0.0, 1.0, 200_001, dtype=torch.float64)
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return float(x.abs().max())


ROUNDING = 1.05  # slack on the bounds: float rounding of the update (and bfloat16 Newton-Schulz)
BIAS_BUFFER = "e_score_correction_bias"  # the routers' balancing bias: moved by the balancer, not the optimizer


def _plain_name(name: str) -> str:
    """A parameter's name as the model's state dict spells it (without compile or checkpoint wrappers)."""
    return ".".join(part for part in name.split(".") if part not in ("_orig_mod", "_checkpoint_wrapped_module",
                                                                       "_fsdp_wrapped_module"))


def step_allowances(trainer) -> dict[str, tuple[float, float]]:
    """For every trained weight, (the most one step moves it per unit of learning rate, its
    weight decay), from the grader's own optimizer of the recipe."""
    from onenode.train.optim import Muon, muon_lr_scale, optimizers_of

    names = {id(param): _plain_name(name) for name, param in trainer.parallel.model.named_parameters()}
    allowances = {}
    for optimizer in optimizers_of(trainer.optimizer):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if isinstance(optimizer, Muon):
                    unit = newton_schulz_gain(group["ns_coefficients"], group["ns_steps"]) \
                        * muon_lr_scale(group["adjust_lr_fn"], param.shape)
                else:
                    unit = adamw_step_bound(*group["betas"], trainer.total_steps)
                allowances[names[id(param)]] = (unit, group["weight_decay"])
    return allowances


def movement_allowance(allowances: dict, lrs: list[float], bias_rate: float):
    """allowed(name, start, end): how far any training of a span at learning rates `lrs` (one a
    step) can move tensor `name` from `start`, elementwise: sum(lr) x (step bound + weight decay
    x |weight|), the routers' bias `bias_rate` a step, plus the storage dtype's rounding."""
    import torch

    steps, lr_sum = len(lrs), sum(lrs)

    def allowed(name: str, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        size = torch.maximum(start.abs(), end.abs()).double()
        # each stored end rounded to its dtype, each step's float32 update rounded once
        rounding = (2 * torch.finfo(end.dtype).eps + steps * torch.finfo(torch.float32).eps) * size \
            if end.is_floating_point() else 0 * size
        if name in allowances:
            unit, decay = allowances[name]
            return ROUNDING * lr_sum * (unit + decay * size) + rounding
        if name.endswith(BIAS_BUFFER):
            return ROUNDING * steps * bias_rate + rounding
        return rounding  # a buffer training leaves alone

    return allowed


def movement(start: dict, end: dict, allowed) -> tuple[float, str | None]:
    """max over every weight of |end - start| / allowed, and the tensor it is reached in."""
    worst, where = 0.0, None
    for name in end:
        moved = (end[name].double() - start[name].double()).abs()
        limit = allowed(name, start[name], end[name])
        if not moved.numel():
            continue
        over = math.inf if bool(((moved > 0) & (limit <= 0)).any()) else float((moved / limit.clamp(min=1e-300)).max())
        if over > worst:
            worst, where = over, name
    return worst, where


def next_step_loss(trainer, micro_batches: list) -> float | None:
    """The model's training loss on one step's micro-batches (as `train_step` logs it: the mean
    over micro-batches and data-parallel ranks), without a gradient; the routers' counts of it
    are dropped."""
    import torch

    from onenode.parallel.distributed import mean_over_ranks

    model = trainer.parallel.model
    with torch.no_grad():
        losses = [model(ids.to(trainer.device), labels=labels.to(trainer.device)).loss for ids, labels in micro_batches]
    trainer.balancer.finish_step(0.0)
    return mean_over_ranks(float(torch.stack(losses).mean()), trainer.device)


def verify(plan: dict, report: dict) -> None:
    import torch

    import onenode
    from onenode.train.checkpoint import full_model_state_dict, load_weights, weights_sha256
    from onenode.train.recipe import load_recipe
    from onenode.train.schedule import lr_factor
    from onenode.train.trainer import Trainer

    run = Path(plan["run"])
    checkpoints = [run / "checkpoints" / name for name in plan["checkpoints"]]
    metas = [json.loads((path / "meta.json").read_text()) for path in checkpoints]
    steps = [meta["step"] for meta in metas]

    def threads_of(meta: dict) -> int:  # CPU threads decide the bits too: the run's own, unless the plan says
        return int(plan["threads"] or meta["layout"]["threads"])

    torch.set_num_threads(threads_of(metas[0]))
    overrides = {"log.tensorboard": False, "log.progress_bar": False}
    if plan["data"]:
        overrides.update({"data.source": "shards", "data.path": plan["data"]})
    recipe = load_recipe(run / "recipe.yaml", overrides)

    trainer = Trainer(recipe, Path("replay-init"), resume=None)
    report["init_sha256"] = trainer.weights_sha256()
    model, allowances = trainer.parallel.model, step_allowances(trainer)
    lrs = [recipe.optimizer.lr * lr_factor(recipe.schedule, t, trainer.total_steps) for t in range(steps[-1])]
    positions, report["checkpoints"], previous, done = {}, [], None, 0
    for path, step in zip(checkpoints, steps):
        for _ in range((step - done) * trainer.accumulation):  # the grader's batches, read to here
            next(trainer.loader)
        done = step
        positions[step] = trainer.loader.state_dict()
        load_weights(path, model)
        state = {k: v.clone() for k, v in full_model_state_dict(model).items()}
        stored = torch.load(path / f"trainer_state_rank{trainer.rank}.pt", weights_only=True)
        differences = gathered(loader_difference(stored["loader"], positions[step]))
        if report["checkpoints"]:  # the loss this checkpoint's state records for the step after the one before
            losses = stored.get("losses")
            claimed = losses[previous[0]] if isinstance(losses, list) and len(losses) > previous[0] else None
            report["checkpoints"][-1]["stored_next_loss"] = claimed if isinstance(claimed, float) else None
        entry = {"name": path.name, "weights_sha256": weights_sha256(state) if trainer.rank == 0 else None,
                 "loader": "; ".join(f"rank {r}: {d}" for r, d in enumerate(differences) if d) or None,
                 "movement": None, "movement_at": None, "next_loss": None, "stored_next_loss": None}
        if previous is not None and trainer.rank == 0:
            span_lrs = lrs[previous[0]:step]
            entry["movement"], entry["movement_at"] = movement(
                previous[1], state, movement_allowance(allowances, span_lrs, recipe.moe.bias_update_rate))
        if step < steps[-1]:
            entry["next_loss"] = next_step_loss(trainer, [next(trainer.loader) for _ in range(trainer.accumulation)])
            done += 1
        report["checkpoints"].append(entry)
        previous = (step, state)
    final = onenode.load_pretrained(plan["final"])
    report["final_sha256"] = weights_sha256(full_model_state_dict(final))
    del trainer, final, previous  # the spans build their own

    recomputed = [c["weights_sha256"] for c in report["checkpoints"]]
    report["spans"] = []
    for i, j in plan["spans"]:
        entry = {"start": checkpoints[i].name, "end": checkpoints[j].name, "steps": steps[j] - steps[i],
                 "seconds": 0.0, "bitwise": False, "relative_error": None}
        try:
            torch.set_num_threads(threads_of(metas[i]))
            span = Trainer(recipe, Path(f"replay-{i}"), resume=str(checkpoints[i]))
            span.loader.load_state_dict(positions[steps[i]])  # the grader's batches, not the stored position
            span.step, span.tokens_seen = steps[i], steps[i] * recipe.tokens_per_step
            replay_span(span, checkpoints[i], checkpoints[j], recomputed[j], entry)
        except Exception as e:  # this span cannot be replayed (its checkpoint holds another optimizer, say)
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
