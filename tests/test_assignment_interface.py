"""The grader's core drives any registered assignment through `Assignment` alone.

A made-up A3 is written here as a package in a temporary folder, then registered with one line
(`ASSIGNMENTS["a3"] = A3`). With no change to `grader/`, its command and its demo are listed, its
demo cohort is graded, its hint ladder is served and withheld from its release with its other
secrets, its release is built, and its grade sheet is exported.
"""

import csv
import importlib
import json
import sys

import pytest

from grader import hints
from grader.cli import build_parser, main
from grader.export import results_assignment
from grader.registry import ASSIGNMENTS
from grader.release import release, withheld_lines

SECRET = "the answer is forty-two, worked out the long way"
HINT = "Think of a number between forty and fifty, then think again."

PACKAGE = '''
"""A3: write the answer in answer.txt."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grader.assignment import Assignment, Demo, Graded, Handout, Job
from grader.errors import SubmissionError
from grader.report import test_entry
from grader.rubric import Profile, Rubric

HERE = Path(__file__).parent
SECRET = __SECRET__


@dataclass(frozen=True)
class A3Rubric(Rubric):
    def zero_tests(self, reason):
        return [test_entry("Answer", 0, 2, reason, "answer")]


@dataclass
class A3Job(Job):
    answer: str = "42"


def load_rubric(path):
    return A3Rubric({"cpu": Profile("cpu", "any CPU", "cpu", 1, 60.0, 1024)})


def add_options(parser):
    parser.add_argument("--answer-key", default="42", help="the right answer")


def new_job(rubric, profile, workdir, args):
    return A3Job(rubric, rubric.profile(profile), 0, workdir, args.answer_key)


def grade(job, path, work, logs):
    if not (path / "answer.txt").is_file():
        raise SubmissionError("no answer.txt: add it and resubmit")
    right = (path / "answer.txt").read_text().strip() == job.answer
    return Graded(tests=[test_entry("Answer", 2 if right else 0, 2, "right" if right else "wrong", "answer")],
                  measurements={"right": right}, output="right" if right else "wrong")


def build_cohort(dest):
    for name, answer in (("ann", "42"), ("bob", "41")):
        (dest / name).mkdir(parents=True)
        (dest / name / "answer.txt").write_text(answer)


def starter(dest):
    (dest / "starter_code" / "onenode").mkdir(parents=True)
    (dest / "starter_code" / "onenode" / "__init__.py").write_text('"""The A3 starter."""\\n')
    return dest / "starter_code"


A3 = Assignment(
    name="a3", label="A3", help="grade A3 answers", submission_help="a folder with answer.txt", archives=False,
    rubric_path=HERE / "a3_answer" / "rubric.toml", load_rubric=load_rubric, add_options=add_options,
    new_job=new_job, grade=grade, csv_columns=lambda r: {"right": r["extra_data"]["numbers"]["right"]},
    table=lambda rows: [["name", "score"]] + [[r["name"], str(r["score"])] for r in rows],
    leaderboard_title="A3: the answer", leaderboard_columns=lambda entries: [],
    handout=Handout(title="A3: find the answer", folder=HERE / "a3_answer", parts=("README.md", "rubric.toml"),
                    starter=starter, submit=("Hand in `answer.txt` and `report.ipynb`.",),
                    secret_lines=lambda starter_code: {SECRET}, hints=HERE / "hints.toml"),
    report_source=HERE / "source", demo=Demo(build_cohort, profile="cpu", help="two answers, one right"),
)
'''

CHECK_CELL = {"grade": True, "grade_id": "check", "points": 1, "locked": True, "schema_version": 3,
              "solution": False, "task": False}
NOTEBOOK = {
    "cells": [{"id": "check", "cell_type": "code", "execution_count": None, "outputs": [],
               "source": "assert 6 * 7 == 42", "metadata": {"nbgrader": CHECK_CELL}}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                 "language_info": {"name": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}


@pytest.fixture
def a3(tmp_path, monkeypatch):
    """The A3 package, importable as `fake_a3`, and its one line in the registry."""
    package = tmp_path / "packages" / "fake_a3"
    (package / "a3_answer").mkdir(parents=True)
    (package / "source").mkdir()
    (package / "__init__.py").write_text(PACKAGE.replace("__SECRET__", repr(SECRET)))
    (package / "a3_answer" / "README.md").write_text("# A3\n\nWrite the answer in `answer.txt`.\n")
    (package / "a3_answer" / "rubric.toml").write_text("[points]\nanswer = 2\n")
    (package / "hints.toml").write_text(f'[part1]\ntitle = "Part 1: the answer"\nrungs = ["{HINT}"]\n')
    (package / "source" / "report.ipynb").write_text(json.dumps(NOTEBOOK))
    monkeypatch.syspath_prepend(str(tmp_path / "packages"))
    monkeypatch.delitem(sys.modules, "fake_a3", raising=False)
    A3 = importlib.import_module("fake_a3").A3
    monkeypatch.setitem(ASSIGNMENTS, "a3", A3)  # the registry line an A3 adds to grader/registry.py
    yield A3
    sys.modules.pop("fake_a3", None)


def _choices(parser, command: str, dest: str) -> list[str]:
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return list(next(a for a in sub._actions if a.dest == dest).choices)


def test_a_registered_assignment_gets_its_command_demo_and_hints(a3, tmp_path, capsys):
    parser = build_parser()
    assert "a3" in next(a for a in parser._actions if a.dest == "command").choices
    assert _choices(parser, "demo", "assignment") == ["a1", "a3"]
    assert parser.parse_args(["demo", "--out", "x"]).assignment == "a1", "the first registered demo stays the default"
    assert "a3" in _choices(parser, "release", "assignment") and "a3" in _choices(parser, "hints", "assignment")

    assert main(["demo", "a3", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    results = {name: json.loads((tmp_path / "demo" / "results" / name / "results.json").read_text())
               for name in ("ann", "bob")}
    assert {name: r["score"] for name, r in results.items()} == {"ann": 2, "bob": 0}
    assert results["ann"]["extra_data"]["assignment"] == "A3"
    assert "right" in (tmp_path / "demo" / "results" / "cohort.csv").read_text()
    assert main(["demo", "a3", "--out", str(tmp_path / "demo41"), "--quiet", "--answer-key", "41", "--force"]) == 0
    assert json.loads((tmp_path / "demo41" / "results" / "bob" / "results.json").read_text())["score"] == 2

    capsys.readouterr()
    assert main(["hints", "a3", "--part", "1", "--rung", "1"]) == 0
    assert capsys.readouterr().out == f"**Part 1: the answer, hint 1 of 1**\n\n{HINT}\n"
    assert hints.secret_lines(a3) == {HINT}
    assert withheld_lines(a3, tmp_path / "starter_code") == {HINT, SECRET}


def test_the_grade_sheet_reads_the_assignment_from_the_results(a3, tmp_path):
    def graded(name: str, label: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"extra_data": {"assignment": label}}))

    graded("ann", "A3")
    graded("bob", "A3")
    assert results_assignment(tmp_path) == "a3"
    graded("cyd", "A1")
    with pytest.raises(ValueError, match="pass --assignment"):
        results_assignment(tmp_path)


@pytest.mark.slow
def test_a_registered_assignment_releases_and_exports(a3, tmp_path):
    """nbgrader runs: the release of A3, then the grade sheet of its demo cohort, the assignment
    read from the results."""
    pytest.importorskip("nbgrader", reason="the course extra: pip install -e '.[course]'")
    bundle = release(a3, tmp_path / "student", tmp_path / "course")
    assert (bundle / "a3_answer" / "README.md").read_text() == (a3.handout.folder / "README.md").read_text()
    assert (bundle / "report.ipynb").is_file() and (bundle / "starter_code" / "onenode" / "__init__.py").is_file()
    student_readme = (bundle / "README.md").read_text()
    assert student_readme.startswith("# OneNode A3: find the answer") and "Hand in `answer.txt`" in student_readme
    assert "hints.toml" not in {p.name for p in bundle.rglob("*")}

    assert main(["demo", "a3", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    sheet = tmp_path / "grades.csv"
    assert main(["export", "--course", str(tmp_path / "course"), "--results", str(tmp_path / "demo" / "results"),
                 "--csv", str(sheet)]) == 0
    with sheet.open() as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    assert {name: (float(row["parts_score"]), float(row["notebook_max"])) for name, row in rows.items()} == {
        "ann": (2, 1), "bob": (0, 1)}
