"""A1, a fast training stack: a patch to the starter, graded on the three slow paths it fixes.

`job.py` runs the unpatched starter once as the job's reference, `scoring.py` grades each part
of a submission against it (`compare.py`: the comparisons; `harness.py`: what runs in the
sandboxed child), `rubric.py` reads `a1_infra/rubric.toml`, `tables.py` makes its rows, and
`demo.py` builds the example cohort of `onenode-grade demo`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..assignment import Assignment
from . import tables
from .job import A1Job, new_job
from .rubric import RUBRIC_PATH, A1Rubric, load_rubric
from .scoring import grade

STARTER_LOGS = ".starter-logs"  # in OUT: the logs of the starter's reference runs


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="grading seed (default: random, recorded in results)")


def job_from_args(rubric: A1Rubric, profile: str, workdir: Path, args: argparse.Namespace) -> A1Job:
    """The job of `onenode-grade a1`: the starter's logs in OUT/.starter-logs."""
    return new_job(rubric, profile, workdir, Path(args.out) / STARTER_LOGS, seed=args.seed,
                   notebooks=not args.no_notebook)


A1 = Assignment(
    name="a1", label="A1", help="grade A1 submissions (a folder or archive, or a cohort)",
    submission_help="submission folder or .zip/.tar.gz archive", archives=True,
    rubric_path=RUBRIC_PATH, load_rubric=load_rubric, add_options=add_options, new_job=job_from_args, grade=grade,
    csv_columns=tables.csv_columns, table=tables.table, leaderboard_title="A1: a fast training stack",
    leaderboard_columns=tables.leaderboard_columns, leaderboard_plots=(("a1_throughput.png", tables.plot_throughput),),
)
