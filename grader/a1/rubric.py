"""A1's rubric (`a1_infra/rubric.toml`): three parts, their points, and per hardware profile the
workloads, layouts and thresholds."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..report import test_entry
from ..rubric import KIT_ROOT, Profile, Rubric, read_toml
from .compare import MOMENTS_READINGS

RUBRIC_PATH = KIT_ROOT / "a1_infra" / "rubric.toml"
# What a profile may time against the starter (Part 1's layer, the whole step of each layout), and
# the part whose speed points each one feeds
SPEED_MEASUREMENTS = {"moe_layer": "moe", "moe_step": "moe", "ep_step": "ep", "pp_step": "pp"}


@dataclass(frozen=True)
class Part:
    key: str  # "moe", "ep", "pp"
    title: str
    correctness: float
    feature: float  # 0: the part has no feature check of its own (Part 1's is its layer's speed)
    speed: float
    public_test: str = ""  # the handout's test file that shows the part's faults locally (a1_infra/tests/...)

    def tests(self, points: tuple[float, float, float], outputs: tuple[str, str, str]) -> list[dict]:
        """The part's Gradescope tests: correctness, feature (where it has one), speed; `points`
        and `outputs` in that order."""
        names = ("correctness", "feature", "speed")
        maxima = (self.correctness, self.feature, self.speed)
        return [test_entry(f"{self.title}: {name}", got, most, out, self.key)
                for name, got, most, out in zip(names, points, maxima, outputs) if most > 0]

    @property
    def points(self) -> float:
        return self.correctness + self.feature + self.speed


def speed_share(value: float, low: float, high: float) -> float:
    """0 at or below `low`, 1 at or above `high`, and in between the position of `value` on a log
    scale: a continuous score, so timing noise moves it a little and never across a cliff."""
    if not value > low:
        return 0.0
    return min(1.0, math.log(value / low) / math.log(high / low))


# The routers' biases stay as loaded during A1's sessions: the step is compared with the starter's, and
# a bias update follows the loads each layout's forwards count, which are not the same work in every
# layout (torch's pipelining runs each stage's forward once more on the first step, to infer shapes).
A1_BALANCING = {"bias_update_rate": 0.0}


@dataclass(frozen=True)
class A1Profile(Profile):
    """What runs on one kind of machine and what counts as fixed there."""

    dtype: str  # what the sessions compute in: "float32" or "bfloat16"
    preset: str  # the model preset the training sessions build
    overrides: dict[str, int | float | str]  # NemotronH config fields over the preset's
    batch: int  # sequences per training step
    seq_len: int
    warmup: int  # untimed steps before each timed run
    repeats: int  # timed turns of submission and starter
    rtol: float  # the MoE layer's tolerance against the starter's float32 reference
    train_rtol: float  # the training losses' and gradient norms' tolerance against the starter's
    moe: dict[str, int | dict]  # Part 1's session: tokens, iters, warmup, repeats, overrides (its config)
    speed: dict[str, list[float]]  # measurement -> [low, high] speedup: no points below, full above
    # the measurements that earn speed points here; the others are timed and recorded, worth nothing
    scored_speeds: list[str]
    max_expert_traffic: float  # Part 2: the share of the starter's expert traffic a fixed ep layout may move
    # Part 3: [low, high]: a fixed pp layout moves at least low x the activations at its stage
    # boundaries and at most high x what plain data parallelism moves
    pipeline_traffic: list[float]
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> {world, dp, ep, pp}
    # {"overrides": {...}, "max_state_share": x}: the pp layout then trains the model with these
    # overrides (a vocabulary large enough that model state dominates a rank's memory), and its
    # busiest rank may hold at most that share of the whole model's state (docs/SECURITY.md)
    pipeline_memory: dict | None = None
    # the tolerance of the optimizer's first moments after the last step of the one-rank layout (each
    # parameter's and each routed expert's squared norm) against the starter's; None: recorded only
    moments_rtol: float | None = None
    # how they are read (`compare.MOMENTS_READINGS`): "entries", each on its own scale (float32), or
    # "layers", each layer's summed and a parameter stepped on one side only wrong (bfloat16)
    moments_reading: str = "entries"
    # the tolerance of the same moments' projections on seeded random directions (which way each
    # stepped: a negated or swapped gradient keeps every norm), on the scale of each one's norm, read
    # as `moments_reading` says; None: recorded only
    moments_direction_rtol: float | None = None
    # Part 2, set where the profile has an ep layout: each of its ranks may hold at most this many
    # times 1/ep of the routed experts' parameters, gradients and optimizer state, and its traffic
    # must be at least this many times what the tokens' routing sends to other ranks' experts
    max_expert_state: float | None = None
    min_token_traffic: float | None = None
    # recipe fields of the timed training step beyond the profile's model, batch, layout and
    # precision (`train.compile`, `train.cuda_graphs`, ...): what `bench_command` runs too
    step: dict[str, object] = field(default_factory=dict)

    def recipe(self, layout: dict[str, int], seed: int, overrides: dict | None = None) -> dict:
        """The training recipe of a session in `layout`: the profile's model (with `overrides`
        instead of its own, where given), global batch, sequence, precision and `step` fields,
        weights from `seed`; checked by the pristine kit's Recipe before any child sees it."""
        from onenode.train.recipe import from_dict

        raw = {"name": f"a1-{self.name}", "seed": seed,
               "model": {"preset": self.preset, **(self.overrides if overrides is None else overrides)},
               "data": {"source": "synthetic"},
               "train": {"token_budget": self.batch * self.seq_len * (self.warmup + self.repeats),
                         "seq_len": self.seq_len, "global_batch_size": self.batch, "device": self.device,
                         "precision": "bf16" if self.dtype == "bfloat16" else "fp32"},
               "parallel": {key: layout[key] for key in ("dp", "ep", "pp")}, "moe": dict(A1_BALANCING)}
        return from_dict(raw).with_overrides(self.step).to_dict()

    def bench_command(self, seed: int = 0) -> str:
        """The `onenode bench` command whose timed step is this profile's reference-layout step
        (one process): the same recipe, and with `seed` the same weights and batches as a grading
        job whose weights come from `seed` and whose workloads are seeds seed+1, seed+2, ..."""
        layout = self.layouts["reference"]
        launcher = "onenode" if layout["world"] == 1 else f"torchrun --nproc-per-node {layout['world']} -m onenode.cli"
        words = [f"{launcher} bench", f"--preset {self.preset}"]
        words += [f"--set {shlex.quote(f'model.{key}={value}')}" for key, value in self.overrides.items()]
        words += [f"--micro-batch {self.batch // layout['dp']}", f"--seq-len {self.seq_len}",
                  f"--dtype {'bf16' if self.dtype == 'bfloat16' else 'fp32'}"]
        words += [f"--set {key}={str(value).lower() if isinstance(value, bool) else value}"
                  for key, value in {**{f"moe.{k}": v for k, v in A1_BALANCING.items()}, **self.step}.items()]
        return " ".join(words + [f"--seed {seed}"])

    def __post_init__(self):
        if self.warmup < 1:
            raise ValueError(f"profile {self.name}: warmup = {self.warmup}: at least 1 (each timed step must follow "
                             "another, so that work a step leaves undone is timed in the next)")
        if "ep" in self.layouts and (self.max_expert_state is None or self.min_token_traffic is None):
            raise ValueError(f"profile {self.name}: its ep layout needs max_expert_state and min_token_traffic "
                             "(Part 2's evidence of expert parallelism): set both")
        if self.moments_reading not in MOMENTS_READINGS:
            raise ValueError(f"profile {self.name}: moments_reading = {self.moments_reading!r}: choose one of "
                             f"{', '.join(MOMENTS_READINGS)}")
        for measurement, bounds in self.speed.items():
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and 0 < bounds[0] < bounds[1]):
                raise ValueError(f"profile {self.name}: speed.{measurement} = {bounds!r}: give [low, high] "
                                 "speedups with 0 < low < high")
        if any(m not in SPEED_MEASUREMENTS or m not in self.speed for m in self.scored_speeds):
            raise ValueError(f"profile {self.name}: scored_speeds = {self.scored_speeds!r}: name measurements of "
                             f"{', '.join(SPEED_MEASUREMENTS)}, each with its [low, high] in speed")
        if self.pipeline_memory is not None and (self.device != "cpu" or self.dtype != "float32"
                                                 or self.layouts.get("pp", {}).get("dp", 1) != 1):
            raise ValueError(f"profile {self.name}: pipeline_memory reads host memory against float32 state, on "
                             "pp layouts with dp = 1: set it on float32 CPU profiles of that kind only")

    def speed_share(self, measurement: str, speedup: float) -> float | None:
        """The share of the speed points `speedup` earns; None where the profile does not score
        `measurement` (not in scored_speeds): it earns none, whatever it reads."""
        if measurement not in self.scored_speeds:
            return None
        return speed_share(speedup, *self.speed[measurement])

    def scores_speed_of(self, part: str) -> bool:
        """Whether the profile scores any speed of the part (else its speed test is worth 0 here)."""
        return any(SPEED_MEASUREMENTS[m] == part for m in self.scored_speeds)

    @property
    def speed_not_scored(self) -> str:
        """What the feedback and the leaderboard say of a measurement the profile does not score."""
        why = "CPU timing noise" if self.device == "cpu" else "the rubric's scored_speeds leaves it out"
        return f"not scored on profile {self.name} ({why})"


@dataclass(frozen=True)
class A1Rubric(Rubric):
    parts: dict[str, Part]

    def zero_tests(self, reason: str) -> list[dict]:
        """Every part's tests at 0 with one reason (a submission that could not run)."""
        return [t for part in self.parts.values() for t in part.tests((0, 0, 0), (reason,) * 3)]


def load_rubric(path: str | Path = RUBRIC_PATH) -> A1Rubric:
    raw = read_toml(path)
    parts = {}
    for key, part in raw["parts"].items():
        parts[key] = Part(key, part["title"], *(float(part.get(k, 0)) for k in ("correctness", "feature", "speed")),
                          public_test=part.get("public_test", ""))
    profiles = {name: A1Profile(name=name, **spec) for name, spec in raw["profiles"].items()}
    return A1Rubric(profiles, parts)
