"""Submission intake: every bad submission gets one clear line, a good one applies cleanly."""

from __future__ import annotations

import csv
import difflib
import io
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from grader.cli import main
from grader.submission import Submission, SubmissionError, check_patch, load_submission, patched_tree, pristine_tree

ROOT = Path(__file__).resolve().parents[1]
MOE = "starter_code/onenode/model/moe.py"


def make_patch(path: str, old: str, new: str) -> str:
    """A `git diff`-style patch changing `path` from `old` to `new`."""
    body = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def good_patch() -> str:
    old = (ROOT / MOE).read_text()
    return make_patch(MOE, old, old.replace("import torch\n", "import torch  # patched\n", 1))


def submission_folder(tmp_path: Path, patch: str | bytes | None, name: str = "group1") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    if patch is not None:
        data = patch.encode() if isinstance(patch, str) else patch
        (folder / "submission.patch").write_bytes(data)
    (folder / "report.ipynb").write_text(json.dumps({"cells": [], "nbformat": 4, "nbformat_minor": 5, "metadata": {}}))
    return folder


def test_good_patch_applies_in_a_scratch_copy(tmp_path):
    sub = load_submission(submission_folder(tmp_path, good_patch()), tmp_path / "work")
    assert sub.changed_files == [MOE] and sub.notebook is not None
    tree = patched_tree(sub, tmp_path / "work" / "tree")
    assert "# patched" in (tree / MOE).read_text()
    assert "# patched" not in (ROOT / MOE).read_text()  # the kit itself is untouched


def test_empty_patch_is_the_unchanged_starter(tmp_path):
    sub = load_submission(submission_folder(tmp_path, ""), tmp_path / "work")
    tree = patched_tree(sub, tmp_path / "work" / "tree")
    assert sub.changed_files == [] and (tree / MOE).read_text() == (ROOT / MOE).read_text()


@pytest.mark.parametrize("patch, words", [
    (None, "no submission.patch"),
    (b"diff --git a/x b/x\n\xff\xfe broken", "not UTF-8"),
    ("just some text\n", "holds no diff"),
    (make_patch("tests/test_x.py", "a\n", "b\n"), "only .py files under starter_code/onenode/"),
    (make_patch("starter_code/onenode/data/notes.txt", "a\n", "b\n"), "only .py files"),
    (make_patch("starter_code/onenode/../../evil.py", "a\n", "b\n"), "'..'"),
    ("diff --git a/starter_code/onenode/x.py b/starter_code/onenode/x.py\nnew file mode 120000\n"
     "--- /dev/null\n+++ b/starter_code/onenode/x.py\n@@ -0,0 +1 @@\n+/etc/passwd\n", "120000"),
    ("diff --git a/starter_code/onenode/cli.py b/starter_code/onenode/cli.py\nsimilarity index 100%\n"
     "rename from starter_code/onenode/cli.py\nrename to grader/cli.py\n", "only .py files"),
    ("diff --git a/starter_code/onenode/a.py b/starter_code/onenode/a.py\nGIT binary patch\nliteral 3\n", "binary"),
])
def test_bad_patches_get_one_line_reasons(tmp_path, patch, words):
    with pytest.raises(SubmissionError) as info:
        load_submission(submission_folder(tmp_path, patch), tmp_path / "work")
    message = str(info.value)
    assert words in message and "\n" not in message


def test_patch_that_does_not_apply(tmp_path):
    old = (ROOT / MOE).read_text()
    patch = make_patch(MOE, "not the starter's text\n" + old, "changed\n" + old)
    sub = load_submission(submission_folder(tmp_path, patch), tmp_path / "work")
    with pytest.raises(SubmissionError, match="does not apply to this kit's starter_code"):
        patched_tree(sub, tmp_path / "work" / "tree")


def git_patch(tmp_path: Path, edit) -> str:
    """What `git diff --binary` makes of `edit(root)` done to a copy of the kit's starter_code
    (paths relative to `root`, the folder holding `starter_code/`)."""
    root = pristine_tree(tmp_path / "repo")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "core.fileMode=true"]
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path.resolve()))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "starter"]):
        subprocess.run(git + args, cwd=root, env=env, check=True, capture_output=True)
    edit(root)
    subprocess.run(git + ["add", "-A"], cwd=root, env=env, check=True, capture_output=True)
    return subprocess.run(git + ["diff", "--cached", "--binary"], cwd=root, env=env, check=True,
                          capture_output=True, text=True).stdout


def write(path: str, data: str | bytes = "print('hi')\n"):
    def edit(root: Path) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data.encode() if isinstance(data, str) else data)
    return edit


def chmod_x(path: str):
    return lambda root: (root / path).chmod(0o755)


def symlink(path: str, target: str):
    return lambda root: (root / path).symlink_to(target)


def delete(path: str):
    return lambda root: (root / path).unlink()


def changed_paths(tree: Path) -> set[str]:
    """The files of `tree`'s starter_code that differ from the kit's, or exist in one only."""
    def files(side: Path) -> dict[str, bytes]:
        return {f"starter_code/{p.relative_to(side)}": p.read_bytes() for p in side.rglob("*")
                if p.is_file() and not any(part == "__pycache__" or part.endswith(".egg-info") for part in p.parts)}

    kit, applied = files(ROOT / "starter_code"), files(tree / "starter_code")
    return {path for path in kit.keys() | applied.keys() if kit.get(path) != applied.get(path)}


# Each applied tree a line-by-line reading of the patch could be fooled into: the applied tree
# decides, so these are handed to `patched_tree` without the text checks in front.
@pytest.mark.parametrize("edit, words", [
    (write("starter_code/sitecustomize.py"), "writes 'starter_code/sitecustomize.py' when applied: only .py files"),
    (write("starter_code/evil/__init__.py"), "writes 'starter_code/evil/__init__.py'"),
    (write("starter_code/onenode/hook.pth", "import os\n"), "writes 'starter_code/onenode/hook.pth'"),
    (write("evil.py"), "writes 'evil.py'"),
    (write("starter_code/onenode/data/configs/course_node.yaml", "steps: 1\n"),
     "writes 'starter_code/onenode/data/configs/course_node.yaml'"),
    (delete("starter_code/onenode/data/README.md"), "deletes 'starter_code/onenode/data/README.md'"),
    (symlink("starter_code/onenode/link.py", "../../solutions/a1/submission.patch"),
     "makes 'starter_code/onenode/link.py' a symlink"),
    (symlink("starter_code/onenode/up", ".."), "writes 'starter_code/onenode/up'"),
    (chmod_x(MOE), f"changes the mode of '{MOE}' (100644 -> 100755)"),
    (lambda root: (write("starter_code/onenode/run.py")(root), chmod_x("starter_code/onenode/run.py")(root)),
     "changes the mode of 'starter_code/onenode/run.py' (100644 -> 100755)"),
    (write("starter_code/onenode/blob.py", b"\x00\x01binary\xff"), "makes 'starter_code/onenode/blob.py' binary"),
])
def test_applied_tree_refuses_what_may_not_change(tmp_path, edit, words):
    patch = git_patch(tmp_path, edit)
    submission = Submission("group", patch, None, ["starter_code/onenode/model/moe.py"])
    with pytest.raises(SubmissionError) as info:
        patched_tree(submission, tmp_path / "work" / "tree")
    message = str(info.value)
    assert words in message and "\n" not in message


def test_applied_tree_allows_any_edit_of_the_package_sources(tmp_path):
    """New modules and subpackages, deletions and edits of .py files under starter_code/onenode/."""
    def edit(root: Path) -> None:
        write("starter_code/onenode/kernels/__init__.py", "")(root)
        write("starter_code/onenode/kernels/fused.py")(root)
        delete("starter_code/onenode/model/mlp.py")(root)
        (root / MOE).write_text((root / MOE).read_text() + "\n# tuned\n")

    sub = load_submission(submission_folder(tmp_path, git_patch(tmp_path, edit)), tmp_path / "work")
    tree = patched_tree(sub, tmp_path / "work" / "tree")
    expected = {"starter_code/onenode/kernels/__init__.py", "starter_code/onenode/kernels/fused.py",
                "starter_code/onenode/model/mlp.py", MOE}
    assert changed_paths(tree) == set(sub.changed_files) == expected


@pytest.mark.parametrize("patch", ["submission.patch", *(f"parts/{p.name}" for p in
                                                          sorted((ROOT / "solutions/a1/parts").glob("*.patch")))])
def test_reference_solution_patches_are_accepted(tmp_path, patch):
    folder = submission_folder(tmp_path, (ROOT / "solutions/a1" / patch).read_text())
    sub = load_submission(folder, tmp_path / "work")
    tree = patched_tree(sub, tmp_path / "work" / "tree")
    assert changed_paths(tree) == set(sub.changed_files) and sub.changed_files


def test_removed_line_looking_like_a_header_is_body():
    old = "x = 1\n-- not a header\n"
    patch = make_patch("starter_code/onenode/model/moe.py", old, "x = 1\n")
    assert "\n--- not a header" in patch
    assert check_patch(patch) == ["starter_code/onenode/model/moe.py"]


def test_archives(tmp_path):
    zipped = tmp_path / "group2.zip"
    with zipfile.ZipFile(zipped, "w") as zf:
        zf.writestr("group2/submission.patch", good_patch())
        zf.writestr("group2/report.ipynb", "{}")
    assert load_submission(zipped, tmp_path / "w1").changed_files == [MOE]

    empty = tmp_path / "empty.zip"
    zipfile.ZipFile(empty, "w").close()
    with pytest.raises(SubmissionError, match="is empty"):
        load_submission(empty, tmp_path / "w2")

    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tf:
        info = tarfile.TarInfo("../submission.patch")
        data = good_patch().encode()
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(SubmissionError, match="'..' path"):
        load_submission(evil, tmp_path / "w3")

    linked = tmp_path / "linked.tar.gz"
    with tarfile.open(linked, "w:gz") as tf:
        info = tarfile.TarInfo("submission.patch")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(info)
    with pytest.raises(SubmissionError, match="not a regular file"):
        load_submission(linked, tmp_path / "w4")

    garbage = tmp_path / "garbage.zip"
    garbage.write_bytes(b"not a zip at all")
    with pytest.raises(SubmissionError, match="not a readable archive"):
        load_submission(garbage, tmp_path / "w5")


def test_cli_writes_a_zero_with_the_reason(tmp_path, capsys):
    folder = submission_folder(tmp_path, None, name="nopatch")
    assert main(["a1", str(folder), "--profile", "cpu-tiny", "--out", str(tmp_path / "out"), "--quiet"]) == 1
    out = tmp_path / "out" / "nopatch"
    results = json.loads((out / "results.json").read_text())
    assert results["score"] == 0 and "no submission.patch" in results["output"]
    assert results["extra_data"]["not_graded"] == results["output"].removeprefix("Not graded: ")
    assert all(t["score"] == 0 for t in results["tests"])
    assert {"feedback.md", "feedback.html", "env.json"} <= {p.name for p in out.iterdir()}
    assert "no submission.patch" in (out / "feedback.md").read_text()
    assert json.loads((out / "env.json").read_text())["profile"]["name"] == "cpu-tiny"


def test_cli_rejects_an_unknown_profile(tmp_path, capsys):
    folder = submission_folder(tmp_path, "")
    assert main(["a1", str(folder), "--profile", "tpu-pod", "--out", str(tmp_path / "out")]) == 2
    assert "unknown profile 'tpu-pod'" in capsys.readouterr().err


def test_a_submission_that_could_not_be_graded_exits_1_with_its_reason_whole(tmp_path, capsys, monkeypatch):
    """A TA's script tells a zero from no grade: an empty folder, a patch of random text, an
    archive that is not one, a path that does not exist each exit 1, the reason printed whole
    (wrapped at words, never cut); a usage error exits 2."""
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: os.terminal_size((60, 24)))
    cohort = tmp_path / "cohort"
    cohort.mkdir()
    (cohort / "empty-team").mkdir()
    submission_folder(cohort, os.urandom(600).hex(), name="random-text")
    (cohort / "not-an-archive.zip").write_bytes(b"not a zip at all")
    args = ["--profile", "cpu-tiny", "--out", str(tmp_path / "out"), "--quiet", "--no-notebook"]
    assert main(["a1", "--cohort", str(cohort), *args]) == 1
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line for line in printed.splitlines()[1:4]}
    assert all(row.split()[1:6] == ["-"] * 5 and row.endswith("not graded (below)") for row in rows.values())
    reasons = printed[printed.index("Not graded (their zeros are not grades):"):]
    for name in ("empty-team", "random-text", "not-an-archive"):
        reason = json.loads((tmp_path / "out" / name / "results.json").read_text())["extra_data"]["not_graded"]
        assert " ".join(f"{name}: {reason}".split()) in " ".join(reasons.split()), reasons
    wrapped = [line for line in reasons.splitlines() if line.startswith("  ")]
    assert len(wrapped) > 3 and all(len(line) <= 60 or len(line.split()) == 1 for line in wrapped), reasons
    assert printed.splitlines()[-1].startswith("0 of 3 submissions graded on cpu-tiny")
    with open(tmp_path / "out" / "cohort.csv") as f:
        assert {row["graded"] for row in csv.DictReader(f)} == {"False"}
    assert main(["a1", str(tmp_path / "nonexistent"), *args]) == 1
    assert f"nonexistent: {tmp_path / 'nonexistent'} does not exist" in " ".join(capsys.readouterr().out.split())
    assert main(["a1", "--cohort", str(tmp_path / "nonexistent"), *args]) == 2
    assert main(["a1", *args]) == 2
    assert "pass either one SUBMISSION or --cohort DIR" in capsys.readouterr().err


def test_the_grading_commands_help_lists_the_exit_codes(capsys):
    for command in (["--help"], ["a1", "--help"], ["a2", "--help"], ["demo", "--help"]):
        with pytest.raises(SystemExit):
            main(command)
        text = capsys.readouterr().out
        assert "Exit status" in text and "1  a submission could not be graded" in text and "3  grading stopped" in text
