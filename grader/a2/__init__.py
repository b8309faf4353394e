"""A2, pretraining within a token budget: audit a run, evaluate its checkpoint in the sandbox,
score it against the course's baseline evaluated in the same job.

An A2 submission is a folder (a run folder of `onenode train`, without `checkpoints/`):
    final/            the model in the transformers layout + its tokenizer (tokenizer.json or
                      onenode_tokenizer.json) + run_manifest.json
    recipe.yaml       the recipe it ran
    run_manifest.json tokens seen, steps, data-order digest, config, parameters
    metrics.jsonl     the training log
    report.ipynb      the report
    data/manifest.json (optional; with the shards, the grader checks them for evaluation text)

Nothing of the submission runs: `intake.py` checks the folder, `audit.py` reads JSON, YAML and
safetensors headers, `contamination.py` the submitted shards, and `evaluation.py` has the kit's
own evaluation code read the weights inside `grader.sandbox`, because a checkpoint is untrusted
input. `job.py` holds the suite and the baseline, `scoring.py` the points, `rubric.py` reads
`a2_pretrain/rubric.toml`, `tables.py` makes its rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..assignment import Assignment
from . import tables
from .job import A2Job, new_job, trained_run
from .rubric import RUBRIC_PATH, A2Rubric, load_rubric
from .scoring import grade

__all__ = ["A2", "trained_run"]  # solutions/a2/make_reference.py trains the reference run through trained_run


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", default=None, help="baseline checkpoint folder (default: the profile's)")


def job_from_args(rubric: A2Rubric, profile: str, workdir: Path, args: argparse.Namespace) -> A2Job:
    return new_job(rubric, profile, workdir, args.baseline)


A2 = Assignment(
    name="a2", label="A2", help="grade A2 submissions (a run folder, or a cohort of them)",
    submission_help="submission folder (a run folder with final/)", archives=False,
    rubric_path=RUBRIC_PATH, load_rubric=load_rubric, add_options=add_options, new_job=job_from_args, grade=grade,
    csv_columns=tables.csv_columns, table=tables.table, leaderboard_title="A2: pretraining within a token budget",
    leaderboard_columns=tables.leaderboard_columns,
    leaderboard_plots=(("a2_benchmarks.png", tables.plot_benchmarks), ("a2_loss.png", tables.plot_losses)),
)
