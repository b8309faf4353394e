"""The one interface between the grader's core and an assignment.

torchtitan's pattern (a spec per model, one trainer): each assignment package builds one
`Assignment` (`grader/a1/__init__.py`, `grader/a2/__init__.py`), `grader/registry.py` lists
them, and the core (`cohort.py`, `cli.py`, `leaderboard.py`) drives any of them the same way:
intake, atomic and resumable cohort grading, results.json and feedback, cohort.csv, the terminal
table, the leaderboard, the command line, the student release, the hint ladders, the grade
sheet and the demo. A new assignment is a new package and one line there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .rubric import Profile, Rubric


@dataclass
class Job:
    """One grading run of an assignment, shared by all its submissions."""

    rubric: Rubric
    profile: Profile
    seed: int  # recorded in every result: what the job drew its workloads from
    workdir: Path  # grader-private scratch of the job


@dataclass
class Graded:
    """What grading one submission gave, before the core writes it out."""

    tests: list[dict] = field(default_factory=list)  # Gradescope test entries
    leaderboard: list[dict] = field(default_factory=list)  # Gradescope leaderboard entries
    measurements: dict = field(default_factory=dict)  # for cohort.csv and the leaderboard (extra_data.numbers)
    failures: dict[str, str] = field(default_factory=dict)  # run -> what went wrong, for the feedback
    output: str = ""  # the results' top line
    extra_data: dict = field(default_factory=dict)  # more of results.json's extra_data


def no_secret_lines(starter: Path) -> set[str]:
    """An assignment whose release has no lines to hold back beyond its hint ladders."""
    return set()


@dataclass(frozen=True)
class Handout:
    """What `onenode-grade release NAME` gives students besides the files every release shares."""

    title: str  # the student README's heading
    folder: Path  # the handout folder in the kit; the release names it the same
    parts: tuple[str, ...]  # what of `folder` students get (missing ones are skipped)
    starter: Callable[[Path], Path]  # writes the starter students get at DEST/starter_code and returns that
    # the README's "Submit" section, as Markdown lines, or what makes them when the release is built
    submit: tuple[str, ...] | Callable[[], tuple[str, ...]]
    run: tuple[str, ...] = ()  # commands the README's "Run" block adds after the public tests
    extras: str = "hf,data,course,dev"  # the extras of pyproject.toml the README's install names
    # the bundle's starter_code -> lines that must not ship (a leak check beside the hints')
    secret_lines: Callable[[Path], set[str]] = no_secret_lines
    hints: Path | None = None  # hints.toml: ladders the instructor posts one rung at a time; never shipped


@dataclass(frozen=True)
class Demo:
    """An example cohort that `onenode-grade demo NAME` builds and grades."""

    build_cohort: Callable[[Path], object]  # writes one submission per entry under the folder given
    profile: str  # the profile it grades on unless --profile says otherwise
    help: str  # what it is, for `onenode-grade demo --help`


@dataclass(frozen=True)
class Assignment:
    """An assignment as the core sees it."""

    name: str  # its command, `onenode-grade NAME`
    label: str  # "A1": results.json's extra_data["assignment"] and the leaderboard's section
    help: str  # its line in `onenode-grade --help`
    submission_help: str  # what SUBMISSION is
    archives: bool  # whether a submission may be an archive as well as a folder
    rubric_path: Path
    load_rubric: Callable[[Path], Rubric]
    add_options: Callable[[argparse.ArgumentParser], None]  # its command's options beyond the shared ones
    new_job: Callable[[Rubric, str, Path, argparse.Namespace], Job]  # (rubric, profile, workdir, the command's args)
    # (job, submission, a private scratch folder for it, its logs/) -> what it earned; raises SubmissionError
    grade: Callable[[Job, Path, Path, Path], Graded]
    csv_columns: Callable[[dict], dict]  # a results.json -> its cohort.csv columns between the score and the note
    table: Callable[[list[dict]], list[list[str]]]  # cohort.csv rows -> the terminal table, header first
    leaderboard_title: str
    # its entries -> [(header, read a results.json, format[, read the standard error shown as "± e"])]
    leaderboard_columns: Callable[[list], list[tuple]]
    handout: Handout
    leaderboard_plots: tuple[tuple[str, Callable], ...] = ()  # (PNG name, plot(entries, path, pyplot) -> drawn)
    # its entries of one profile -> the lines above their table (headline figures, what is not scored)
    leaderboard_headline: Callable[[list], list[str]] | None = None
    demo: Demo | None = None
    # the nbgrader source folder of its report.ipynb (None: the kit's assignments/source/NAME/);
    # its `grade` passes the same to `notebook.grade`
    report_source: Path | None = None
