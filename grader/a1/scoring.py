"""Scoring A1: the three parts and the notebook, from a submission's runs against the job's
reference (`job.py`).

Each submission runs the same sessions as the starter on its patched tree; what comes back is
compared here, in the grader (`compare.py`).

Scoring rule for every part: a wrong answer zeroes the part; a correct answer earns the part's
correctness points only once its slow path is fixed (the unchanged starter is correct but slow),
plus the speed or feature points that the measurement reaches.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..assignment import Graded
from ..errors import GraderError
from ..report import test_entry
from ..runner import SessionResult, run_sessions
from ..submission import Submission, load_submission, patched_tree
from . import explain
from .compare import (
    loss_error,
    moe_error,
    moments_direction_problem,
    moments_error,
    moments_names_problem,
    worst_moments,
)
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
    measurements: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)  # lists for results.json's extra_data (not leaderboard columns)
    wrong: set[str] = field(default_factory=set)  # the parts found wrong so far: later layouts may run their code

    @property
    def failures(self) -> dict[str, str]:
        """Session -> its error and the end of its log, for the feedback."""
        return {name: f"{run.error}\n\n{run.log_tail}".strip() for name, run in self.runs.items() if not run.ok}


def _not_on_profile(ctx: Context, part: Part, layout: str) -> None:
    note = f"not graded on profile {ctx.job.profile.name} (it has no {layout} layout)"
    ctx.tests += [dict(t, max_score=0, status="passed") for t in part.tests((0, 0, 0), (note,) * 3)]


def _part_tests(ctx: Context, part: Part, points: tuple[float, float, float],
                outputs: tuple[str, str, str]) -> list[dict]:
    """The part's tests as the profile scores them: where it scores none of the part's speeds
    (scored_speeds), the speed test is worth 0 and names no timing, whatever else happened. A
    correctness or feature test that fails names the public test that shows it locally."""
    profile = ctx.job.profile
    if part.public_test:
        reproduce = f". Reproduce it locally: `.venv/bin/python -m pytest {part.public_test} -q`."
        outputs = (*(out.rstrip(".") + reproduce if got < most else out for out, got, most in
                     zip(outputs[:2], points, (part.correctness, part.feature))), outputs[2])
    if profile.scores_speed_of(part.key):
        return part.tests(points, outputs)
    return [*dataclasses.replace(part, speed=0).tests(points, outputs),
            test_entry(f"{part.title}: speed", 0, 0, profile.speed_not_scored, part.key)]


def _award(ctx: Context, part: Part, correct: bool, fixed: bool, speed: float | None, checked: str, feature: str,
           timing: str, not_fixed: str) -> None:
    """The part's rule: wrong zeroes it; correct earns correctness and feature points once the
    feature check shows the slow path gone, whatever the speed; the speed share only then (None:
    the profile scores no speed of the part)."""
    if not correct:
        ctx.tests += _part_tests(ctx, part, (0, 0, 0), (f"wrong: {checked}. The part earns nothing until it matches.",
                                                        f"zeroed (wrong results): {feature}",
                                                        f"zeroed (wrong results): {timing}"))
    elif not fixed:
        ctx.tests += _part_tests(ctx, part, (0, 0, 0), (f"matches, but {not_fixed}: {checked}", feature,
                                                        f"not scored until the slow path is gone: {timing}"))
    else:
        ctx.tests += _part_tests(ctx, part, (part.correctness, part.feature, part.speed * (speed or 0.0)),
                                 (f"matches: {checked}", feature, timing))


def _range(profile: A1Profile, measurement: str) -> str:
    low, high = profile.speed[measurement]
    return f"speed points from {low:g}x (none) to {high:g}x (all), on a log scale"


def grade_moe(ctx: Context) -> None:
    """Part 1: the MoE layer alone on the starter's weights (its outputs and every expert's
    gradients against the reference's, its time in turns with the starter's), and the whole
    step of the reference layout against the starter's: both must be right for any point."""
    job, part, profile = ctx.job, ctx.job.rubric.parts["moe"], ctx.job.profile
    ref, run = job.reference, ctx.runs["moe"]
    if not run.ok:
        reason = f"the MoE run failed: {run.error}"
        ctx.tests += _part_tests(ctx, part, (0, 0, 0), (reason,) * 3)
        return
    error = moe_error(ref.moe_exact.digests, run.digests)
    warmup = profile.moe["warmup"]
    starter_s, yours_s = _median_timed(ctx.runs["moe-starter"], warmup), _median_timed(run, warmup)
    layer = starter_s / yours_s
    ctx.measurements["moe_speedup"] = layer
    if "moe_layer" in profile.scored_speeds:
        ctx.leaderboard.append({"name": "Part 1: MoE speedup", "value": round(layer, 2)})
    exact = " computed in float32" if ref.moe_exact is not ref.moe else ""
    why = f"; {explain.moe_infinite(ref.moe_exact.digests, run.digests)}" if math.isinf(error) else ""
    checked = (f"outputs, input gradients and each expert's gradients on {len(run.digests)} grader-chosen inputs, "
               f"against the starter's layer{exact}: worst relative error {error:.2g} "
               f"(tolerance {profile.rtol:g}{why})")
    timings = {"moe_layer": (
        f"one MoE layer, median of {len(run.seconds) - warmup} timed workloads of {profile.moe.get('iters', 1)} "
        f"forward+backward passes in turns with the starter: starter {starter_s * 1e3:.2f} ms, yours "
        f"{yours_s * 1e3:.2f} ms, {layer:.2f}x ({_range(profile, 'moe_layer')})")}
    # The whole step must train like the starter's too: a layer exact in the check above but
    # wrong (or failing) inside the model zeroes the part, its speed included.
    step = ctx.runs.get("reference")
    if step is None or not step.ok:
        step_error = math.inf
        checked += f"; whole step, reference layout: failed ({step.error if step else 'it did not run'})"
        timings["moe_step"] = "whole step, reference layout: failed, not timed"
    else:
        step_error = loss_error(ref.train.digests, step.digests)
        checked += f"; whole step, reference layout: {_checked(step, step_error, profile.train_rtol)}"
        moments_ok, line = _moments_checked(ctx, ref.train.digests, step.digests, "moments")
        checked += f"; {line}"
        if not moments_ok:
            step_error = math.inf  # the step applied other gradients than the starter's
    step_correct = step_error <= profile.train_rtol
    shares = {"moe_layer": profile.speed_share("moe_layer", layer)}
    if step_correct:
        whole, timings["moe_step"] = _step_numbers(ctx, step, ref.train, "reference", "moe_step")
        ctx.measurements["moe_step_speedup"] = whole
        shares["moe_step"] = profile.speed_share("moe_step", whole)
    elif step is not None and step.ok:
        timings["moe_step"] = "whole step, reference layout: it trains differently from the starter's, not timed"
    # the mean share of the measurements the profile scores; the others are neither scored nor told
    scored = [m for m in ("moe_layer", "moe_step") if m in profile.scored_speeds]
    share = sum(shares.get(m) or 0.0 for m in scored) / len(scored) if scored else None
    timing = "; ".join(timings[m] for m in scored if m in timings)
    fixed = layer > profile.speed["moe_layer"][0]
    correct = error <= profile.rtol and step_correct
    if not correct:
        ctx.wrong.add("moe")
    _award(ctx, part, correct, fixed, share, checked, "", timing,
           f"the MoE layer is not faster than the starter's ({layer:.2f}x; {profile.speed['moe_layer'][0]:g}x "
           "shows its slow path is gone)")


def _step_numbers(ctx: Context, run: SessionResult, starter: SessionResult, layout_name: str,
                  measurement: str | None = None) -> tuple[float, str]:
    """The whole step's speedup over `starter`, tokens/s (and MFU on GPU), and a line for the
    feedback; `measurement` names its speed range (`<layout_name>_step`). All are recorded; the
    Gradescope leaderboard gets them only where the profile scores the measurement. The evidence
    is read once, after the last step (`runner.Child.step`): every timed step follows another
    step, so whatever a step leaves undone is timed in the next one."""
    profile = ctx.job.profile
    measurement = measurement or f"{layout_name}_step"
    scored = measurement in profile.scored_speeds
    tokens = profile.batch * profile.seq_len
    seconds = _median_timed(run, profile.warmup)
    tokens_per_s = tokens / seconds
    ratio = _median_timed(starter, profile.warmup) / seconds
    ctx.measurements.update({f"{layout_name}_evidence_s": run.evidence_s})
    ctx.measurements.update({f"{layout_name}_tokens_per_s": tokens_per_s, f"{layout_name}_step_speedup": ratio})
    if scored:
        ctx.leaderboard += [{"name": f"Step tokens/s ({layout_name} layout)", "value": round(tokens_per_s, 1)},
                            {"name": f"Step speedup vs starter ({layout_name})", "value": round(ratio, 2)}]
    line = f"whole step, {layout_name} layout: {tokens_per_s:,.0f} tokens/s, {ratio:.2f}x the starter"
    mfu = model_flops_utilization(profile, tokens_per_s, profile.layouts[layout_name]["world"])
    if mfu is not None:
        ctx.measurements[f"{layout_name}_mfu"] = mfu
        if scored:
            ctx.leaderboard.append({"name": f"MFU % ({layout_name} layout)", "value": round(100 * mfu, 2)})
        line += f", MFU {100 * mfu:.2f}% of dense bf16 peak"
    return ratio, f"{line} ({_range(profile, measurement)})" if scored else line


def _traffic(run: SessionResult, warmup: int) -> float:
    """Median bytes per timed step the grader saw move between the ranks (inf: not observable)."""
    timed = run.traffic[warmup:]
    if not timed or None in timed:
        return math.inf
    return statistics.median(timed)


def _checked(run: SessionResult, error: float, rtol: float) -> str:
    why = f"; {explain.LOSS_INFINITE}" if math.isinf(error) else ""
    return (f"loss and gradient norm over {len(run.digests)} optimizer steps vs the starter's on the same seeds: "
            f"worst relative error {error:.2g} (tolerance {rtol:g}{why})")


def _after_wrong_parts(ctx: Context, part: str, correct: bool, checked: str) -> str:
    """A layout's correctness line; where it is wrong, the part is noted as wrong (for the parts
    after it) and, where an earlier part whose code the layout runs is wrong too, why it cannot
    match: every layout's model holds Part 1's MoE layer, and a pp layout with ep > 1 Part 2's
    expert parallelism."""
    if correct:
        return checked
    ctx.wrong.add(part)
    ep = part != "ep" and ctx.job.profile.layouts[part].get("ep", 1) > 1
    held = [f"{title} ({what})" for key, title, what, runs in (("moe", "Part 1", "the MoE layer", True),
                                                             ("ep", "Part 2", "expert parallelism", ep))
            if runs and key in ctx.wrong]
    if not held:
        return checked
    which = " and ".join(held)
    return (f"{checked}. This layout runs your code of {which} too, found wrong there: its losses cannot match the "
            f"starter's until {'that part matches' if len(held) == 1 else 'those parts match'}, so fix "
            f"{'it' if len(held) == 1 else 'them'} first")


def _moments_checked(ctx: Context, ref: list[dict], digests: list[dict], key: str) -> tuple[bool, str]:
    """The optimizer's first moments after the last step against the starter's (`compare.moments_error`),
    their norms and their projections on random directions: whether they pass the profile's
    `moments_rtol` and `moments_direction_rtol` (each always, where it is not set: recorded only),
    and the feedback's words. Records `<key>_error`, `<key>_direction_error` and the worst entries,
    `<key>_worst`."""
    profile = ctx.job.profile
    moments = moments_error(ref, digests, profile.moments_reading)
    directions = moments_error(ref, digests, profile.moments_reading, directions=True)
    ctx.measurements[f"{key}_error"] = moments if math.isfinite(moments) else None
    ctx.measurements[f"{key}_direction_error"] = directions if math.isfinite(directions) else None
    ctx.records[f"{key}_worst"] = worst_moments(ref, digests, reading=profile.moments_reading)

    def bound(rtol):
        return (f"tolerance {rtol:g}" if rtol is not None
                else "recorded, not scored on this profile until its honest spread is measured")

    how = ("parameter by parameter and expert by expert" if profile.moments_reading == "entries" else
           "each layer's summed, every parameter stepped")
    line = (f"the optimizer's first moments after the last step, {how}: worst relative error {moments:.2g} "
            f"({bound(profile.moments_rtol)}), along random directions {directions:.2g} "
            f"({bound(profile.moments_direction_rtol)})")
    if (names := moments_names_problem(ref, digests)) is not None:
        line += f": {names}"
    rtol = profile.moments_direction_rtol
    if rtol is not None and (direction := moments_direction_problem(ref, digests, rtol, profile.moments_reading)):
        line += f": {direction}"
    ok = all(tolerance is None or error <= tolerance for error, tolerance in
             ((moments, profile.moments_rtol), (directions, rtol)))
    if math.isinf(moments) or math.isinf(directions):
        line += f" ({explain.INFINITE})"
    if not ok and (words := explain.moments_in_words(worst_moments(ref, digests, sys.maxsize,
                                                                  profile.moments_reading))):
        line += f". In words: {words}"
    return ok, line


def grade_ep(ctx: Context) -> None:
    """Part 2: the ep layout trains like the reference, and it is expert parallelism: the expert
    weights stop travelling (the traffic between its ranks, read by the grader, against the
    starter's in the same layout), each rank holds its share of the routed experts, and at least
    the hidden states the tokens' routing sends to other ranks' experts travel (a layout in which
    every rank trains the whole batch on a whole model moves almost nothing)."""
    job, part, profile = ctx.job, ctx.job.rubric.parts["ep"], ctx.job.profile
    if "ep" not in profile.layouts:
        return _not_on_profile(ctx, part, "ep")
    ref, run = job.reference, ctx.runs["ep"]
    if not run.ok:
        reason = f"the ep={profile.layouts['ep']['ep']} run failed: {run.error}"
        ctx.tests += _part_tests(ctx, part, (0, 0, 0), (reason,) * 3)
        return
    error = loss_error(ref.ep.digests, run.digests)  # the starter's ep layout, on the same seeds
    expert_share = expert_parameter_share(profile)
    starter, yours = _traffic(ref.ep, profile.warmup), _traffic(run, profile.warmup)
    # The starter moves every parameter alike (plain FSDP), so its non-expert share of the traffic
    # is what a working EP still moves; what exceeds it is expert weights (tokens are small).
    expert_ratio = max(0.0, yours - starter * (1 - expert_share)) / (starter * expert_share)
    ctx.measurements.update(expert_traffic_ratio=expert_ratio, ep_traffic_mb_per_step=yours / 2**20)
    ep = profile.layouts["ep"]["ep"]
    held, most = experts_held_share(profile, run), profile.max_expert_state / ep
    needed = token_traffic(profile, ref.ep)
    ctx.measurements.update(ep_experts_held_share=held, ep_token_traffic_mb_per_step=needed / 2**20)
    feature = (f"traffic between the ranks per step, read by the grader: starter {starter / 2**20:.2f} MiB, yours "
               f"{yours / 2**20:.2f} MiB; expert weights are {expert_share:.0%} of the model, so about "
               f"{expert_ratio:.0%} of the starter's expert traffic remains (at most "
               f"{profile.max_expert_traffic:.0%} passes); the tokens' routing sends {needed / 2**20:.3f} MiB of "
               f"hidden states to experts on other ranks (at least {profile.min_token_traffic:g}x of it must move); "
               f"your busiest rank holds {held:.0%} of the routed experts' parameters, gradients or optimizer "
               f"state (its share is 1/{ep}: at most {most:.0%} passes)")
    missing = [why for failed, why in (
        (expert_ratio > profile.max_expert_traffic, "the expert weights still travel between the ranks"),
        (held > most, f"a rank holds more than its 1/{ep} of the routed experts (their parameters, gradients or "
                      "optimizer state)"),
        (yours < profile.min_token_traffic * needed, "too little travels between the ranks for the tokens to reach "
                                                     "the experts other ranks hold"),
    ) if failed]
    moments_ok, moments_line = _moments_checked(ctx, ref.ep.digests, run.digests, "ep_moments")
    speedup, timing = _step_numbers(ctx, run, ref.ep, "ep")
    correct = error <= profile.train_rtol and moments_ok
    _award(ctx, part, correct, not missing, profile.speed_share("ep_step", speedup),
           _after_wrong_parts(ctx, "ep", correct, f"{_checked(run, error, profile.train_rtol)}; {moments_line}"),
           feature, timing, "; ".join(missing))


def grade_pp(ctx: Context) -> None:
    """Part 3: the pp layout trains like the reference, and what travels between its ranks is
    activations, not weights: at least the stage boundaries' activations, at most a share of
    what plain data parallelism (the starter's ep layout) moves. With the profile's
    pipeline_memory, its busiest rank also holds at most a share of the whole model's state, read
    by the grader from outside the child (a rank that trains the whole model holds all of it)."""
    job, part, profile = ctx.job, ctx.job.rubric.parts["pp"], ctx.job.profile
    if "pp" not in profile.layouts:
        return _not_on_profile(ctx, part, "pp")
    ref, run = job.reference, ctx.runs["pp"]
    layout = profile.layouts["pp"]
    if not run.ok:
        reason = f"pp={layout['pp']} does not train: {run.error}"
        ctx.tests += _part_tests(ctx, part, (0, 0, 0), (reason,) * 3)
        return
    one_rank = ref.pp_train  # the starter on one rank, on the pp layout's seeds and model
    error = loss_error(one_rank.digests, run.digests)
    activations = activation_bytes(profile, layout["pp"])
    data_parallel = _traffic(ref.ep, profile.warmup) if ref.ep is not None else math.inf
    yours = _traffic(run, profile.warmup)
    low, high = profile.pipeline_traffic
    fixed = low * activations <= yours <= high * data_parallel
    ctx.measurements["pp_traffic_mb_per_step"] = yours / 2**20
    feature = (f"traffic between the ranks per step, read by the grader: {yours / 2**20:.3f} MiB; the stage "
               f"boundaries pass on {activations / 2**20:.3f} MiB of activations (at least {low:g}x of them must "
               f"move), plain data parallelism moves {data_parallel / 2**20:.2f} MiB (at most {high:g}x of it may)")
    if profile.pipeline_memory is not None:
        share, line = _state_share(profile, run, one_rank)
        ctx.measurements["pp_state_share"] = share
        fixed = fixed and share <= profile.pipeline_memory["max_state_share"]
        feature += f"; {line}"
    moments_ok, moments_line = _moments_checked(ctx, one_rank.digests, run.digests, "pp_moments")
    speedup, timing = _step_numbers(ctx, run, one_rank, "pp")
    correct = error <= profile.train_rtol and moments_ok
    _award(ctx, part, correct, fixed, profile.speed_share("pp_step", speedup),
           _after_wrong_parts(ctx, "pp", correct, f"{_checked(run, error, profile.train_rtol)}; {moments_line}"),
           feature, timing,
           "the traffic between the ranks or the memory each holds is not a pipeline's (activations between "
           "stages, each stage's weights on its own ranks)")


def _state_share(profile: A1Profile, run: SessionResult, one_rank: SessionResult) -> tuple[float, str]:
    """The share of the whole model's state (float32 weights, gradients and two AdamW moments: 16
    bytes a parameter; pipeline_memory is set on float32 profiles only) that the pp layout's
    busiest process holds beyond what the starter's one-rank run holds besides that state, and a
    line for the feedback."""
    from onenode.model import count_parameters

    state = 16 * count_parameters(_profile_config(profile, profile.pipeline_memory["overrides"]))[0]
    besides = max(one_rank.resident) - state
    share = (max(run.resident) - besides) / state
    return share, (f"memory, read by the grader: your busiest rank held {max(run.resident) / 2**20:,.0f} MiB, the "
                   f"starter's one-rank run {max(one_rank.resident) / 2**20:,.0f} MiB, of which the whole model's "
                   f"state is {state / 2**20:,.0f} MiB: your busiest rank holds {share:.2f} of a whole model's "
                   f"state (at most {profile.pipeline_memory['max_state_share']:g} passes)")


def grade_notebook(ctx: Context) -> None:
    """The report notebook, autograded under nbgrader by `grader/notebook.py`."""
    from .. import notebook

    ctx.tests += notebook.grade(ctx.submission.notebook, ctx.logs, "a1")


# The grading steps, in order; each adds tests (and numbers) to the context.
STEPS = [grade_moe, grade_ep, grade_pp, grade_notebook]
# The sessions each step reads: a submission runs only those of the steps in STEPS (a job that
# grades Parts 2 and 3 alone skips the MoE layer and the reference layout).
READS = {grade_moe: ("moe", "reference"), grade_ep: ("ep",), grade_pp: ("pp",), grade_notebook: ()}


def _median_timed(run: SessionResult, warmup: int) -> float:
    """Median seconds of the timed workloads (`warmup` >= 1, so each follows another step)."""
    return statistics.median(run.seconds[warmup:])


# -- figures from the PRISTINE kit (never the submission's) ------------------------------------
def _profile_config(profile: A1Profile, extra: dict | None = None):
    from onenode.model import get_preset

    return get_preset(profile.preset, **{**profile.overrides, **(extra or {})})


def expert_parameter_share(profile: A1Profile) -> float:
    """Routed-expert parameters over all parameters of the profile's model."""
    from onenode.model import count_parameters, routed_expert_parameters

    config = _profile_config(profile)
    return routed_expert_parameters(config) / count_parameters(config)[0]


def experts_held_share(profile: A1Profile, run: SessionResult) -> float:
    """The most of the profile's routed experts any rank of `run` held after its last step (where
    the grader reads them), as a share of them: of their parameters, of their gradients, or of
    their optimizer state (AdamW: two moments a parameter), counted by the harness in the
    parameters that hold the loaded experts' values."""
    from onenode.model import routed_expert_parameters

    whole = routed_expert_parameters(_profile_config(profile))
    return max((max(params, grads, state / 2) / whole for digest in run.digests if "experts_held" in digest
                for params, grads, state in digest["experts_held"]), default=math.inf)


def token_traffic(profile: A1Profile, starter_ep: SessionResult) -> float:
    """Bytes per timed step (median) an ep layout must move at least for its tokens to reach their
    experts: each (token, other rank holding one of its experts) pair that the starter's routers
    counted (`harness.TrainSession.count_routes`) sends the token's hidden state there and the result
    back, and their gradients the other way."""
    import torch

    hidden = _profile_config(profile).hidden_size * getattr(torch, profile.dtype).itemsize
    return 4 * hidden * statistics.median(digest["routes"] for digest in starter_ep.digests[profile.warmup:])


def activation_bytes(profile: A1Profile, pp: int) -> int:
    """Bytes a pipeline's stage boundaries pass on per step: the hidden states forward and their
    gradients backward, across each of the pp - 1 boundaries, for the whole batch."""
    import torch

    config = _profile_config(profile)
    itemsize = getattr(torch, profile.dtype).itemsize
    return 2 * (pp - 1) * profile.batch * profile.seq_len * config.hidden_size * itemsize


def model_flops_utilization(profile: A1Profile, tokens_per_s: float, n_gpus: int) -> float | None:
    """MFU against the dense bf16 peak of H100/H200, from the kit's FLOP model; None on CPU."""
    if profile.device != "cuda":
        return None
    from onenode.flops import mfu, model_flops

    report = model_flops(_profile_config(profile), profile.seq_len, 1)
    return mfu(tokens_per_s, report.matmul_flops_per_token, n_gpus=n_gpus)


def grade_steps(ctx: Context, steps: list) -> None:
    """Each grading step in turn. A step (a part) whose tests earned nothing takes its entries off
    the Gradescope leaderboard: wrong or slow results show no speed (extra_data keeps the numbers)."""
    for step in steps:
        shown, tests = len(ctx.leaderboard), len(ctx.tests)
        step(ctx)
        if not any(t["score"] for t in ctx.tests[tests:]):
            del ctx.leaderboard[shown:]


def grade(job: A1Job, path: Path, work: Path, logs: Path) -> Graded:
    """Intake, the patched tree in `work`, the submission's sessions, then every grading step."""
    submission = load_submission(path, work)
    tree = patched_tree(submission, work / "tree")
    ref = job.reference
    reads = {name for step in STEPS for name in READS[step]}
    runs = run_sessions(job.harness, tree, job.profile,
                        [session for session in job.sessions() if session.name in reads], logs,
                        files_in={"moe.pt": ref.moe_weights, "model.pt": ref.model_weights,
                                  **({"model-pp.pt": ref.pp_weights} if ref.pp_weights else {})},
                        baselines={"moe": job.starter_moe} if "moe" in reads else None)
    starter = runs.get("moe-starter")
    if "moe" in runs and runs["moe"].ok and (starter is None or not starter.ok):
        why = starter.error if starter else "it did not start"
        raise GraderError(f"the unpatched starter's MoE failed beside {submission.name} ({why})")
    ctx = Context(job, submission, runs, logs)
    grade_steps(ctx, [step for step in STEPS if job.notebooks or step is not grade_notebook])
    return Graded(ctx.tests, ctx.leaderboard, ctx.measurements, ctx.failures,
                  extra_data={"changed_files": submission.changed_files,
                              "scored_speeds": list(job.profile.scored_speeds), **ctx.records})
