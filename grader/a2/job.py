"""An A2 grading job: the evaluation suite, its text, the baseline's report and the grader's
pristine A2 stack, made once and shared by every submission of the job. The baseline goes
through the same sandboxed evaluation as a submission; where the profile names a recipe rather
than a checkpoint, it is trained once. The job's seed (random unless given, recorded in every
result) picks the spans of each run that the grader replays."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..assignment import Job
from ..rubric import KIT_ROOT
from .evaluation import build_suite, evaluate_sandboxed, suite_texts
from .rubric import A2Profile, A2Rubric


@dataclass
class A2Job(Job):
    rubric: A2Rubric
    profile: A2Profile
    baseline_checkpoint: Path | None = None  # default: the profile's
    notebooks: bool = True  # False: no report.ipynb grading (a node without nbgrader; notebooks graded elsewhere)
    evaluate: bool = True  # False: verification alone (`--verify-only`), no evaluation and no baseline
    eval_texts: list[str] | None = None  # the suite's text, read on first use (`evaluation_text`)
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
    def stack(self) -> Path:
        """The grader's pristine A2 stack, which replays the runs (`a2_stack`)."""
        return a2_stack()

    def evaluation_text(self) -> list[str]:
        """Every text of the profile's evaluation suite: what no training document may contain."""
        if self.eval_texts is None:
            self.eval_texts = suite_texts(self.profile, self.suite_dir)
        return self.eval_texts

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


def a2_stack() -> Path:
    """The grader's pristine A2 stack: the kit's starter_code with the reference A1 patch (what
    `onenode-grade release a2` gives students), built once per content under
    $ONENODE_CACHE/a2-stack/. The grader trains its reference runs and replays submissions with it,
    never with a submission's code. Returns the folder holding `starter_code/`."""
    from onenode.data.corpus import cache_dir

    from ..a1 import SOLUTIONS as SOLUTIONS_A1
    from ..a1 import solution_starter

    digest = hashlib.sha256((SOLUTIONS_A1 / "submission.patch").read_bytes())
    for path in sorted((KIT_ROOT / "starter_code" / "onenode").rglob("*.py")):
        digest.update(path.relative_to(KIT_ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    folder = cache_dir() / "a2-stack" / digest.hexdigest()[:12]
    if not (folder / "starter_code" / "onenode").is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
        try:
            solution_starter(work / "tree")
            os.replace(work / "tree", folder)
        except OSError:  # another process finished it first
            if not (folder / "starter_code" / "onenode").is_dir():
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return folder


def train_on_stack(recipe_path: str | Path, out: Path, overrides: dict | None = None, *options: str) -> None:
    """`onenode train RECIPE --out OUT --set ... OPTIONS` on the grader's A2 stack (`a2_stack`),
    from the kit root; one CPU thread unless OMP_NUM_THREADS says otherwise (tiny models run
    fastest so)."""
    sets = [f"--set={k}={v}" for k, v in (overrides or {}).items()]
    env = {**os.environ, "PYTHONPATH": str(a2_stack() / "starter_code"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-m", "onenode.cli", "train", str(recipe_path), "--out", str(out),
                           *sets, *options], cwd=KIT_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"training {recipe_path} failed: {done.stderr.strip()[-500:]}")


def trained_run(recipe_path: str | Path, overrides: dict | None = None) -> Path:
    """A run folder of `train_on_stack`, trained once per content of the recipe, its overrides,
    its data config and the stack, under $ONENODE_CACHE/a2-runs/ (the trainer puts the data's
    tokenizer in final/)."""
    from onenode.data.corpus import cache_dir, cache_lock
    from onenode.train.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    data_config = Path(KIT_ROOT / recipe.data.path).read_text() if recipe.data.source == "config" else None
    key = json.dumps([recipe.to_dict(), data_config, a2_stack().name], sort_keys=True, default=str)
    run = cache_dir() / "a2-runs" / f"{recipe.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    with cache_lock(f"a2-runs-{run.name}"):
        if not (run / "final" / "config.json").is_file():
            train_on_stack(recipe_path, run, overrides, "--fresh")
    return run


def new_job(rubric: A2Rubric, profile_name: str, workdir: Path, baseline: str | None = None,
            seed: int | None = None, notebooks: bool = True) -> A2Job:
    seed = secrets.randbelow(2**31) if seed is None else seed
    return A2Job(rubric, rubric.profile(profile_name), seed, workdir, Path(baseline) if baseline else None,
                 notebooks=notebooks)
