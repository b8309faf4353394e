"""A1's rubric (`a1_infra/rubric.toml`): three parts, their points, and per hardware profile the
workloads, layouts and thresholds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..report import test_entry
from ..rubric import KIT_ROOT, Profile, Rubric, read_toml, tier_share

RUBRIC_PATH = KIT_ROOT / "a1_infra" / "rubric.toml"


@dataclass(frozen=True)
class Part:
    key: str  # "moe", "ep", "pp"
    title: str
    correctness: float
    performance: float  # the speed or feature points
    performance_kind: str  # "speed" or "feature"

    def tests(self, correct_points: float, perf_points: float, correct_out: str, perf_out: str) -> list[dict]:
        """The part's two Gradescope tests: its correctness, then its speed or feature."""
        return [test_entry(f"{self.title}: correctness", correct_points, self.correctness, correct_out, self.key),
                test_entry(f"{self.title}: {self.performance_kind}", perf_points, self.performance, perf_out, self.key)]


@dataclass(frozen=True)
class A1Profile(Profile):
    """What runs on one kind of machine and what counts as fixed there."""

    dtype: str
    preset: str
    overrides: dict
    batch: int
    seq_len: int
    warmup: int
    repeats: int
    rtol: float
    moe: dict
    speedup_tiers: list
    max_expert_allgather: float
    layouts: dict = field(default_factory=dict)

    def speed_share(self, speedup: float) -> float:
        return tier_share(self.speedup_tiers, speedup)


@dataclass(frozen=True)
class A1Rubric(Rubric):
    parts: dict[str, Part]

    def zero_tests(self, reason: str) -> list[dict]:
        """Every part's tests at 0 with one reason (a submission that could not run)."""
        return [t for part in self.parts.values() for t in part.tests(0, 0, reason, reason)]


def load_rubric(path: str | Path = RUBRIC_PATH) -> A1Rubric:
    raw = read_toml(path)
    parts = {}
    for key, part in raw["parts"].items():
        kind = "speed" if "speed" in part else "feature"
        parts[key] = Part(key, part["title"], float(part["correctness"]), float(part[kind]), kind)
    profiles = {name: A1Profile(name=name, **spec) for name, spec in raw["profiles"].items()}
    return A1Rubric(profiles, parts)
