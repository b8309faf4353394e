"""What every assignment's rubric shares: hardware profiles looked up by name, and the tier rule.

A rubric is a TOML file of the assignment's handout folder: its points, and per hardware
profile (one kind of machine) what runs there and the thresholds. Each assignment's package
extends `Profile` and `Rubric` with its own fields (`grader/a1/rubric.py`, `grader/a2/rubric.py`).
"""

from __future__ import annotations

import tomllib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

KIT_ROOT = Path(__file__).resolve().parents[1]


def tier_share(tiers: list, value: float) -> float:
    """The share of points the best tier `value` reaches: steps, not a slope, so a score does
    not move with timing or evaluation noise. `tiers` is [[threshold, share], ...]."""
    return max([share for threshold, share in tiers if value >= threshold], default=0.0)


def read_toml(path: str | Path) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


@dataclass(frozen=True)
class Profile:
    """One kind of machine: what the core needs to run a submission there (the sandbox's
    threads, time and memory) and to record it (env.json)."""

    name: str
    description: str
    device: str
    threads: int
    timeout_s: float
    memory_mb: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Rubric(ABC):
    profiles: dict[str, Profile]
    kind: ClassVar[str] = "profile"  # how an unknown profile's error names it

    def profile(self, name: str) -> Profile:
        if name not in self.profiles:
            raise KeyError(f"unknown {self.kind} {name!r}: choose one of {', '.join(self.profiles)}")
        return self.profiles[name]

    @abstractmethod
    def zero_tests(self, reason: str) -> list[dict]:
        """Every test of the rubric at 0 with one reason: a submission that could not be graded."""
