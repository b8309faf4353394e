"""A1's rubric (`a1_infra/rubric.toml`): parts, points and per-hardware-profile workloads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

KIT_ROOT = Path(__file__).resolve().parents[1]
RUBRIC_PATH = KIT_ROOT / "a1_infra" / "rubric.toml"


def tier_share(tiers: list, value: float) -> float:
    """The share of points the best tier `value` reaches: steps, not a slope, so a score does
    not move with timing or evaluation noise. `tiers` is [[threshold, share], ...]."""
    return max([share for threshold, share in tiers if value >= threshold], default=0.0)


def pick_profile(profiles: dict, name: str, what: str = "profile"):
    if name not in profiles:
        raise KeyError(f"unknown {what} {name!r}: choose one of {', '.join(profiles)}")
    return profiles[name]


@dataclass(frozen=True)
class Part:
    key: str  # "moe", "ep", "pp"
    title: str
    correctness: float
    performance: float  # the speed or feature points
    performance_kind: str  # "speed" or "feature"


@dataclass(frozen=True)
class Profile:
    """One kind of machine: what runs there and what counts as fixed."""

    name: str
    description: str
    device: str
    dtype: str
    threads: int
    preset: str
    overrides: dict
    batch: int
    seq_len: int
    warmup: int
    repeats: int
    rtol: float
    timeout_s: float
    memory_mb: int
    moe: dict
    speedup_tiers: list
    max_expert_allgather: float
    layouts: dict = field(default_factory=dict)

    def speed_share(self, speedup: float) -> float:
        return tier_share(self.speedup_tiers, speedup)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Rubric:
    parts: dict[str, Part]
    profiles: dict[str, Profile]

    def profile(self, name: str) -> Profile:
        return pick_profile(self.profiles, name)


def load_rubric(path: str | Path = RUBRIC_PATH) -> Rubric:
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    parts = {}
    for key, part in raw["parts"].items():
        kind = "speed" if "speed" in part else "feature"
        parts[key] = Part(key, part["title"], float(part["correctness"]), float(part[kind]), kind)
    profiles = {name: Profile(name=name, **spec) for name, spec in raw["profiles"].items()}
    return Rubric(parts, profiles)
