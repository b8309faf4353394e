"""A1's rubric (`a1_infra/rubric.toml`): three parts, their points, and per hardware profile the
workloads, layouts and thresholds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..report import test_entry
from ..rubric import KIT_ROOT, Profile, Rubric, read_toml
from .compare import MOMENTS_READINGS

RUBRIC_PATH = KIT_ROOT / "a1_infra" / "rubric.toml"


@dataclass(frozen=True)
class Part:
    key: str  # "moe", "ep", "pp"
    title: str
    correctness: float
    feature: float  # 0: the part has no feature check of its own (Part 1's is its layer's speed)
    speed: float

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
    max_expert_traffic: float  # Part 2: the share of the starter's expert traffic a fixed ep layout may move
    # Part 3: [low, high]: a fixed pp layout moves at least low x the activations at its stage
    # boundaries and at most high x what plain data parallelism moves
    pipeline_traffic: list[float]
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> {world, dp, ep, pp}
    # {"overrides": {...}, "max_state_share": x}: the pp layout then trains the model with these
    # overrides (a vocabulary large enough that model state dominates a rank's memory), and its
    # busiest rank may hold at most that share of the whole model's state (docs/SECURITY.md)
    pipeline_memory: dict | None = None
    # the tolerance of the optimizer's first moments after each step of the one-rank layout (each
    # parameter's and each routed expert's squared norm) against the starter's; None: recorded only
    moments_rtol: float | None = None
    # how they are read (`compare.MOMENTS_READINGS`): "entries", each on its own scale (float32), or
    # "layers", each layer's summed and a parameter stepped on one side only wrong (bfloat16)
    moments_reading: str = "entries"
    # the tolerance of the same moments' projections on seeded random directions (which way each
    # stepped: a negated or swapped gradient keeps every norm), on the scale of each one's norm, read
    # as `moments_reading` says; None: recorded only
    moments_direction_rtol: float | None = None

    def __post_init__(self):
        if self.moments_reading not in MOMENTS_READINGS:
            raise ValueError(f"profile {self.name}: moments_reading = {self.moments_reading!r}: choose one of "
                             f"{', '.join(MOMENTS_READINGS)}")
        for measurement, bounds in self.speed.items():
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and 0 < bounds[0] < bounds[1]):
                raise ValueError(f"profile {self.name}: speed.{measurement} = {bounds!r}: give [low, high] "
                                 "speedups with 0 < low < high")
        if self.pipeline_memory is not None and (self.device != "cpu" or self.dtype != "float32"
                                                 or self.layouts.get("pp", {}).get("dp", 1) != 1):
            raise ValueError(f"profile {self.name}: pipeline_memory reads host memory against float32 state, on "
                             "pp layouts with dp = 1: set it on float32 CPU profiles of that kind only")

    def speed_share(self, measurement: str, speedup: float) -> float:
        return speed_share(speedup, *self.speed[measurement])


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
        parts[key] = Part(key, part["title"], *(float(part.get(k, 0)) for k in ("correctness", "feature", "speed")))
    profiles = {name: A1Profile(name=name, **spec) for name, spec in raw["profiles"].items()}
    return A1Rubric(profiles, parts)
