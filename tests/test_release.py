"""The student release and the notebook's grading cycle.

Fast: the leak check catches what it must, the dead-link check finds links to nothing and out of
the bundle, the records a handout links are copied with it, the student pyproject has no grader,
bad arguments fail before anything is built. Slow (nbgrader runs): the A1 release bundle leaks
nothing, installs, and every relative link of its Markdown files resolves inside it; one full
cycle on CPU (release, two students, sandboxed autograde, feedback, export, a manual grade, export
again); the A2 release carries the fixed stack and its links resolve too.
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from grader import hints, notebook, report
from grader.export import export
from grader.registry import ASSIGNMENTS
from grader.release import LOCK, ReleaseError, copy_linked_records, dead_links, leaks, release, student_pyproject
from grader.report import results_json
from grader.rubric import tomllib

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
PATCH = SOLUTIONS / "a1" / "submission.patch"


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _links_to_nothing(bundle: Path) -> list[str]:
    """The spec, written out again here: every `](target)` of a Markdown file in the bundle that
    is not a URL or an anchor must name a file inside the bundle."""
    bundle = bundle.resolve()
    dead = []
    for md in bundle.rglob("*.md"):
        for target in re.findall(r"\]\(([^\s)]+)", md.read_text()):
            target = target.split("#")[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            resolved = (md.parent / target).resolve()
            if not resolved.is_relative_to(bundle) or not resolved.is_file():
                dead.append(f"{md.relative_to(bundle)}: {target}")
    return dead


def _added_reference_lines(starter: Path) -> set[str]:
    """The spec, written out again here: every line the reference patch adds that is longer
    than 30 characters and appears nowhere in the starter."""
    starter = "\n".join(p.read_text(errors="replace") for p in _files(starter))
    added = {ln[1:].strip() for ln in PATCH.read_text().splitlines() if ln.startswith("+") and not ln.startswith("+++")}
    return {ln for ln in added if len(ln) > 30 and ln not in starter}


# -- fast --------------------------------------------------------------------------------------
def test_leak_check_finds_markers_and_reference_lines(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text('ok = 1\nsource = ["    return torch._grouped_mm(x, w, offs=offsets)\\n"]\n')
    (tmp_path / "b.ipynb").write_text('{"source": "### BEGIN HIDDEN TESTS\\n"}')
    (tmp_path / "c.txt").write_text("nothing to see\n")
    found = leaks(tmp_path, {"return torch._grouped_mm(x, w, offs=offsets)"})
    assert any(f.startswith("a/x.py: secret line") for f in found)
    assert any(f.startswith("b.ipynb: 'BEGIN HIDDEN TESTS'") for f in found)
    assert not any(f.startswith("c.txt") for f in found)


def test_dead_link_check_finds_links_to_nothing_and_out_of_the_bundle(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "docs").mkdir(parents=True)
    (bundle / "record.json").write_text("{}")
    (bundle / "docs" / "b.md").write_text("# B\n")
    (tmp_path / "outside.md").write_text("exists, but not in the bundle\n")
    (bundle / "docs" / "a.md").write_text(
        '[ok](../record.json "results.mfu") [ok](b.md#b) [same page](#top) [web](https://example.org/x.md)\n'
        "[gone](../missing.json) [out](../../outside.md) [folder](../docs)\n")
    assert sorted(dead_links(bundle)) == ["docs/a.md: ../../outside.md", "docs/a.md: ../docs",
                                          "docs/a.md: ../missing.json"]
    assert sorted(_links_to_nothing(bundle)) == sorted(dead_links(bundle))


@pytest.mark.parametrize("folder", [a.handout.folder.name for a in ASSIGNMENTS.values()])
def test_the_records_a_handout_links_travel_with_it(tmp_path, folder):
    """The handout and the starter as the release copies them, then the records the handout links:
    every link resolves."""
    stage = tmp_path / "stage"
    for shipped in (folder, "starter_code"):
        shutil.copytree(ROOT / shipped, stage / shipped, ignore=shutil.ignore_patterns("__pycache__"))
    text = (stage / folder / "README.md").read_text()
    targets = re.findall(r"\]\((\.\./benchmarks/results/[^\s)]+)", text)
    linked = {os.path.normpath(f"{folder}/{target}") for target in targets}
    assert linked, f"{folder}/README.md links no record"
    assert _links_to_nothing(stage), "before the records are copied, their links are dead"
    assert {str(p) for p in copy_linked_records(stage)} == linked
    assert _links_to_nothing(stage) == [] and dead_links(stage) == []
    assert (stage / "benchmarks" / "results" / "README.md").is_file()


def test_the_slow_paths_describe_what_they_do_not_the_fix():
    """Issue 17: the starter's docstrings at the three slow paths say what the code does and what
    is measured; the ways out stay in the hint ladder."""
    prescriptions = ("grouped gemm", "grouped_mm", "a1's fix", "slow on purpose", "host sync (", "stack the experts",
                     "should be", "instead of")
    files = ["model/moe.py", "model/hf_io.py", "parallel/pipeline.py", "parallel/expert_parallel.py"]
    found = [(name, phrase) for name in files
             for phrase in prescriptions if phrase in (ROOT / "starter_code" / "onenode" / name).read_text().lower()]
    assert found == []


def test_hints_come_one_rung_at_a_time_and_never_ship(tmp_path, monkeypatch, capsys):
    from grader.cli import main

    assert main(["hints", "a1", "--part", "2", "--rung", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("**Part 2: expert parallelism, hint 1 of 4**")
    assert hints.rung(ASSIGNMENTS["a1"], 2, 4) not in first and "GroupedExperts" not in first
    assert main(["hints", "a1", "--part", "2", "--rung", "9"]) == 2
    assert "has rungs 1 to 4, not 9" in capsys.readouterr().err
    handout = (ROOT / "a1_infra" / "README.md").read_text()
    assert not [line for line in hints.secret_lines(ASSIGNMENTS["a1"]) if line in handout]
    assert "hints.toml" not in ASSIGNMENTS["a1"].handout.parts


def test_student_pyproject_has_no_grader():
    text = student_pyproject((ROOT / "pyproject.toml").read_text(), ["a1_infra/tests"])
    project = tomllib.loads(text)
    assert "onenode-grade" not in project["project"]["scripts"] and "onenode" in project["project"]["scripts"]
    assert project["tool"]["setuptools"]["packages"]["find"] == {"where": ["starter_code"],
                                                                 "include": ["onenode", "onenode.*"]}
    assert project["tool"]["pytest"]["ini_options"]["testpaths"] == ["a1_infra/tests"]
    with pytest.raises(ReleaseError, match="update grader/release.py"):
        student_pyproject("[project]\nname = 'x'\n", [])


def test_release_refuses_bad_places(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ReleaseError, match="--force"):
        release(ASSIGNMENTS["a1"], tmp_path / "out", tmp_path / "course")
    with pytest.raises(ReleaseError, match="must not contain each other"):
        release(ASSIGNMENTS["a1"], tmp_path / "new", tmp_path / "new" / "course")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine" and not (tmp_path / "course").exists()


def _pins(lock: str) -> dict[str, str]:
    """name -> version of every `name==version` line of a lock (its comments skipped)."""
    pins = {}
    for line in lock.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _unpinned(requirements: list[str], lock: str) -> list[str]:
    pins = _pins(lock)
    return sorted({str(canonicalize_name(Requirement(r).name)) for r in requirements} - set(pins))


def test_the_lock_pins_every_dependency_ci_installs():
    """Issue 42: requirements.lock pins every requirement of pyproject.toml's dependencies and of the
    extras `make setup` installs, torch at TORCH_SPEC's version and build-free, and no CUDA package
    (a GPU node's torch brings its own)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(r"^EXTRAS \?= (\S+)$", makefile, re.M).group(1).split(",")
    requirements = project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]
    lock = (ROOT / LOCK).read_text()
    assert len(requirements) > 20 and _unpinned(requirements, lock) == []
    first = next(line for line in lock.splitlines() if line[:1].isalnum())
    assert _unpinned(requirements + [first.split("==")[0]], lock.replace(first + "\n", "")) == [
        canonicalize_name(first.split("==")[0])], "a name missing from the lock must be found"
    pins = _pins(lock)
    assert all(re.fullmatch(r"[0-9][0-9a-z.]*", v) for v in pins.values()), "every pin is an exact version"
    assert re.search(r"^TORCH_SPEC \?= (\S+)$", makefile, re.M).group(1) == f"torch=={pins['torch']}"
    assert [n for n in pins if n.startswith(("nvidia-", "cuda-")) or n == "triton"] == []


def test_the_release_ships_the_lock_and_installs_under_it(tmp_path, monkeypatch):
    """Issue 42: the student repository carries the kit's lock, and every `pip install` of its README
    takes it as constraints (nbgrader's step stubbed: the notebook is not what this checks)."""
    import grader.release

    def fake_course(course, sources):
        for name in sources:
            (course / "release" / name).mkdir(parents=True)
            (course / "release" / name / f"{notebook.NOTEBOOK_ID}.ipynb").write_text('{"cells": []}')

    monkeypatch.setattr(grader.release, "make_course", fake_course)
    bundle = release(ASSIGNMENTS["a1"], tmp_path / "student", tmp_path / "course")
    assert (bundle / LOCK).read_bytes() == (ROOT / LOCK).read_bytes()
    installs = [line for line in (bundle / "README.md").read_text().splitlines() if "pip install" in line]
    assert len(installs) == 2 and any("-e " in line for line in installs)
    assert [line for line in installs if f" -c {LOCK} " not in line] == []


# -- slow: nbgrader runs -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def a1_release(tmp_path_factory):
    pytest.importorskip("nbgrader", reason="the course extra: pip install -e '.[course]'")
    root = tmp_path_factory.mktemp("a1-release")
    release(ASSIGNMENTS["a1"], root / "student", root / "course")
    return root


@pytest.mark.slow
def test_a1_release_leaks_nothing(a1_release):
    bundle = a1_release / "student"
    files = _files(bundle)
    assert {"README.md", "pyproject.toml", "report.ipynb", "starter_code", "a1_infra", "tests"} <= {
        p.relative_to(bundle).parts[0] for p in files}
    solution_bytes = {p.read_bytes() for p in _files(SOLUTIONS)}
    assert not [p for p in files if p.read_bytes() in solution_bytes], "a file of solutions/ is in the release"
    assert not [p for p in files if b"BEGIN HIDDEN TESTS" in p.read_bytes()]
    assert not [p for p in files if "grader" in p.relative_to(bundle).parts]
    secret = _added_reference_lines(bundle / "starter_code")
    assert len(secret) > 20, "the reference patch adds lines: the check must have something to look for"
    texts = {p: p.read_text(errors="replace") for p in files}
    hits = [(p.name, ln) for p, text in texts.items() for ln in secret if ln in text]
    assert hits == []
    hint_lines = hints.secret_lines(ASSIGNMENTS["a1"])
    assert len(hint_lines) > 20 and not [ln for text in texts.values() for ln in hint_lines if ln in text]


@pytest.mark.slow
def test_a1_release_links_resolve_inside_it(a1_release):
    bundle = a1_release / "student"
    assert list((bundle / "benchmarks" / "results").rglob("*.json")), "the handout's records are not in the release"
    assert _links_to_nothing(bundle) == []


@pytest.mark.slow
def test_a1_release_installs_and_collects_its_public_tests(a1_release):
    bundle = a1_release / "student"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--dry-run",
                          "-e", str(bundle)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0 and "Would install onenode" in pip.stdout, pip.stdout + pip.stderr
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                             cwd=bundle, capture_output=True, text=True, timeout=300,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(bundle / "starter_code"),
                                  "HOME": str(a1_release)})
    assert collect.returncode == 0, collect.stdout + collect.stderr
    assert "a1_infra/tests/test_part1_moe.py" in collect.stdout


@pytest.mark.slow
def test_full_notebook_cycle(a1_release, tmp_path):
    """Two students (the reference answers, the release notebook untouched) through sandboxed
    autograding, feedback and export; then a TA grades one written answer and exports again."""
    course, results = a1_release / "course", tmp_path / "results"
    broken = tmp_path / "broken.ipynb"
    broken.write_text('{"cells": [')
    submissions = {"ref_student": SOLUTIONS / "a1" / "report.ipynb",
                   "empty_student": a1_release / "student" / "report.ipynb", "broken_student": broken}
    auto_max = sum(notebook.autograded_cells(course, "a1").values())
    for name, path in submissions.items():
        logs = results / name / "logs"
        logs.mkdir(parents=True)
        part = report.test_entry("Part 1: fused MoE experts: correctness", 4, 4, "ok", "moe")
        tests = notebook.grade(path, logs, "a1") + [part]
        results_json_ = results_json(name, tests, [], 1.0, "", {"profile": "cpu-tiny", "seed": 0})
        (results / name / "results.json").write_text(json.dumps(results_json_))
        if name == "broken_student":
            assert sum(t["score"] for t in tests if "notebook" in t["tags"]) == 0
            assert "could not be autograded" in tests[0]["output"] and tests[0]["max_score"] > 0
            assert not (results / name / notebook.FEEDBACK_NAME).exists()
            continue
        feedback = (results / name / notebook.FEEDBACK_NAME).read_text()
        assert "BEGIN HIDDEN TESTS" not in feedback and "_expected" not in feedback
        assert "_expected" not in (results / name / notebook.AUTOGRADED_NAME).read_text()
        auto = sum(t["score"] for t in tests if "notebook" in t["tags"])
        assert auto == (auto_max if name == "ref_student" else 0), [(t["name"], t["output"]) for t in tests]

    sheet = tmp_path / "grades.csv"
    rows = {r["student"]: r for r in export(course, results, sheet, "a1")}
    with sheet.open() as f:
        assert sorted(r["student"] for r in csv.DictReader(f)) == sorted(submissions)
    ref, empty, broken_row = rows["ref_student"], rows["empty_student"], rows["broken_student"]
    written = notebook.written_points(course, "a1")
    assert (ref["notebook_score"], ref["notebook_max"]) == (auto_max, auto_max + written)
    assert (empty["notebook_score"], ref["parts_score"], ref["total"]) == (0, 4, 4 + auto_max)
    assert (broken_row["notebook_score"], broken_row["notebook_max"]) == (0, auto_max + written)
    assert ref["needs_manual_grade"] is True

    from nbgrader.api import Gradebook

    with Gradebook(notebook.db_url(course), notebook.COURSE_ID) as gb:
        grade = gb.find_grade("slow_path_moe", "report", "a1", "ref_student")
        grade.manual_score = 2
        gb.db.commit()
    rows = {r["student"]: r for r in export(course, results, sheet, "a1")}
    assert rows["ref_student"]["notebook_score"] == auto_max + 2, "the manual grade must survive a second export"
    with sheet.open() as f:
        assert {r["student"]: float(r["total"]) for r in csv.DictReader(f)} == {
            "ref_student": 4 + auto_max + 2, "empty_student": 4, "broken_student": 4}


@pytest.mark.slow
def test_a2_release_is_the_fixed_stack(tmp_path):
    pytest.importorskip("nbgrader", reason="the course extra: pip install -e '.[course]'")
    bundle = release(ASSIGNMENTS["a2"], tmp_path / "student", tmp_path / "course")
    moe = (bundle / "starter_code" / "onenode" / "model" / "moe.py").read_text()
    assert "grouped_mm" in moe, "the A2 starter must carry the reference A1 fix"
    # the grader's verification ships as `onenode verify`, and the README says to run it
    assert (bundle / "starter_code" / "onenode" / "verify" / "replay_harness.py").is_file()
    assert ".venv/bin/onenode verify runs/mine" in (bundle / "README.md").read_text()
    assert (bundle / "report.ipynb").is_file() and (bundle / "a2_pretrain" / "recipes" / "baseline.yaml").is_file()
    markers = (b"BEGIN HIDDEN TESTS", b"BEGIN SOLUTION")
    assert not [p for p in _files(bundle) if any(marker in p.read_bytes() for marker in markers)]
    assert list((bundle / "benchmarks" / "results").rglob("*.json")) and _links_to_nothing(bundle) == []
