"""An A2 grading job: the evaluation suite and the baseline's report, made once and shared by
every submission of the job. The baseline goes through the same sandboxed evaluation as a
submission; where the profile names a recipe rather than a checkpoint, it is trained once."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..assignment import Job
from ..rubric import KIT_ROOT
from .evaluation import SUITE_SEED, build_suite, evaluate_sandboxed
from .rubric import A2Profile, A2Rubric


@dataclass
class A2Job(Job):
    rubric: A2Rubric
    profile: A2Profile
    baseline_checkpoint: Path | None = None  # default: the profile's
    _suite: Path | None = None
    _baseline: dict | None = None

    @property
    def suite_dir(self) -> Path | None:
        if self.profile.suite != "offline":
            return None
        if self._suite is None:
            self._suite = build_suite(self.workdir / "suite")
        return self._suite

    @property
    def baseline(self) -> dict:
        """The baseline's evaluation report, through the same sandboxed path as a submission."""
        if self._baseline is None:
            checkpoint = self.baseline_checkpoint or baseline_checkpoint(self.profile)
            logs = self.workdir / "baseline-logs"
            logs.mkdir(parents=True, exist_ok=True)
            report, error = evaluate_sandboxed(Path(checkpoint), self.profile, self.suite_dir, logs, "baseline")
            if report is None:
                raise RuntimeError(f"the baseline does not evaluate ({error}): see {logs}")
            self._baseline = report
        return self._baseline


def baseline_checkpoint(profile: A2Profile) -> Path:
    """The profile's baseline: a given checkpoint, or its recipe trained once (cached by content)."""
    if profile.baseline_checkpoint:
        path = Path(profile.baseline_checkpoint)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"baseline checkpoint {path} not found: train a2_pretrain/recipes/baseline.yaml "
                                    "or pass --baseline DIR")
        return path
    return trained_run(KIT_ROOT / profile.baseline_recipe, profile.baseline_set) / "final"


def trained_run(recipe_path: str | Path, overrides: dict | None = None) -> Path:
    """A run folder of `onenode train RECIPE --set ...`, trained once per content of the recipe,
    its overrides and its data config, under $ONENODE_CACHE/a2-runs/ (the trainer puts the data's
    tokenizer in final/)."""
    import hashlib

    from onenode.data.corpus import cache_dir
    from onenode.train.recipe import load_recipe

    overrides = overrides or {}
    recipe = load_recipe(recipe_path, overrides)
    data_config = Path(KIT_ROOT / recipe.data.path).read_text() if recipe.data.source == "config" else None
    key = json.dumps([recipe.to_dict(), data_config], sort_keys=True, default=str)
    run = cache_dir() / "a2-runs" / f"{recipe.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    final = run / "final"
    if not (final / "config.json").is_file():
        sets = [f"--set={k}={v}" for k, v in overrides.items()]
        done = subprocess.run([sys.executable, "-m", "onenode.cli", "train", str(recipe_path), "--out", str(run),
                               "--fresh", *sets], cwd=KIT_ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not (final / "config.json").is_file():
            raise RuntimeError(f"training {recipe_path} failed: {done.stderr.strip()[-500:]}")
    return run


def new_job(rubric: A2Rubric, profile_name: str, workdir: Path, baseline: str | None = None) -> A2Job:
    return A2Job(rubric, rubric.profile(profile_name), SUITE_SEED, workdir, Path(baseline) if baseline else None)
