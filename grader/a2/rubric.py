"""A2's rubric (`a2_pretrain/rubric.toml`): points per category, and per hardware profile the
token budget, the evaluation suite, the baseline and the tiers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..report import test_entry
from ..rubric import KIT_ROOT, Profile, Rubric, read_toml

RUBRIC_PATH = KIT_ROOT / "a2_pretrain" / "rubric.toml"
# points key (and test tag) -> test name
TITLES = {"budget": "Token budget and run audit", "benchmarks": "Benchmarks vs baseline",
          "heldout": "Held-out perplexity vs baseline"}


@dataclass(frozen=True)
class A2Profile(Profile):
    token_budget: int
    replay_fraction: float  # the random spans replayed add up to at most this share of a run's steps
    replay_tolerance: float  # how far a replay not bit for bit may land, relative to the span's own move
    loss_tolerance: float  # how far (relative) a checkpoint's loss on the grader's batch may be from the logged
    suite: str  # "offline" (built by the grader) or "standard" (lm-eval's tasks)
    margin_tiers: list  # [[margin over the baseline in standard errors of the difference, share], ...]
    max_length: int = 2048
    batch_size: int = 16
    limit: int | None = None  # items per task
    baseline_recipe: str | None = None
    baseline_set: dict = field(default_factory=dict)
    baseline_checkpoint: str | None = None
    hf_home: str | None = None
    # replays need runs trained with `train.deterministic: true`: on this profile's GPUs two runs of
    # one recipe part after a few steps on the default kernels, so no tolerance tells them from a forgery
    deterministic_runs: bool = False
    # the machine's time for one run's replay, and the grader's replay rate there: the random spans
    # fill what the first and the last leave of it (None: replay_fraction alone bounds the replay)
    replay_minutes: float | None = None
    replay_tokens_per_s: float | None = None

    def __post_init__(self):
        if (self.replay_minutes is None) != (self.replay_tokens_per_s is None):
            raise ValueError(f"A2 profile {self.name}: give replay_minutes and replay_tokens_per_s together")


@dataclass(frozen=True)
class A2Rubric(Rubric):
    points: dict[str, float]
    kind: ClassVar[str] = "A2 profile"

    def zero_tests(self, reason: str) -> list[dict]:
        return [test_entry(title, 0, self.points[key], reason, key) for key, title in TITLES.items()]


def load_rubric(path: str | Path = RUBRIC_PATH) -> A2Rubric:
    raw = read_toml(path)
    profiles = {name: A2Profile(name=name, **spec) for name, spec in raw["profiles"].items()}
    return A2Rubric(profiles, {k: float(v) for k, v in raw["points"].items()})
