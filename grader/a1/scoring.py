"""Grading A1: the starter's reference runs, the three parts, and the hook for the notebook.

A grading job picks a random seed (recorded in every result), runs the unpatched starter once
through the harness (the reference: MoE digests and times, the loss trajectory of the reference
layout, the starter's expert-parallel run with its collective bytes), then grades each
submission by running the same sessions on its patched tree and comparing, in this process,
what comes back. Nothing secret ever runs in a child.

Scoring rule for every part: a wrong answer zeroes the part; a correct answer earns the part's
correctness points only once its slow path is fixed (the unchanged starter is correct but slow),
plus the speed or feature points that the measurement reaches.
"""

from __future__ import annotations

import math
import random
import secrets
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GraderError
from ..report import test_entry
from ..rubric import KIT_ROOT, Part, Profile, Rubric
from ..runner import Session, SessionResult, run_sessions
from ..sandbox import make_private
from ..submission import Submission, pristine_tree


# -- the job and its reference -----------------------------------------------------------------
@dataclass
class Reference:
    tree: Path  # the pristine starter copy
    moe: SessionResult
    train: SessionResult  # the starter in the profile's reference layout: the loss trajectory
    ep: SessionResult | None  # the starter in the ep layout: bytes and step time to beat
    moe_weights: Path
    model_weights: Path


@dataclass
class Job:
    """One grading run: a profile, a seed, and the starter's reference, shared by all submissions."""

    rubric: Rubric
    profile: Profile
    seed: int
    workdir: Path  # grader-private scratch of the job
    starter_logs: Path  # where the starter's runs leave their logs
    _reference: Reference | None = None
    notebooks: bool = True  # False: code parts only (a GPU node without nbgrader; notebooks graded elsewhere)

    def __post_init__(self):
        rng = random.Random(self.seed)
        self.init_seed = rng.randrange(2**31)
        moe = self.profile.moe
        self.moe_seeds = [rng.randrange(2**31) for _ in range(moe["warmup"] + moe["repeats"])]
        self.train_seeds = [rng.randrange(2**31) for _ in range(self.profile.warmup + self.profile.repeats)]

    def spec(self, kind: str, **extra) -> dict:
        p = self.profile
        return {"kind": kind, "preset": p.preset, "overrides": p.overrides, "device": p.device, "dtype": p.dtype,
                "init_seed": self.init_seed, "moe": p.moe, "batch": p.batch,
                "seq_len": p.seq_len, **extra}

    @property
    def reference(self) -> Reference:
        if self._reference is None:
            self._reference = self._run_reference()
        return self._reference

    def world(self) -> int:
        """Ranks of the job's children: enough for the widest layout."""
        return max(layout["world"] for layout in self.profile.layouts.values())

    def sessions(self, starter: bool = False) -> list[Session]:
        """Part 1's MoE session, then a training session per layout. The starter's sessions save
        the weights (and skip pp, which cannot work there); a submission's load them."""
        p = self.profile
        if starter:
            sessions = [Session("moe", self.spec("moe", weights_out="moe.pt"), self.moe_seeds),
                        Session("reference", self.spec("train", layout=p.layouts["reference"], weights_out="model.pt"),
                                self.train_seeds)]
            layouts = ["ep"]
        else:
            sessions = [Session("moe", self.spec("moe", weights_in="moe.pt"), self.moe_seeds)]
            layouts = ["ep", "pp"]
        return sessions + [Session(name, self.spec("train", layout=p.layouts[name], weights_in="model.pt"), self.train_seeds)
                           for name in layouts if name in p.layouts]

    def _run_reference(self) -> Reference:
        """The unpatched starter through the same harness; its own runs must agree."""
        tree = pristine_tree(self.workdir / "starter")
        logs = self.starter_logs
        moe_weights, model_weights = self.workdir / "moe.pt", self.workdir / "model.pt"
        runs = run_sessions(tree, self.profile, self.world(), self.sessions(starter=True), logs,
                            files_out={"moe.pt": moe_weights, "model.pt": model_weights})
        for name, run in runs.items():
            if not run.ok:
                raise GraderError(f"the unpatched starter's {name} session failed ({run.error}): see {logs}")
        ep = runs.get("ep")
        if ep is not None:
            error = loss_error(runs["reference"].digests, ep.digests)
            if error > self.profile.rtol:
                raise GraderError(f"the starter's ep and reference layouts disagree (relative error {error:.2g} > "
                                  f"rtol {self.profile.rtol:g}): the profile's tolerance is too tight for this machine")
            if not all(d["bytes"].get("all_gather") for d in ep.digests):
                raise GraderError("the collective counter saw no all-gather in the starter's ep run: "
                                  "torch.distributed's API changed? (a1_infra/tests/collectives.py COLLECTIVES)")
        return Reference(tree, runs["moe"], runs["reference"], ep, moe_weights, model_weights)


def new_job(rubric: Rubric, profile_name: str, workdir: Path, starter_logs: Path, seed: int | None = None,
            notebooks: bool = True) -> Job:
    """A grading job. The kit's reference solutions become grader-only before any submission runs."""
    make_private(KIT_ROOT / "solutions")
    seed = secrets.randbelow(2**31) if seed is None else seed
    return Job(rubric, rubric.profile(profile_name), seed, workdir, starter_logs, notebooks=notebooks)


# -- comparisons (made here, in the grader, never in the child) --------------------------------
def _rel(a, b, scale: float) -> float:
    """|a - b| / scale; anything malformed or not finite is infinitely wrong."""
    try:
        error = abs(float(a) - float(b)) / max(scale, 1e-30)
    except (TypeError, ValueError):
        return math.inf
    return error if math.isfinite(error) else math.inf


def moe_error(ref: list[dict], sub: list[dict]) -> float:
    """Worst relative error between the MoE digests of one workload (see harness `_sketch`
    and `_grad_norms`)."""
    if not isinstance(sub, list) or len(sub) != len(ref):
        return math.inf
    return max(_moe_digest_error(r, s) for r, s in zip(ref, sub))


def _moe_digest_error(ref: dict, sub: dict) -> float:
    try:
        errors = []
        for key in ("out", "dx"):
            r, s = ref[key], sub[key]
            if len(r) != len(s):
                return math.inf
            errors += [_rel(a, b, abs(r[-1])) for a, b in zip(s, r)]  # projections ~ the norm
        _, l1, l2 = ref["dparams"]
        _, m1, m2 = sub["dparams"]
        errors += [_rel(m1, l1, l1), _rel(m2, l2, 2 * l2)]
    except (KeyError, TypeError, ValueError):
        return math.inf
    return max(errors)


def loss_error(ref: list[dict], sub: list[dict]) -> float:
    """Worst relative error of the loss and gradient norm, step by step."""
    if len(ref) != len(sub):
        return math.inf
    errors = [0.0]
    for r, s in zip(ref, sub):
        if not isinstance(s, dict):
            return math.inf
        for key in ("loss", "grad_norm"):
            errors.append(_rel(s.get(key), r[key], abs(r[key])))
    return max(errors)


def _median_timed(run: SessionResult, warmup: int) -> float:
    return statistics.median(run.seconds[warmup:])


# -- results -----------------------------------------------------------------------------------
def part_tests(part: Part, correct_points: float, perf_points: float, correct_out: str, perf_out: str) -> list[dict]:
    return [test_entry(f"{part.title}: correctness", correct_points, part.correctness, correct_out, part.key),
            test_entry(f"{part.title}: {part.performance_kind}", perf_points, part.performance, perf_out, part.key)]


def zero_tests(rubric: Rubric, reason: str) -> list[dict]:
    """Every part's tests at 0 with one reason (a submission that could not run)."""
    return [t for part in rubric.parts.values() for t in part_tests(part, 0, 0, reason, reason)]


@dataclass
class Context:
    """What a grading step sees: the job, the submission, its patched tree, where logs go."""

    job: Job
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
    ctx.tests += [dict(t, max_score=0, status="passed") for t in part_tests(part, 0, 0, note, note)]


def grade_moe(ctx: Context) -> None:
    """Part 1: the MoE layer alone, on the starter's weights, against the starter's digests."""
    job, part = ctx.job, ctx.job.rubric.parts["moe"]
    ref, run = job.reference, ctx.runs["moe"]
    if not run.ok:
        reason = f"the MoE run failed: {run.error}"
        ctx.tests += part_tests(part, 0, 0, reason, reason)
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
    timing = (f"median of {len(run.seconds) - warmup} timed workloads of {job.profile.moe.get('iters', 1)} forward+backward "
              f"passes, in turns with the starter: starter {starter_s * 1e3:.2f} ms, yours {yours_s * 1e3:.2f} ms, "
              f"speedup {speedup:.2f}x (tiers: "
              + ", ".join(f"{t:g}x -> {v:.0%}" for t, v in job.profile.speedup_tiers) + ")")
    if not correct:
        reason = f"wrong: {checked}; the part earns nothing until it matches"
        ctx.tests += part_tests(part, 0, 0, reason, f"{timing}; zeroed: the timed steps gave wrong results")
    elif share == 0:
        ctx.tests += part_tests(part, 0, 0, f"matches, but the MoE is not faster yet: {checked}", timing)
    else:
        ctx.tests += part_tests(part, part.correctness, part.performance * share, f"matches: {checked}", timing)


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
        ctx.tests += part_tests(part, 0, 0, reason, reason)
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
    held_ratio = _rel(held, 0, ref.ep.info["param_bytes"])  # inf if the child sent no number
    fixed = expert_ratio <= profile.max_expert_allgather and held_ratio <= 1.25
    ctx.numbers.update(expert_allgather_ratio=expert_ratio, allgather_mb_per_step=yours_ag / 2**20)
    checked = (f"loss and gradient norm over {len(run.digests)} optimizer steps vs the reference layout: "
               f"worst relative error {error:.2g} (tolerance {profile.rtol:g})")
    feature = (f"all-gathered per step and rank: starter {starter_ag / 2**20:.2f} MiB, yours {yours_ag / 2**20:.2f} MiB; "
               f"expert weights are {expert_share:.0%} of the model, so about {expert_ratio:.0%} of the starter's expert "
               f"all-gathers remain (at most {profile.max_expert_allgather:.0%} passes); parameters held per rank: "
               f"{held_ratio:.2f}x the starter's; {_step_numbers(ctx, run, ref.ep, 'ep')}")
    if not correct:
        ctx.tests += part_tests(part, 0, 0, f"wrong: {checked}", f"zeroed (wrong losses): {feature}")
    elif not fixed:
        ctx.tests += part_tests(part, 0, 0, f"matches, but the experts are still all-gathered: {checked}", feature)
    else:
        ctx.tests += part_tests(part, part.correctness, part.performance, f"matches: {checked}", feature)


def grade_pp(ctx: Context) -> None:
    """Part 3: the pp layout builds, trains, and gives the reference losses."""
    job, part, profile = ctx.job, ctx.job.rubric.parts["pp"], ctx.job.profile
    if "pp" not in profile.layouts:
        return _not_on_profile(ctx, part, "pp")
    ref, run = job.reference, ctx.runs["pp"]
    pp = profile.layouts["pp"]["pp"]
    if not run.ok:
        reason = f"pp={pp} does not train: {run.error}"
        ctx.tests += part_tests(part, 0, 0, reason, reason)
        return
    error = loss_error(ref.train.digests, run.digests)
    checked = (f"loss and gradient norm over {len(run.digests)} optimizer steps vs the reference layout: "
               f"worst relative error {error:.2g} (tolerance {profile.rtol:g})")
    feature = f"pp={pp} builds and trains; {_step_numbers(ctx, run, None, 'pp')}"
    if error > profile.rtol:
        ctx.tests += part_tests(part, 0, 0, f"wrong: {checked}", f"zeroed (wrong losses): {feature}")
    else:
        ctx.tests += part_tests(part, part.correctness, part.performance, f"matches: {checked}", feature)


def grade_notebook(ctx: Context) -> None:
    """The report notebook, autograded under nbgrader by `grader/notebook.py`."""
    from .. import notebook

    ctx.tests += notebook.grade(ctx.submission.notebook, ctx.logs)


# The grading steps, in order; each adds tests (and numbers) to the context.
STEPS = [grade_moe, grade_ep, grade_pp, grade_notebook]


def _bytes(digest: dict, family: str) -> float:
    try:
        return float(digest["bytes"].get(family, 0))
    except (KeyError, TypeError, AttributeError, ValueError):
        return math.inf


# -- figures from the PRISTINE kit (never the submission's) ------------------------------------
def _profile_config(profile: Profile):
    from onenode.model import get_preset

    return get_preset(profile.preset, **profile.overrides)


def expert_parameter_share(profile: Profile) -> float:
    """Routed-expert parameters over all parameters of the profile's model."""
    from onenode.model import count_parameters

    config = _profile_config(profile)
    experts = config.layer_kinds.count("moe") * config.n_routed_experts * 2 * config.hidden_size * config.moe_intermediate_size
    return experts / count_parameters(config)[0]


def model_flops_utilization(profile: Profile, tokens_per_s: float, n_gpus: int) -> float | None:
    """MFU against the dense bf16 peak of H100/H200, from the kit's FLOP model; None on CPU."""
    if profile.device != "cuda":
        return None
    from onenode.flops import mfu, model_flops

    report = model_flops(_profile_config(profile), profile.seq_len, 1)
    return mfu(tokens_per_s, report.matmul_flops_per_token, n_gpus=n_gpus)


def grade(job: Job, submission: Submission, tree: Path, logs: Path) -> Context:
    """Run the submission's sessions on its patched `tree`, then every grading step."""
    ref = job.reference
    starter_moe = Session("moe", job.spec("moe", weights_in="moe.pt"), job.moe_seeds)
    runs = run_sessions(tree, job.profile, job.world(), job.sessions(), logs,
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
    return ctx
