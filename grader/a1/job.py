"""An A1 grading job: a profile, a seed, and the unpatched starter's reference runs, made once
and shared by every submission of the job.

The job picks a random seed (recorded in every result) and, from it, the seeds of every session's
workloads: each session (the MoE layer, each layout) has seeds of its own, so no two sessions see
the same inputs, and nothing a submission can read before it runs (the rubric, the profile, its
tree) holds them. It runs the unpatched starter through the harness on those seeds: the MoE
digests and times (and, on bfloat16 profiles, the same layer computed in float32: what a
submission's layer is compared with), the loss trajectory and step time of the reference layout,
the starter's ep layout (plain FSDP: its EP is never applied) with the traffic between its ranks
and the tokens its routers send to experts an EP layout keeps on other ranks, and a one-rank run
on the pp layout's seeds (and model). Each layout of a submission is compared with the starter's
run on its own seeds. Nothing secret ever runs in a child.
"""

from __future__ import annotations

import random
import secrets
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..assignment import Job
from ..errors import GraderError
from ..rubric import KIT_ROOT
from ..runner import Baseline, Harness, Session, SessionResult, run_sessions
from ..sandbox import make_private
from ..submission import pristine_tree
from .rubric import A1Profile, A1Rubric

HARNESS = Path(__file__).with_name("harness.py")
COLLECTIVES = KIT_ROOT / "a1_infra" / "tests" / "collectives.py"  # the kit's own: the harness imports it
CONFINE = Path(__file__).with_name("confine.py")  # each rank confines itself with it before the submission runs


def weights_mb(profile: A1Profile) -> int:
    """float32 weights of the profile's model, from the pristine kit's config (not the submission's)."""
    from onenode.model import count_parameters, get_preset

    total, _ = count_parameters(get_preset(profile.preset, **profile.overrides))
    return 4 * total // 2**20


@dataclass
class Reference:
    tree: Path  # the pristine starter copy
    moe: SessionResult  # the starter's MoE layer in the profile's dtype
    moe_exact: SessionResult  # the same layer on the same inputs in float32 (itself, on float32 profiles)
    train: SessionResult  # the starter in the profile's reference layout: the loss trajectory, the step time
    ep: SessionResult | None  # the starter in the ep layout: the traffic and step time to beat
    moe_weights: Path
    model_weights: Path
    # the starter on one rank on the pp layout's seeds (the pp layout's losses, step time and
    # memory are compared with it), with the profile's pipeline_memory overrides where it has them
    # (its weights then in pp_weights); None without a pp layout
    pp_train: SessionResult | None = None
    pp_weights: Path | None = None


@dataclass
class A1Job(Job):
    rubric: A1Rubric
    profile: A1Profile
    starter_logs: Path  # where the starter's runs leave their logs
    _reference: Reference | GraderError | None = None  # an error: the starter failed, once for the job
    _starter_moe: Baseline | None = None
    notebooks: bool = True  # False: code parts only (a GPU node without nbgrader; notebooks graded elsewhere)

    def __post_init__(self):
        rng = random.Random(self.seed)
        self.init_seed = rng.randrange(2**31)
        moe, steps = self.profile.moe, self.profile.warmup + self.profile.repeats
        self.seeds = {"moe": [rng.randrange(2**31) for _ in range(moe["warmup"] + moe["repeats"])],
                      **{layout: [rng.randrange(2**31) for _ in range(steps)] for layout in ("reference", "ep", "pp")}}
        # files may hold the job's weights twice over (the reference weights the grader hands in)
        self.harness = Harness(HARNESS, (COLLECTIVES, CONFINE), max(1024, 2 * weights_mb(self.profile)))

    def spec(self, kind: str, **extra) -> dict:
        p = self.profile
        return {"kind": kind, "preset": p.preset, "overrides": p.overrides, "device": p.device, "dtype": p.dtype,
                "init_seed": self.init_seed, "moe": p.moe, "batch": p.batch,
                "seq_len": p.seq_len, **extra}

    @property
    def reference(self) -> Reference:
        """The starter's runs, made once per job; if they fail, every submission after gets the
        same error (the starter is not run again)."""
        if self._reference is None:
            try:
                self._reference = self._run_reference()
            except GraderError as e:
                self._reference = e
        if isinstance(self._reference, GraderError):
            raise self._reference
        return self._reference

    @property
    def starter_moe(self) -> Baseline:
        """The starter's MoE session that each submission's is timed beside, on one child for
        the whole job (ended with the job)."""
        if self._starter_moe is None:
            ref = self.reference
            session = self._moe("moe", weights_in="moe.pt")
            self._starter_moe = Baseline(ref.tree, self.harness, self.profile, session, {"moe.pt": ref.moe_weights})
            weakref.finalize(self, self._starter_moe.close)
        return self._starter_moe

    def _moe(self, name: str, **extra) -> Session:
        spec = self.spec("moe", **extra)
        return Session(name, spec, self.seeds["moe"], reads=(extra["weights_in"],) if "weights_in" in extra else ())

    def _train(self, name: str, layout: str, seeds: str, save: bool = False, **extra) -> Session:
        """A training session in `layout` on the seeds of the layout `seeds`, that loads its
        weights, or with `save` writes them (the starter's one-rank runs); the pp layout's model
        (and the starter's one-rank run of it, "pp-reference") takes the profile's pipeline_memory
        overrides, and weights of its own. `extra` goes into the spec."""
        p = self.profile
        big = p.pipeline_memory is not None and seeds == "pp"
        weights = "model-pp.pt" if big else "model.pt"
        save = save and (big or name == "reference")
        overrides = {**p.overrides, **p.pipeline_memory["overrides"]} if big else p.overrides
        spec = self.spec("train", layout=p.layouts[layout], **{"weights_out" if save else "weights_in": weights},
                         overrides=overrides, recipe=p.recipe(p.layouts[layout], self.init_seed, overrides),
                         **extra)
        world = p.layouts[layout]["world"]
        return Session(name, spec, self.seeds[seeds], world=world, reads=() if save else (weights,))

    def sessions(self, starter: bool = False) -> list[Session]:
        """Part 1's MoE session, then a training session per layout, each on its own seeds. The
        starter's sessions save the weights, and run pp's seeds on one rank ("pp-reference": its pp
        layout cannot work); a submission's load them."""
        p = self.profile
        if starter:
            sessions = [self._moe("moe", weights_out="moe.pt")]
            if p.dtype != "float32":
                sessions.append(self._moe("moe-exact", weights_in="moe.pt", compute_dtype="float32"))
            sessions.append(self._train("reference", "reference", "reference", save=True))
            if "ep" in p.layouts:  # its routers count what a token dispatch must move (Part 2's lower bound)
                sessions.append(self._train("ep", "ep", "ep", count_routes=True))
            if "pp" in p.layouts:
                sessions.append(self._train("pp-reference", "reference", "pp", save=True))
            return sessions
        return [self._moe("moe", weights_in="moe.pt")] + [self._train(name, name, name) for name in
                                                          ("reference", "ep", "pp") if name in p.layouts]

    def _run_reference(self) -> Reference:
        """The unpatched starter through the same harness; its own runs must agree."""
        tree = pristine_tree(self.workdir / "starter")
        logs = self.starter_logs
        moe_weights, model_weights = self.workdir / "moe.pt", self.workdir / "model.pt"
        pp_weights = self.workdir / "model-pp.pt"
        runs = run_sessions(self.harness, tree, self.profile, self.sessions(starter=True), logs,
                            files_out={"moe.pt": moe_weights, "model.pt": model_weights, "model-pp.pt": pp_weights})
        for name, run in runs.items():
            if not run.ok:
                raise GraderError(f"the unpatched starter's {name} session failed ({run.error}): see {logs}")
        ep = runs.get("ep")
        if ep is not None:
            if not all(ep.traffic):
                raise GraderError("no traffic seen between the ranks of the starter's ep run: this machine "
                                  "cannot observe it (a network namespace on CPU, nvidia-smi's NVLink counters "
                                  "on GPU are needed; docs/SECURITY.md)")
            if not all(digest.get("routes") for digest in ep.digests):
                raise GraderError(f"the starter's ep run counted no tokens routed to another rank's experts: the "
                                  f"profile {self.profile.name}'s model needs MoE layers, and experts on every rank")
        exact = runs.get("moe-exact", runs["moe"])
        pp_train = runs.get("pp-reference")
        big = pp_train is not None and self.profile.pipeline_memory is not None
        return Reference(tree, runs["moe"], exact, runs["reference"], ep, moe_weights, model_weights, pp_train,
                         pp_weights if big else None)


def new_job(rubric: A1Rubric, profile_name: str, workdir: Path, starter_logs: Path, seed: int | None = None,
            notebooks: bool = True) -> A1Job:
    """A grading job. The kit's reference solutions become grader-only before any submission runs."""
    make_private(KIT_ROOT / "solutions")
    seed = secrets.randbelow(2**31) if seed is None else seed
    return A1Job(rubric, rubric.profile(profile_name), seed, workdir, starter_logs, notebooks=notebooks)
