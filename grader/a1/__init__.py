"""A1, a fast training stack: a patch to the starter, graded on the three slow paths it fixes.

`job.py` runs the unpatched starter once as the job's reference, `scoring.py` grades each part
of a submission against it (`compare.py`: the comparisons; `explain.py`: them in words for the
feedback; `harness.py`: what runs in the sandboxed child), `rubric.py` reads
`a1_infra/rubric.toml`, `tables.py` makes its rows, and `demo.py` builds the example cohort of
`onenode-grade demo`. The handout students get is the unpatched starter with `a1_infra/`; the
reference patch's own lines must not ship with it.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import tempfile
from pathlib import Path

from ..assignment import Assignment, Demo, Handout
from ..submission import load_submission, patched_tree, pristine_tree
from . import tables
from .demo import SOLUTIONS, build_cohort
from .job import A1Job, new_job
from .rubric import RUBRIC_PATH, A1Rubric, load_rubric
from .scoring import grade

STARTER_LOGS = ".starter-logs"  # in OUT: the logs of the starter's reference runs, a folder per job seed


def starter_logs(out: Path, seed: int) -> Path:
    """Where a job of `seed` keeps its starter's logs and evidence in OUT: one folder per seed, so a
    later job in the same OUT (its own seed) leaves the one each earlier grade was compared with."""
    return out / STARTER_LOGS / f"seed-{seed}"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="grading seed (default: random, recorded in results)")


def job_from_args(rubric: A1Rubric, profile: str, workdir: Path, args: argparse.Namespace) -> A1Job:
    """The job of `onenode-grade a1`: the starter's logs in OUT/.starter-logs/seed-SEED."""
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    return new_job(rubric, profile, workdir, starter_logs(Path(args.out), seed), seed=seed,
                   notebooks=not args.no_notebook)


def reference_patch_lines(starter: Path) -> set[str]:
    """The lines only the reference patch has (for the release's leak check): A1's starter ships
    unpatched, so none of them may ship with it."""
    from ..release import reference_lines  # release imports the registry, which imports this package

    return reference_lines((SOLUTIONS / "submission.patch").read_text(encoding="utf-8"), starter)


def solution_starter(dest: Path) -> Path:
    """The starter with the reference A1 solution applied, at `dest/starter_code` (what A2 starts
    from); returns that folder."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="reference-a1-", dir=dest.parent))
    try:
        return patched_tree(load_submission(SOLUTIONS, work), dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


HANDOUT = Handout(
    title="A1: make the NemotronH training stack fast", folder=RUBRIC_PATH.parent,
    parts=("README.md", "rubric.toml", "tests"), starter=pristine_tree,
    run=(".venv/bin/onenode bench --preset a1-1gpu --seq-len 4096 --out before.json --profile prof/   # one GPU",),
    submit=("```bash", ".venv/bin/onenode pack a1   # the public tests, the patch checked as the grader does: "
            "submission.tar.gz", "```", "",
            "Hand in `submission.tar.gz`: `submission.patch` and `report.ipynb`. The patch by hand:", "",
            "```bash", "git add -A starter_code/onenode   # new files too",
            'git diff --cached "$(git rev-list --max-parents=0 HEAD)" -- starter_code/onenode > submission.patch',
            "```"),
    secret_lines=reference_patch_lines, hints=RUBRIC_PATH.parent / "hints.toml",
)

A1 = Assignment(
    name="a1", label="A1", help="grade A1 submissions (a folder or archive, or a cohort)",
    submission_help="submission folder or .zip/.tar.gz archive", archives=True,
    rubric_path=RUBRIC_PATH, load_rubric=load_rubric, add_options=add_options, new_job=job_from_args, grade=grade,
    csv_columns=tables.csv_columns, table=tables.table, leaderboard_title="A1: a fast training stack",
    leaderboard_columns=tables.leaderboard_columns, leaderboard_plots=(("a1_throughput.png", tables.plot_throughput),),
    leaderboard_headline=tables.headline,
    handout=HANDOUT, demo=Demo(build_cohort, profile="cpu-tiny",
              help="the example cohort of examples/a1-cohort/cohort.toml, built from solutions/a1, graded on CPU"),
)
