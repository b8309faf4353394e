"""`onenode pack`: what it writes is what the grader takes, and what the grader would refuse it
refuses first, in one line.

A1: in a repository laid out like the students' one (its first commit the handout), the
reference solution applied is packed into an archive whose patch the grader's intake takes and
applies to the kit's starter, giving the reference tree; a file the grader refuses (not .py, an
executable bit, a link) is refused by the pack command in one line, and no archive is written;
the public tests run against the packed tree, and a failing one is reported without stopping
the pack. A2: the hand-in list is one list: the handout's table and the release README are made
from it, the pack command and the grader's intake refuse a folder lacking any of it in one line
naming what, and a tiny run packed is a submission the grader's intake takes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from patched_copy import FULL_PATCH, git_apply, patched_tree

from grader.a2.intake import load_submission as load_a2_submission
from grader.errors import SubmissionError
from grader.rubric import KIT_ROOT
from grader.submission import check_patch, load_submission
from grader.submission import patched_tree as graders_patched_tree
from onenode.cli import main as onenode_main
from onenode.handin import A2_HAND_IN, HandInError, a2_missing, hand_in_table
from onenode.pack import pack_a1, pack_a2

# The public tests of the scratch repository: one that passes only when it runs against the
# repository's own starter_code (the tree being packed), and one the starter fails.
OWN_TREE_TEST = '''
from pathlib import Path

import onenode


def test_runs_against_the_packed_tree():
    assert Path(onenode.__file__).resolve().is_relative_to(Path(__file__).resolve().parents[2] / "starter_code")
'''
FAILING_TEST = "def test_the_starter_fails():\n    assert False, 'the starter fails this one'\n"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=student", "-c", "user.email=s@example.org", *args],
                   cwd=repo, check=True, capture_output=True)


@pytest.fixture(scope="module")
def handout(tmp_path_factory) -> Path:
    """A repository laid out like the A1 release, committed as the handout."""
    repo = tmp_path_factory.mktemp("handout") / "repo"
    shutil.copytree(KIT_ROOT / "starter_code", repo / "starter_code",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    shutil.copy2(KIT_ROOT / ".gitignore", repo / ".gitignore")
    shutil.copy2(KIT_ROOT / "solutions" / "a1" / "report.ipynb", repo / "report.ipynb")
    (repo / "a1_infra" / "tests").mkdir(parents=True)
    (repo / "a1_infra" / "tests" / "test_public.py").write_text(OWN_TREE_TEST)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "handout")
    return repo


@pytest.fixture
def solved(handout, tmp_path) -> Path:
    """The handout with the reference solution applied, and bytecode left behind."""
    repo = tmp_path / "repo"
    shutil.copytree(handout, repo)
    applied = git_apply(repo, FULL_PATCH)
    assert applied.returncode == 0, applied.stderr
    (repo / "starter_code" / "onenode" / "__pycache__").mkdir(exist_ok=True)
    (repo / "starter_code" / "onenode" / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"\x00bytecode")
    return repo


def _py_files(tree: Path) -> dict[str, bytes]:
    root = tree / "starter_code" / "onenode"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.py"))}


def test_a1_pack_of_the_reference_is_what_the_grader_takes(solved, tmp_path):
    said = pack_a1(solved, Path("submission.tar.gz"), Path("report.ipynb"))
    assert said.startswith("the public tests pass"), said
    submission = load_submission(solved / "submission.tar.gz", tmp_path / "intake")
    assert submission.changed_files == check_patch(FULL_PATCH.read_text())
    assert submission.notebook is not None
    assert json.loads(submission.notebook.read_text()) == json.loads((solved / "report.ipynb").read_text())
    graded = graders_patched_tree(submission, tmp_path / "tree")
    assert _py_files(graded) == _py_files(patched_tree(["submission"])), "the grader's tree is not the reference's"


@pytest.mark.parametrize("change,reason", [
    (lambda pkg: (pkg / "notes.txt").write_text("my notes\n"),
     "touches 'starter_code/onenode/notes.txt': only .py files under starter_code/onenode/ may change"),
    (lambda pkg: (pkg / "cli.py").chmod(0o755), "changes the mode of 'starter_code/onenode/cli.py'"),
    (lambda pkg: (pkg / "model" / "fast.py").symlink_to("moe.py"), "sets file mode 120000"),
], ids=["not-py", "executable", "symlink"])
def test_a1_pack_refuses_what_the_grader_refuses_in_one_line(solved, change, reason, monkeypatch, capsys):
    change(solved / "starter_code" / "onenode")
    monkeypatch.chdir(solved)
    assert onenode_main(["pack", "a1", "--skip-tests"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("onenode pack a1: ") and reason in error and len(error.strip().splitlines()) == 1, error
    assert not (solved / "submission.tar.gz").exists()


def test_a1_pack_says_a_public_test_fails_and_packs_anyway(solved):
    (solved / "a1_infra" / "tests" / "test_failing.py").write_text(FAILING_TEST)
    said = pack_a1(solved, Path("out/mine.tar.gz"), Path("report.ipynb"))
    assert said.startswith("some public tests fail"), said
    assert (solved / "out" / "mine.tar.gz").is_file()


def test_a1_pack_refuses_an_unchanged_handout_or_no_report(handout, capsys, monkeypatch):
    monkeypatch.chdir(handout)
    assert onenode_main(["pack", "a1", "--skip-tests"]) == 1
    assert "nothing to hand in" in capsys.readouterr().err
    assert onenode_main(["pack", "a1", "--skip-tests", "--report", "missing.ipynb"]) == 1
    assert "missing.ipynb not found" in capsys.readouterr().err


# -- A2 ----------------------------------------------------------------------------------------
def test_the_a2_hand_in_list_is_the_handouts_and_the_release_readmes():
    from grader.registry import ASSIGNMENTS
    from grader.release import student_readme

    table = "\n".join(hand_in_table())
    assert table in (KIT_ROOT / "a2_pretrain" / "README.md").read_text(), \
        "a2_pretrain/README.md's hand-in table is not onenode.handin.A2_HAND_IN's: paste hand_in_table() there"
    readme = student_readme(ASSIGNMENTS["a2"].handout, has_handout=True, has_tests=False)
    assert table in readme and "onenode pack a2" in readme
    assert '".[hf,data,hub,eval,course,dev]"' in readme and "before.json" not in readme
    assert "onenode pack a1" in student_readme(ASSIGNMENTS["a1"].handout, has_handout=True, has_tests=True)
    for doc in ("a1_infra/README.md", "a2_pretrain/README.md"):
        assert "onenode pack a" in (KIT_ROOT / doc).read_text(), f"{doc} does not name the pack command"


def _run_folder(folder: Path, data_source: str) -> Path:
    """A folder holding a file at every path of the hand-in list, its recipe training on `data_source`."""
    for item in A2_HAND_IN:
        path = folder / item.found_by.replace("*", "00000000")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    recipe = (KIT_ROOT / "a2_pretrain" / "recipes" / "tiny.yaml").read_text()
    assert "source: synthetic" in recipe
    data = "source: synthetic" if data_source == "synthetic" else f"source: {data_source}\n  path: data"
    (folder / "recipe.yaml").write_text(recipe.replace("source: synthetic", data))
    return folder


@pytest.mark.parametrize("removed,named", [
    ("checkpoints", "checkpoints/step_*/meta.json"), ("data", "data/manifest.json"),
    ("final", "final/config.json"), ("report.ipynb", "report.ipynb"), ("metrics.jsonl", "metrics.jsonl"),
])
def test_the_grader_refuses_an_incomplete_a2_submission_in_one_line_naming_what(tmp_path, removed, named):
    folder = _run_folder(tmp_path / "sub", "shards")
    assert a2_missing(folder) == []
    target = folder / removed
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    assert a2_missing(folder) == [named]
    with pytest.raises(SubmissionError, match=r"^the A2 submission lacks .*onenode pack a2") as refused:
        load_a2_submission(folder)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_a2_data_and_report_are_needed_only_where_they_are_used(tmp_path):
    folder = _run_folder(tmp_path / "sub", "synthetic")
    shutil.rmtree(folder / "data")
    (folder / "report.ipynb").unlink()
    assert a2_missing(folder, notebook=False) == []  # synthetic tokens; a job that grades no notebook
    assert a2_missing(folder) == ["report.ipynb"]


@pytest.mark.slow  # trains the tiny recipe once on the A2 stack (cached), about a minute on 2 cores
def test_a2_pack_of_a_tiny_run_is_a_submission_the_grader_takes(tmp_path, monkeypatch, capsys):
    from redteam.a2_forgeries import SMALL, TINY

    from grader.a2.job import trained_run

    run = trained_run(TINY, SMALL)
    report = KIT_ROOT / "assignments" / "source" / "a2" / "report.ipynb"
    said = pack_a2(run, tmp_path / "submission", report)
    assert "no data (synthetic tokens)" in said
    sub = load_a2_submission(tmp_path / "submission")
    assert sub.chain and sub.chain[-1].step == sub.manifest["steps"] and sub.notebook is not None
    assert sorted(os.listdir(tmp_path / "submission")) == sorted(
        item.name.rstrip("/") for item in A2_HAND_IN if item.name != "data/")
    with pytest.raises(HandInError, match="not an empty folder"):
        pack_a2(run, tmp_path / "submission", report)
    partial = tmp_path / "partial-run"
    shutil.copytree(run, partial, ignore=shutil.ignore_patterns("metrics.jsonl"))
    monkeypatch.chdir(tmp_path)
    assert onenode_main(["pack", "a2", str(partial), "--out", "again", "--report", str(report)]) == 1
    error = capsys.readouterr().err
    assert "lacks metrics.jsonl" in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "again").exists()
