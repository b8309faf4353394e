"""A2, pretraining within a token budget: audit a run, evaluate its checkpoint in the sandbox,
score it against the course's baseline evaluated in the same job.

An A2 submission is a folder (the run folder of `onenode train`):
    final/            the model in the transformers layout + its tokenizer (tokenizer.json or
                      onenode_tokenizer.json) + run_manifest.json
    checkpoints/      every checkpoint from step 0 (the chain the grader replays)
    recipe.yaml       the recipe it ran
    run_manifest.json tokens seen, steps, data-order digest, config, parameters
    metrics.jsonl     the training log
    report.ipynb      the report
    data/             the data folder it trained on (manifest.json and the shards; none for
                      synthetic tokens)

Nothing of the submission's code runs. The verification is the kit's (`onenode.verify`, the code
`onenode verify` runs on a student's own run), imported from the grader's pristine copy:
`intake.py` turns its refusal of the folder into the submission's zero, `onenode.verify.audit`
reads JSON, YAML and safetensors headers and hashes the shards, `replay.py` runs the replay
harness (`onenode.verify.replay_harness`) of the grader's pristine A2 stack inside
`grader.sandbox` to re-create the initialisation, hash every checkpoint, recompute the data order
and replay spans, `onenode.verify.contamination` scans the shards trained on, and `evaluation.py`
has the kit's own evaluation code read the weights in the sandbox: checkpoints are untrusted
input. `job.py` holds the suite, its text, the baseline and the A2 stack, `scoring.py` the points,
`rubric.py` reads `a2_pretrain/rubric.toml`, `tables.py` makes its rows.
Students start from the fixed stack: the starter with the reference A1 patch.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from ..a1 import solution_starter
from ..assignment import Assignment, Handout
from ..errors import GraderError
from . import tables
from .job import A2Job, new_job, trained_run
from .rubric import RUBRIC_PATH, A2Rubric, load_rubric
from .scoring import grade

__all__ = ["A2", "trained_run"]  # solutions/a2/make_reference.py trains the reference run through trained_run


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", default=None, help="baseline checkpoint folder (default: the profile's)")
    parser.add_argument("--seed", type=int, default=None,
                        help="grading seed: the spans of each run replayed (default: random, recorded in results)")
    parser.add_argument("--verify-only", action="store_true",
                        help="the run's verification alone, no evaluation and no baseline: check a short run of "
                             "your recipe before the long one")


def job_from_args(rubric: A2Rubric, profile: str, workdir: Path, args: argparse.Namespace) -> A2Job:
    if importlib.util.find_spec("lm_eval") is None:  # before any submission: else each fails on its own
        raise GraderError("A2 grading needs lm-eval (it evaluates the runs, and reads the suite's text for the "
                          "contamination check, --verify-only too): pip install -e '.[eval]' (make setup installs it)")
    job = new_job(rubric, profile, workdir, args.baseline, args.seed, notebooks=not args.no_notebook)
    job.evaluate = not args.verify_only
    return job


def submit_lines() -> tuple[str, ...]:
    """The release README's Submit section: the verify and pack commands and the hand-in list,
    which the intake refuses an incomplete submission by (`onenode.handin.A2_HAND_IN`)."""
    from onenode.handin import hand_in_table

    return ("One folder: the run folder that `onenode train` wrote, the data folder it trained on, and your "
            "report. `onenode verify` runs the grader's verification of the run on your install (passing it is "
            "necessary, not sufficient: the grading replays spans of its own choosing and scores the evaluation); "
            "`onenode pack a2` checks the run as the grader's intake does and copies them into it; hand it in on the "
            "node's shared storage, as the course says.", "",
            "```bash", ".venv/bin/onenode verify runs/mine --profile h100x8",
            ".venv/bin/onenode pack a2 runs/mine --out submission", "```", "", *hand_in_table())


HANDOUT = Handout(
    title="A2: pretrain your own model", folder=RUBRIC_PATH.parent,
    parts=("README.md", "rubric.toml", "recipes", "tests"), starter=solution_starter,
    run=(".venv/bin/onenode train a2_pretrain/recipes/tiny.yaml --out runs/tiny   # a recipe end to end on CPU",),
    submit=submit_lines, extras="hf,data,hub,eval,course,dev",
)

A2 = Assignment(
    name="a2", label="A2", help="grade A2 submissions (a run folder, or a cohort of them)",
    submission_help="submission folder (a run folder with final/)", archives=False,
    rubric_path=RUBRIC_PATH, load_rubric=load_rubric, add_options=add_options, new_job=job_from_args, grade=grade,
    csv_columns=tables.csv_columns, table=tables.table, leaderboard_title="A2: pretraining within a token budget",
    leaderboard_columns=tables.leaderboard_columns,
    leaderboard_plots=(("a2_benchmarks.png", tables.plot_benchmarks), ("a2_loss.png", tables.plot_losses)),
    handout=HANDOUT,
)
