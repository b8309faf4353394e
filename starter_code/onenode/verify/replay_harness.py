"""The replay harness: runs as a child process, on the grader's pristine A2 stack inside the
sandbox (`grader/a2/replay.py`), or on a student's own install for `onenode verify`
(`replay.replay_here`).

Self-contained on purpose: it imports nothing from `grader`, only the `onenode` of the install
it runs from (the grader's: the starter with the reference A1 patch, so what it computes does not
depend on the submission's code). The submission's files are input, read through the trainer's
safe loader (no pickle runs code). Under torchrun every rank reads its own batches; rank 0 writes
the report.

    python -m onenode.verify.replay_harness plan.json        # writes replay.json beside it

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
                                                   trainer state records it,
                               "optimizer_sha256": the optimizer state it stores (null but
                                                   where a replayed span ends),
                               "optimizer": null, or what no training of the recipe gives in
                                            that state (`optimizer_state_problem`)}],
              "spans": [{"start", "end", "steps", "seconds", "bitwise", "relative_error",
                         "optimizer_bitwise", "optimizer_relative_error",
                         "error": only when the span could not be replayed}],
              "error": one line, only when the harness could not finish}

The data is the grader's: one fresh loader on the submitted shards (or the recipe's synthetic
tokens) is stepped through the run; its batches give each checkpoint's `next_loss`, and its
positions are where each replayed span starts reading. The loader state a checkpoint stores is
only compared (`loader`), never used; so is the copy of rank 0's in its meta.json, by which the
audit finds the shards it hashes and scans (`audit.trained_shards`): it must be the trainer state's.

`movement` is max over every weight of |end - start| / allowed, where allowed is the most any
training of the span at the schedule's learning rates could move it (`movement_allowance`):
above 1, no training at those rates made that checkpoint from the one before.

Hashes are `onenode.train.checkpoint.weights_sha256` of the whole model. A span that does not
come back bit for bit reports ||replayed - recorded|| / ||recorded - start||: how far the
replay lands from the recorded checkpoint, relative to how far the span moved the weights.

A span starts from the optimizer state its first checkpoint stores (AdamW's moments and step
counters, Muon's momentum, every group's settings), so that state is input to judge too: every
checkpoint's must be what some training of the recipe makes (`optimizer_state_problem`), and a
replayed span must give the state its last checkpoint stores back (hashed the same way, or per
kind of tensor as the weights are), else a stored state could steer the span after it while
every replay of it is bit for bit.
"""

from __future__ import annotations

import copy
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


def _as_json(value):
    """`value` as a JSON file holds it (tuples as lists, keys as strings): how meta.json's loader
    state compares with the trainer state's."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def relative_error(replayed: dict, recorded: dict, start: dict) -> float:
    """||replayed - recorded|| / ||recorded - start|| over every tensor, in float64."""
    off = sum(float((replayed[k].double() - recorded[k].double()).norm()) ** 2 for k in recorded)
    moved = sum(float((recorded[k].double() - start[k].double()).norm()) ** 2 for k in recorded)
    return (off / moved) ** 0.5 if moved > 0 else (0.0 if off == 0 else float("inf"))


def optimizer_error(replayed: dict, recorded: dict, start: dict) -> float:
    """`relative_error` of the optimizer state's tensors, each kind ("exp_avg", "exp_avg_sq",
    "momentum_buffer") on its own scale, the largest; a step counter that differs: infinite."""
    import torch

    errors = []
    for kind in sorted({name.rsplit(":", 1)[1] for name in recorded}):
        names = [name for name in recorded if name.rsplit(":", 1)[1] == kind]
        if kind == "step":
            errors.append(0.0 if all(torch.equal(replayed[n], recorded[n]) for n in names) else math.inf)
        else:
            errors.append(relative_error(*({n: d[n] for n in names} for d in (replayed, recorded, start))))
    return max(errors, default=0.0)


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


def plain_name(name: str) -> str:
    """A parameter's name as the model's state dict spells it (without compile or checkpoint wrappers)."""
    return ".".join(part for part in name.split(".") if part not in ("_orig_mod", "_checkpoint_wrapped_module",
                                                                       "_fsdp_wrapped_module"))


def step_allowances(trainer) -> dict[str, tuple[float, float]]:
    """For every trained weight, (the most one step moves it per unit of learning rate, its
    weight decay), from the grader's own optimizer of the recipe."""
    from onenode.train.optim import Muon, muon_lr_scale, optimizers_of

    names = {id(param): plain_name(name) for name, param in trainer.parallel.model.named_parameters()}
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


MOMENT_ROUNDING = 1.001  # slack on the optimizer state's bounds: float32 rounding of the moments and the clip


def moment_rounding(moments: str) -> float:
    """The slack on the bounds for the recipe's `optimizer.moments`: a float dtype narrower than
    float32 rounds each moment once a step, by up to half its machine epsilon; its epsilon on top of
    `MOMENT_ROUNDING` covers that with room. int8 needs none on what it is checked by: it rounds
    exp_avg toward zero and exp_avg_sq up (`master_update._encode`), which keeps |exp_avg| <= ratio x
    sqrt(exp_avg_sq) and ||exp_avg|| within the clip's bound (see `int8_moments` for its sum)."""
    import torch

    from onenode.train.optim import MOMENTS

    dtype = MOMENTS.get(moments)
    return MOMENT_ROUNDING if dtype is None or not dtype.is_floating_point else MOMENT_ROUNDING + torch.finfo(dtype).eps


def int8_moments(name: str, tensors: dict) -> tuple[dict, str | None]:
    """An int8 state's moments as the step reads them (codes times their blocks' scales, float64),
    or why the codes are not 8-bit codes (shapes are the fresh state's, checked before). Its
    exp_avg_sq has no sum bound: each step rounds it up by up to a code, which compounds over the
    steps past any fixed slack, and a larger exp_avg_sq only makes steps smaller (each step stays
    within the ratio bound, which holds exactly)."""
    from onenode.train.master_update import int8_values

    for key in ("exp_avg", "exp_avg_sq"):
        codes, scale = tensors[key], tensors[f"{key}_scale"]
        if not bool(((codes == codes.round()) & (codes >= 0) & (codes <= 255)).all()) or bool((scale < 0).any()):
            return tensors, f"{name}'s {key} is not 8-bit codes (whole numbers 0..255) with scales >= 0"
    return {"exp_avg": int8_values(tensors["exp_avg"], tensors["exp_avg_scale"], signed=True),
            "exp_avg_sq": int8_values(tensors["exp_avg_sq"], tensors["exp_avg_sq_scale"], signed=False)}, None


# |exp_avg| allowed where exp_avg_sq rounded to zero: the square of a gradient under ~1e-22 underflows float32
MOMENT_FLOOR = 1e-20


def optimizer_state(trainer) -> dict:
    """The optimizer state as a checkpoint stores it, unsharded, on CPU (collective; complete on
    rank 0): {"state": {parameter: {"step", "exp_avg", "exp_avg_sq"} or {"momentum_buffer"}},
    "param_groups": [every group's settings and parameter names]}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from onenode.train.optim import optimizers_of

    return get_optimizer_state_dict(trainer.parallel.model, optimizers_of(trainer.optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def state_tensors(state: dict) -> dict:
    """The optimizer state's tensors by "<parameter>:<key>" (what its hash and the replay's
    comparison read; on a CPU the optimizer's own, which the next load overwrites)."""
    return {f"{name}:{key}": value for name, entry in state.get("state", {}).items()
            for key, value in entry.items() if hasattr(value, "clone")}


def adam_moment_ratio(beta1: float, beta2: float, steps: int) -> float:
    """The most |exp_avg| / sqrt(exp_avg_sq) can be, elementwise, after `steps` steps of any
    gradients g_j: by Cauchy-Schwarz, |(1 - b1) sum b1^(t-j) g_j| <= (1 - b1) / sqrt(1 - b2) x
    sqrt(sum_j (b1^2 / b2)^(t-j)) x sqrt((1 - b2) sum b2^(t-j) g_j^2)."""
    ratio = beta1 ** 2 / beta2
    total = steps if ratio == 1 else (1 - ratio ** steps) / (1 - ratio)
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(total)


def optimizer_state_problem(stored: dict, fresh: dict, steps: int, grad_clip: float,
                            moments: str = "float32") -> str | None:
    """What no training of the recipe puts in the optimizer state a checkpoint of step `steps`
    stores, in one line, or None. `fresh` is the recipe's optimizer before its first step, as the
    step-0 checkpoint stores it (DCP gives each parameter its state with one step of zero
    gradients at lr 0: counters 1, moments 0). What must hold:
    - every group's settings are the recipe's (a replay runs on the settings it loads), the lr
      aside (the schedule sets it each step);
    - every step counter is the fresh one plus `steps`;
    - each moment is finite, exp_avg_sq >= 0, and |exp_avg| <= `adam_moment_ratio` x
      sqrt(exp_avg_sq) elementwise, whatever the clip (so every step stays within the movement
      bound's `adamw_step_bound`);
    - with every step's gradient clipped to global L2 norm c (`train.grad_clip`), over the
      parameters of one beta: ||exp_avg||_2 = ||(1 - b1) sum_j b1^(t-j) g_j|| <= c (1 - b1^t),
      sum(exp_avg_sq) = (1 - b2) sum_j b2^(t-j) ||g_j||^2 <= c^2 (1 - b2^t) (not over int8 codes:
      `int8_moments`), and Muon's
      ||momentum_buffer||_2 <= c (1 - momentum^t), for t = `steps` (a run without a clip, c = 0,
      has no bound on these norms).
    Each within `moment_rounding(moments)`, the recipe's `optimizer.moments`."""
    ours, theirs = fresh["param_groups"], stored.get("param_groups", [])
    if len(theirs) != len(ours):
        return f"{len(theirs)} optimizer parameter groups where the recipe's optimizer has {len(ours)}"
    settings = {}
    for group, claimed in zip(ours, theirs):
        if claimed.get("params") != group["params"]:
            return "its optimizer groups hold other parameters than the recipe's optimizer does"
        for key, value in group.items():
            if key not in ("params", "lr") and claimed.get(key) != value:
                return f"optimizer setting {key} {claimed.get(key)!r} where the recipe's optimizer has {value!r}"
        settings.update(dict.fromkeys(group["params"], group))
    momentum_sq, squares, averages = {}, {}, {}  # beta -> summed over its parameters
    rounding = moment_rounding(moments)
    for name, start in fresh["state"].items():
        state, group = stored["state"].get(name, {}), settings[name]
        if set(state) != set(start):
            return f"{name}'s optimizer state holds {sorted(state)} where the recipe's optimizer holds {sorted(start)}"
        counter, first = (float(state["step"]), float(start["step"])) if "step" in start else (None, None)
        if counter is not None and counter != first + steps:
            return (f"{name}'s optimizer step counter is {counter:g}, not {first + steps:g} (the step-0 state's "
                    f"{first:g} plus its {steps} steps)")
        tensors = {key: value.double() for key, value in state.items() if key != "step"}
        if not all(bool(value.isfinite().all()) for value in tensors.values()):
            return f"{name}'s optimizer state is not finite"
        for key, value in tensors.items():
            if value.shape != start[key].shape:
                return f"{name}'s {key} has shape {tuple(value.shape)}, not {tuple(start[key].shape)}"
        if moments == "int8" and "exp_avg_scale" in start:  # 8-bit codes: only for a recipe that stores them
            tensors, problem = int8_moments(name, tensors)
            if problem:
                return problem
        if "momentum_buffer" in tensors:
            beta = group["momentum"]
            momentum_sq[beta] = momentum_sq.get(beta, 0.0) + float(tensors["momentum_buffer"].square().sum())
        if "exp_avg" in tensors:
            (beta1, beta2), m, v = group["betas"], tensors["exp_avg"], tensors["exp_avg_sq"]
            if bool((v < 0).any()):
                return f"{name}'s exp_avg_sq is negative"
            ratio = adam_moment_ratio(beta1, beta2, steps)
            over = m.abs() - (rounding * ratio * v.sqrt() + MOMENT_FLOOR)
            if bool((over > 0).any()):
                i = int(over.argmax())
                return (f"{name}'s exp_avg {float(m.flatten()[i]):.3g} against exp_avg_sq {float(v.flatten()[i]):.3g}: "
                        f"{steps} steps of any gradients give |exp_avg| <= {ratio:.3g} x sqrt(exp_avg_sq)")
            averages[beta1] = averages.get(beta1, 0.0) + float(m.square().sum())
            if not (moments == "int8" and "exp_avg_scale" in start):
                squares[beta2] = squares.get(beta2, 0.0) + float(v.sum())
    if not grad_clip or grad_clip <= 0:
        return None
    norms = [("||exp_avg||", beta, math.sqrt(total), grad_clip * (1 - beta ** steps))
             for beta, total in averages.items()]
    norms += [("sum(exp_avg_sq)", beta, total, grad_clip ** 2 * (1 - beta ** steps))
              for beta, total in squares.items()]
    norms += [("||momentum_buffer||", beta, math.sqrt(total), grad_clip * (1 - beta ** steps))
              for beta, total in momentum_sq.items()]
    for what, beta, found, bound in norms:
        if found > rounding * bound:
            return (f"{what} {found:.4g} over its parameters (beta {beta:g}); {steps} steps of gradients clipped to "
                    f"global norm {grad_clip:g} give at most {bound:.4g}")
    return None


def resumed_state_problem(stored: dict, step: int, tokens_per_step: int) -> str | None:
    """What of the trainer state a span resumes from disagrees with the chain's step, or None. A
    replay takes its step and token count from the chain, never from a student's file (the step
    picks the learning rate's place in the schedule); the stored ones, and the count of losses
    recorded up to it, must be the chain's all the same, or the files describe another run."""
    off = [] if stored.get("step") == step else [f"step {stored.get('step')!r}"]
    if stored.get("tokens_seen") != step * tokens_per_step:
        off.append(f"{stored.get('tokens_seen')!r} tokens seen")
    losses = stored.get("losses")
    if not isinstance(losses, list) or len(losses) != step:
        off.append(f"{len(losses) if isinstance(losses, list) else 'no'} recorded losses")
    return f"its trainer state says {' and '.join(off)} at the chain's step {step}" if off else None


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


def threads_of(plan: dict, meta: dict) -> int:
    """The CPU threads a span starting at a checkpoint with `meta` runs on (they decide the bits
    too): the run's own, unless the plan says."""
    return int(plan["threads"] or meta["layout"]["threads"])


def plain_movement(allowances: dict, lrs: list[float], bias_rate: float):
    """judge(step, state, stored) for `examine_chain`: each span's `movement` against what any
    training at the schedule's learning rates `lrs` (one a step) can move the weights."""
    previous = None

    def judge(step: int, state: dict, stored: dict) -> dict:
        nonlocal previous
        found = {}
        if previous is not None:
            found["movement"], found["movement_at"] = movement(
                previous[1], state, movement_allowance(allowances, lrs[previous[0]:step], bias_rate))
        previous = (step, state)
        return found

    return judge


def examine_chain(trainer, checkpoints: list[Path], metas: list[dict], span_ends: set[int], judge=None,
                  tokens_per_step: int | None = None) -> tuple[list[dict], dict]:
    """The per-checkpoint entries of replay.json for one chain, read with `trainer` (fresh: its
    loader at the start of its data): each checkpoint loaded, its weights hashed, its stored data
    position compared with the grader's, its optimizer state judged, its loss on the grader's
    batch of the next step; `judge(step, weights, trainer state)` (rank 0) adds to an entry what
    the run's kind decides (the span's movement; an "optimizer" problem of its own);
    `tokens_per_step`: the run's, where the trainer's is one replica group's share. And the
    grader's data position at each checkpoint's step, where a replayed span starts reading."""
    from onenode.train.checkpoint import full_model_state_dict, load_checkpoint, weights_sha256

    model = trainer.parallel.model
    fresh = copy.deepcopy(optimizer_state(trainer))  # what the step-0 checkpoint must store
    recipe, steps = trainer.recipe, [meta["step"] for meta in metas]
    per_step = tokens_per_step or recipe.tokens_per_step
    entries, positions, previous_step, done = [], {}, None, 0
    for index, (path, step) in enumerate(zip(checkpoints, steps)):
        for _ in range((step - done) * trainer.accumulation):  # the grader's batches, read to here
            next(trainer.loader)
        done = step
        position = positions[step] = trainer.loader.state_dict()
        _, stored = load_checkpoint(path, trainer.parallel, trainer.optimizer)  # the weights and optimizer state
        state = {k: v.clone() for k, v in full_model_state_dict(model).items()}
        optimizer = optimizer_state(trainer)
        differences = gathered(loader_difference(stored["loader"], position))
        if trainer.rank == 0 and _as_json(metas[index].get("loader")) != _as_json(stored["loader"]):
            meta_loader = "meta.json names another loader state than the checkpoint's trainer state"
            differences[0] = "; ".join(filter(None, [differences[0], meta_loader]))
        if entries:  # the loss this checkpoint's state records for the step after the one before
            losses = stored.get("losses")
            claimed = losses[previous_step] if isinstance(losses, list) and len(losses) > previous_step else None
            entries[-1]["stored_next_loss"] = claimed if isinstance(claimed, float) else None
        entry = {"name": path.name, "weights_sha256": weights_sha256(state) if trainer.rank == 0 else None,
                 "loader": "; ".join(f"rank {r}: {d}" for r, d in enumerate(differences) if d) or None,
                 "movement": None, "movement_at": None, "next_loss": None, "stored_next_loss": None,
                 "optimizer_sha256": weights_sha256(state_tensors(optimizer))
                 if trainer.rank == 0 and index in span_ends else None,
                 "optimizer": optimizer_state_problem(optimizer, fresh, step, recipe.train.grad_clip,
                                                      recipe.optimizer.moments)
                 if trainer.rank == 0 else None}
        if trainer.rank == 0:  # a problem once found stays: a later verdict adds, never clears
            problems = [entry["optimizer"], resumed_state_problem(stored, step, per_step)]
            if judge is not None:
                found = judge(step, state, stored)
                problems.append(found.pop("optimizer", None))
                entry.update(found)
            entry["optimizer"] = "; ".join(filter(None, problems)) or None
        if step < steps[-1]:
            entry["next_loss"] = next_step_loss(trainer, [next(trainer.loader) for _ in range(trainer.accumulation)])
            done += 1
        entries.append(entry)
        previous_step = step
    return entries, positions


def verify(plan: dict, report: dict) -> None:
    import torch

    import onenode
    from onenode.train.checkpoint import full_model_state_dict, weights_sha256
    from onenode.train.recipe import load_recipe
    from onenode.train.schedule import lr_factor
    from onenode.train.trainer import Trainer

    run = Path(plan["run"])
    checkpoints = [run / "checkpoints" / name for name in plan["checkpoints"]]
    metas = [json.loads((path / "meta.json").read_text()) for path in checkpoints]
    steps = [meta["step"] for meta in metas]
    torch.set_num_threads(threads_of(plan, metas[0]))
    overrides = {"log.tensorboard": False, "log.progress_bar": False}
    if plan["data"]:
        overrides.update({"data.source": "shards", "data.path": plan["data"]})
    recipe = load_recipe(run / "recipe.yaml", overrides)
    if recipe.parallel.diloco.inner_steps:
        raise ValueError("the recipe trains DiLoCo: its replay is onenode.verify.diloco_replay's")

    trainer = Trainer(recipe, Path("replay-init"), resume=None)
    report["init_sha256"] = trainer.weights_sha256()
    lrs = [recipe.optimizer.lr * lr_factor(recipe.schedule, t, trainer.total_steps) for t in range(steps[-1])]
    span_ends = {j for _, j in plan["spans"]}  # whose optimizer state a replay compares with its own
    report["checkpoints"], positions = examine_chain(trainer, checkpoints, metas, span_ends,
                                          plain_movement(step_allowances(trainer), lrs, recipe.moe.bias_update_rate))
    final = onenode.load_pretrained(plan["final"])
    report["final_sha256"] = weights_sha256(full_model_state_dict(final))
    del trainer, final  # the spans build their own

    recomputed = [c["weights_sha256"] for c in report["checkpoints"]]
    moments = [c["optimizer_sha256"] for c in report["checkpoints"]]
    report["spans"] = []
    for i, j in plan["spans"]:
        entry = {"start": checkpoints[i].name, "end": checkpoints[j].name, "steps": steps[j] - steps[i],
                 "seconds": 0.0, "bitwise": False, "relative_error": None, "optimizer_bitwise": False,
                 "optimizer_relative_error": None}
        try:
            torch.set_num_threads(threads_of(plan, metas[i]))
            span = Trainer(recipe, Path(f"replay-{i}"), resume=str(checkpoints[i]))
            span.take_kernel_tiles(metas[j], checkpoints[j])  # the tiles the run's kernels used in the span
            span.loader.load_state_dict(positions[steps[i]])  # the grader's batches, not the stored position
            span.step, span.tokens_seen = steps[i], steps[i] * recipe.tokens_per_step
            replay_span(span, checkpoints[i], checkpoints[j], recomputed[j], moments[j], entry)
        except Exception as e:  # this span cannot be replayed (its checkpoint holds another optimizer, say)
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        report["spans"].append(entry)


def replay_span(trainer, start: Path, end: Path, end_sha256: str, end_optimizer_sha256: str, entry: dict) -> None:
    """Train `trainer` (resumed from `start`) `entry["steps"]` steps and compare its weights and
    its optimizer state with `end`'s."""
    from onenode.train.checkpoint import full_model_state_dict, load_checkpoint, weights_sha256

    began = time.perf_counter()
    for _ in range(entry["steps"]):
        trainer.train_step()
    entry["seconds"] = time.perf_counter() - began
    model = trainer.parallel.model

    def now() -> tuple[dict, dict]:  # (the weights, the optimizer state's tensors), copied
        return ({k: v.clone() for k, v in full_model_state_dict(model).items()},
                {k: v.clone() for k, v in state_tensors(optimizer_state(trainer)).items()})

    replayed, moments = now()
    entry["bitwise"] = gathered(trainer.rank == 0 and weights_sha256(replayed) == end_sha256)[0]
    entry["optimizer_bitwise"] = gathered(trainer.rank == 0 and weights_sha256(moments) == end_optimizer_sha256)[0]
    entry["relative_error"] = entry["optimizer_relative_error"] = 0.0
    if not (entry["bitwise"] and entry["optimizer_bitwise"]):
        load_checkpoint(end, trainer.parallel, trainer.optimizer)
        recorded, recorded_moments = now()
        load_checkpoint(start, trainer.parallel, trainer.optimizer)
        began_at, start_moments = now()
        if trainer.rank == 0:
            entry["relative_error"] = relative_error(replayed, recorded, began_at)
            entry["optimizer_relative_error"] = optimizer_error(moments, recorded_moments, start_moments)


def main(plan_file: str, verify_plan=verify) -> int:
    """Run `verify_plan` (this module's, or a DiLoCo run's `diloco_replay.verify_groups`) on the
    plan at `plan_file`; its report goes beside it as replay.json, with "error" if it failed."""
    plan_path = Path(plan_file)
    report: dict = {}
    try:
        verify_plan(json.loads(plan_path.read_text()), report)
    except Exception as e:  # the report says why; the parent fails the run with it
        report["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        traceback.print_exc()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        (plan_path.parent / "replay.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
