"""Scoring A1: the three parts and the notebook, from a submission's runs against the job's
reference (`job.py`).

Each submission runs the same sessions as the starter on its patched tree; what comes back is
compared here, in the grader (`compare.py`).

Scoring rule for every part: a wrong answer zeroes the part; a correct answer earns the part's
correctness points only once its slow path is fixed (the unchanged starter is correct but slow),
plus the speed or feature points that the measurement reaches.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..assignment import Graded
from ..errors import GraderError
from ..runner import Session, SessionResult, run_sessions
from ..submission import Submission, load_submission, patched_tree
from .compare import loss_error, moe_error, relative_error
from .job import A1Job
from .rubric import A1Profile, Part


# -- the grading steps ---------------------------------------------------------------------------
@dataclass
class Context:
    """What a grading step sees: the job, the submission, its patched tree, where logs go."""

    job: A1Job
    submission: Submission
    runs: dict[str, SessionResult]
    logs: Path
    tests: list[dict] = field(default_factory=list)
    leaderboard: list[dict] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)

    @property
    def failures(self) -> dict[str, str]:
        """Session -> its error and the end of its log, for the feedback."""
        return {name: f"{run.error}\n\n{run.log_tail}".strip() for name, run in self.runs.items() if not run.ok}


def _not_on_profile(ctx: Context, part: Part, layout: str) -> None:
    note = f"not graded on profile {ctx.job.profile.name} (it has no {layout} layout)"
    ctx.tests += [dict(t, max_score=0, status="passed") for t in part.tests(0, 0, note, note)]


def grade_moe(ctx: Context) -> None:
    """Part 1: the MoE layer alone, on the starter's weights, against the starter's digests."""
    job, part = ctx.job, ctx.job.rubric.parts["moe"]
    ref, run = job.reference, ctx.runs["moe"]
    if not run.ok:
        reason = f"the MoE run failed: {run.error}"
        ctx.tests += part.tests(0, 0, reason, reason)
        return
    error = max(moe_error(r, s) for r, s in zip(ref.moe.digests, run.digests))
    warmup = job.profile.moe["warmup"]
    starter_s, yours_s = _median_timed(ctx.runs["moe-starter"], warmup), _median_timed(run, warmup)
    speedup = starter_s / yours_s
    share = job.profile.speed_share(speedup)
    correct = error <= job.profile.rtol
    ctx.numbers["moe_speedup"] = speedup
    ctx.leaderboard.append({"name": "Part 1: MoE speedup", "value": round(speedup, 2)})
    checked = (f"outputs and gradients on {len(run.digests)} grader-chosen inputs: worst relative error "
               f"{error:.2g} (tolerance {job.profile.rtol:g})")
    timing = (f"median of {len(run.seconds) - warmup} timed workloads of {job.profile.moe.get('iters', 1)} "
              f"forward+backward passes, in turns with the starter: starter {starter_s * 1e3:.2f} ms, "
              f"yours {yours_s * 1e3:.2f} ms, speedup {speedup:.2f}x (tiers: "
              + ", ".join(f"{t:g}x -> {v:.0%}" for t, v in job.profile.speedup_tiers) + ")")
    if not correct:
        reason = f"wrong: {checked}; the part earns nothing until it matches"
        ctx.tests += part.tests(0, 0, reason, f"{timing}; zeroed: the timed steps gave wrong results")
    elif share == 0:
        ctx.tests += part.tests(0, 0, f"matches, but the MoE is not faster yet: {checked}", timing)
    else:
        ctx.tests += part.tests(part.correctness, part.performance * share, f"matches: {checked}", timing)


def _step_numbers(ctx: Context, run: SessionResult, starter: SessionResult | None, layout_name: str) -> str:
    """Tokens/s of the whole step (and MFU on GPU) for the leaderboard; a line for feedback."""
    profile = ctx.job.profile
    tokens = profile.batch * profile.seq_len
    seconds = _median_timed(run, profile.warmup)
    tokens_per_s = tokens / seconds
    ctx.numbers[f"{layout_name}_tokens_per_s"] = tokens_per_s
    ctx.leaderboard.append({"name": f"Step tokens/s ({layout_name} layout)", "value": round(tokens_per_s, 1)})
    line = f"whole step, {layout_name} layout: {tokens_per_s:,.0f} tokens/s"
    if starter is not None:
        ratio = _median_timed(starter, profile.warmup) / seconds
        ctx.numbers[f"{layout_name}_step_speedup"] = ratio
        ctx.leaderboard.append({"name": f"Step speedup vs starter ({layout_name})", "value": round(ratio, 2)})
        line += f" ({ratio:.2f}x the starter)"
    mfu = model_flops_utilization(profile, tokens_per_s, profile.layouts[layout_name]["world"])
    if mfu is not None:
        ctx.numbers[f"{layout_name}_mfu"] = mfu
        ctx.leaderboard.append({"name": f"MFU % ({layout_name} layout)", "value": round(100 * mfu, 2)})
        line += f", MFU {100 * mfu:.2f}% of dense bf16 peak"
    return line


def grade_ep(ctx: Context) -> None:
    """Part 2: the ep layout trains like the reference and stops all-gathering the experts."""
    job, part, profile = ctx.job, ctx.job.rubric.parts["ep"], ctx.job.profile
    if "ep" not in profile.layouts:
        return _not_on_profile(ctx, part, "ep")
    ref, run = job.reference, ctx.runs["ep"]
    if not run.ok:
        reason = f"the ep={profile.layouts['ep']['ep']} run failed: {run.error}"
        ctx.tests += part.tests(0, 0, reason, reason)
        return
    error = loss_error(ref.train.digests, run.digests)
    correct = error <= profile.rtol
    expert_share = expert_parameter_share(profile)
    starter_ag = statistics.median(d["bytes"].get("all_gather", 0) for d in ref.ep.digests)
    yours_ag = statistics.median(_bytes(d, "all_gather") for d in run.digests)
    # The starter gathers every parameter alike, so its non-expert share of gathers is what a
    # fixed EP still needs; whatever exceeds it is expert weights being gathered.
    expert_ag = max(0.0, yours_ag - starter_ag * (1 - expert_share))
    expert_ratio = expert_ag / (starter_ag * expert_share)
    held = run.info.get("param_bytes") if isinstance(run.info, dict) else None
    held_ratio = relative_error(held, 0, ref.ep.info["param_bytes"])  # inf if the child sent no number
    fixed = expert_ratio <= profile.max_expert_allgather and held_ratio <= 1.25
    ctx.numbers.update(expert_allgather_ratio=expert_ratio, allgather_mb_per_step=yours_ag / 2**20)
    checked = (f"loss and gradient norm over {len(run.digests)} optimizer steps vs the reference layout: "
               f"worst relative error {error:.2g} (tolerance {profile.rtol:g})")
    feature = (f"all-gathered per step and rank: starter {starter_ag / 2**20:.2f} MiB, "
               f"yours {yours_ag / 2**20:.2f} MiB; expert weights are {expert_share:.0%} of the model, "
               f"so about {expert_ratio:.0%} of the starter's expert all-gathers remain "
               f"(at most {profile.max_expert_allgather:.0%} passes); parameters held per rank: {held_ratio:.2f}x "
               f"the starter's; {_step_numbers(ctx, run, ref.ep, 'ep')}")
    if not correct:
        ctx.tests += part.tests(0, 0, f"wrong: {checked}", f"zeroed (wrong losses): {feature}")
    elif not fixed:
        ctx.tests += part.tests(0, 0, f"matches, but the experts are still all-gathered: {checked}", feature)
    else:
        ctx.tests += part.tests(part.correctness, part.performance, f"matches: {checked}", feature)


def grade_pp(ctx: Context) -> None:
    """Part 3: the pp layout builds, trains, and gives the reference losses."""
    job, part, profile = ctx.job, ctx.job.rubric.parts["pp"], ctx.job.profile
    if "pp" not in profile.layouts:
        return _not_on_profile(ctx, part, "pp")
    ref, run = job.reference, ctx.runs["pp"]
    pp = profile.layouts["pp"]["pp"]
    if not run.ok:
        reason = f"pp={pp} does not train: {run.error}"
        ctx.tests += part.tests(0, 0, reason, reason)
        return
    error = loss_error(ref.train.digests, run.digests)
    checked = (f"loss and gradient norm over {len(run.digests)} optimizer steps vs the reference layout: "
               f"worst relative error {error:.2g} (tolerance {profile.rtol:g})")
    feature = f"pp={pp} builds and trains; {_step_numbers(ctx, run, None, 'pp')}"
    if error > profile.rtol:
        ctx.tests += part.tests(0, 0, f"wrong: {checked}", f"zeroed (wrong losses): {feature}")
    else:
        ctx.tests += part.tests(part.correctness, part.performance, f"matches: {checked}", feature)


def grade_notebook(ctx: Context) -> None:
    """The report notebook, autograded under nbgrader by `grader/notebook.py`."""
    from .. import notebook

    ctx.tests += notebook.grade(ctx.submission.notebook, ctx.logs)


# The grading steps, in order; each adds tests (and numbers) to the context.
STEPS = [grade_moe, grade_ep, grade_pp, grade_notebook]


def _median_timed(run: SessionResult, warmup: int) -> float:
    return statistics.median(run.seconds[warmup:])


def _bytes(digest: dict, family: str) -> float:
    try:
        return float(digest["bytes"].get(family, 0))
    except (KeyError, TypeError, AttributeError, ValueError):
        return math.inf


# -- figures from the PRISTINE kit (never the submission's) ------------------------------------
def _profile_config(profile: A1Profile):
    from onenode.model import get_preset

    return get_preset(profile.preset, **profile.overrides)


def expert_parameter_share(profile: A1Profile) -> float:
    """Routed-expert parameters over all parameters of the profile's model."""
    from onenode.model import count_parameters

    config = _profile_config(profile)
    per_layer = config.n_routed_experts * 2 * config.hidden_size * config.moe_intermediate_size
    experts = config.layer_kinds.count("moe") * per_layer
    return experts / count_parameters(config)[0]


def model_flops_utilization(profile: A1Profile, tokens_per_s: float, n_gpus: int) -> float | None:
    """MFU against the dense bf16 peak of H100/H200, from the kit's FLOP model; None on CPU."""
    if profile.device != "cuda":
        return None
    from onenode.flops import mfu, model_flops

    report = model_flops(_profile_config(profile), profile.seq_len, 1)
    return mfu(tokens_per_s, report.matmul_flops_per_token, n_gpus=n_gpus)


def grade(job: A1Job, path: Path, work: Path, logs: Path) -> Graded:
    """Intake, the patched tree in `work`, the submission's sessions, then every grading step."""
    submission = load_submission(path, work)
    tree = patched_tree(submission, work / "tree")
    ref = job.reference
    starter_moe = Session("moe", job.spec("moe", weights_in="moe.pt"), job.moe_seeds)
    runs = run_sessions(job.harness, tree, job.profile, job.world(), job.sessions(), logs,
                        files_in={"moe.pt": ref.moe_weights, "model.pt": ref.model_weights},
                        baselines={"moe": (ref.tree, starter_moe)})
    starter = runs.get("moe-starter")
    if runs["moe"].ok and (starter is None or not starter.ok):
        why = starter.error if starter else "it did not start"
        raise GraderError(f"the unpatched starter's MoE failed beside {submission.name} ({why})")
    ctx = Context(job, submission, runs, logs)
    for step in STEPS:
        if job.notebooks or step is not grade_notebook:
            step(ctx)
    return Graded(ctx.tests, ctx.leaderboard, ctx.numbers, ctx.failures,
                  facts={"changed_files": submission.changed_files})
