"""The red-team suite: every adversarial submission of tests/redteam/cases.py through the real
grader (intake, patching, the sandboxed harness, scoring), each with its expected outcome.

The cases that run code share one grading job on a cut-down cpu-tiny profile (Part 1 only), so
the starter's reference runs once; they start torch several times, so they are marked slow. The
last test grades the unchanged starter after all of them: it must still match the reference,
and the grader's own files must hold none of the hostile payloads. A cohort folder as a TA would
leave it (world-readable, another group's submission and notebook, solutions, hidden tests) is
planted on the machine for the module: no word of it may reach anything a graded case leaves
behind. The sandbox's own limits (infinite loop, fork bomb, memory, network, daemons, ...) are
tested in tests/test_sandbox.py.
"""

import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from redteam import a1_evidence, a1_sessions
from redteam.cases import CASES, PAYLOADS, STARTER, Case, folder

from grader import cohort
from grader.a1 import A1, scoring
from grader.a1.job import new_job
from grader.a1.rubric import load_rubric
from grader.sandbox import make_private
from grader.submission import load_submission, patched_tree

KIT = Path(__file__).resolve().parents[1]
PLANTED = ("escaped.py", "planted.py")  # what the archive cases try to write outside their folder


def assert_kit_intact() -> None:
    """None of the hostile patches reached the kit: its files exist and hold no payload (checked
    by content, not by hash, so that other edits to the kit during a run do not matter)."""
    for path, payload in PAYLOADS.items():
        assert payload not in (KIT / path).read_text(), f"{path} was changed by a submission"
    assert (KIT / "grader/cli.py").read_text() != (KIT / STARTER / "cli.py").read_text()


@pytest.fixture(scope="module")
def planted_cohort():
    """World-readable course material elsewhere on the machine, each file holding a word of its
    own; returns those words. What a case leaves behind (results, feedback, logs) must hold none."""
    root = Path(tempfile.mkdtemp(prefix="onenode-redteam-cohort-"))
    root.chmod(0o755)
    words = []
    for path in ("group-b/submission.patch", "group-b/report.ipynb", "solutions/a1/submission.patch",
                 "assignments/source/a1/report.ipynb"):
        word = f"SENTINEL-{uuid.uuid4().hex}"
        (root / path).parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        (root / path).write_text(f"{word}\n")
        (root / path).chmod(0o644)
        words.append(word)
    yield words
    shutil.rmtree(root)


# What a reading case says when it did read something (its source, which may be kept, does not).
LEAK_REPORT = re.compile(r"LEAKED (/|\d+ files|the reference solution from /)")


def assert_nothing_leaked(out: Path, words: list[str]) -> None:
    """No planted word and no leak report of a case's payload in anything the grading left."""
    for path in (p for p in out.rglob("*") if p.is_file()):
        text = path.read_text(errors="replace")
        assert not LEAK_REPORT.search(text), f"{LEAK_REPORT.search(text)[0]} in {path}"
        for word in words:
            assert word not in text, f"{word} in {path}"


def _job(tmp_path_factory, layouts: tuple[str, ...]):
    """cpu-tiny with fewer repeats and only `layouts`, one job per module (the starter's reference
    runs once). The notebook step is left out: no case attacks it, and setting up nbgrader's course
    alone costs more than all the cases."""
    rubric = load_rubric()
    tiny = rubric.profile("cpu-tiny")
    profile = dataclasses.replace(tiny, name="redteam", layouts={k: tiny.layouts[k] for k in layouts},
                                  warmup=1, repeats=1, moe=dict(tiny.moe, warmup=1, repeats=3))
    rubric = dataclasses.replace(rubric, profiles={**rubric.profiles, "redteam": profile})
    workdir = make_private(tmp_path_factory.mktemp("redteam-job"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scoring, "STEPS", [step for step in scoring.STEPS if step is not scoring.grade_notebook])
        yield new_job(rubric, "redteam", workdir, starter_logs=workdir / "starter-logs", seed=20261130)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Part 1's cases: the MoE layer and the reference layout only."""
    yield from _job(tmp_path_factory, ("reference",))


@pytest.fixture(scope="module")
def layout_job(tmp_path_factory):
    """Parts 2 and 3's cases: their layouts too."""
    yield from _job(tmp_path_factory, ("reference", "ep", "pp"))


def _grade(submission: Path, job, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    results = cohort.grade_one(A1, submission, job, out)
    assert (out / results["extra_data"]["submission"] / "results.json").is_file()
    return results


def _part(results: dict, part: str) -> tuple[float, str]:
    tests = [t for t in results["tests"] if part in t["tags"]]
    assert tests, f"no tests for part {part}"
    return sum(t["score"] for t in tests), "\n".join(t["output"] for t in tests)


def _marks(case: Case) -> list:
    return [pytest.mark.slow] if case.runs else []


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_marks(c)) for c in CASES + a1_sessions.CASES
                                  + a1_evidence.CASES])
def test_adversarial_submission(case: Case, planted_cohort, tmp_path, request, monkeypatch):
    job = request.getfixturevalue("layout_job" if case.part in ("ep", "pp") else "job")
    if case.part in ("ep", "pp"):  # graded on the part it attacks (and those it feeds on) alone
        steps = {"moe": scoring.grade_moe, "ep": scoring.grade_ep, "pp": scoring.grade_pp}
        monkeypatch.setattr(scoring, "STEPS", [steps[p] for p in (*getattr(case, "also_graded", ()), case.part)])
    (tmp_path / "in").mkdir()
    results = _grade(case.build(KIT, tmp_path / "in"), job, tmp_path / "out")

    assert results["score"] == 0
    if case.expect == "rejected":
        reason = results["output"]
        assert reason.startswith("Not graded: ") and "\n" not in reason
        assert re.search(case.reason, reason), reason
        assert all(t["score"] == 0 for t in results["tests"])
    else:
        score, feedback = _part(results, case.part)
        assert score == 0
        assert re.search(case.reason, feedback, re.MULTILINE), feedback
    assert_kit_intact()
    assert_nothing_leaked(tmp_path / "out", planted_cohort)
    for name in PLANTED:
        assert not list(tmp_path.rglob(name)) and not list(job.workdir.rglob(name)), name


# What a GPU case must leave intact on a CPU: the patched stack imports and trains a step.
TRAINS_A_STEP = """
import multiprocessing.connection, torch
from onenode.model import build_model, get_preset
from onenode.train.step import train_step
assert multiprocessing.connection.Connection.send_bytes.__module__ == "onenode.train.step", "the attack is not in place"
model = build_model(get_preset("tiny"))
ids = torch.randint(0, 512, (1, 16))
out = train_step(model, torch.optim.AdamW(model.parameters()), ids, ids)
assert out["loss"] > 0, out
"""


@pytest.mark.parametrize("case", a1_sessions.GPU_CASES, ids=lambda c: c.name)
def test_gpu_case_applies_and_trains_on_cpu(case: Case, tmp_path):
    """A case graded only on a GPU (benchmarks/results/) still applies to this kit, and leaves it
    training on a CPU: a stale patch would otherwise be found on the GPU alone."""
    submission = load_submission(case.build(KIT, tmp_path / "in"), tmp_path / "work")
    tree = patched_tree(submission, tmp_path / "tree")
    run = subprocess.run([sys.executable, "-c", TRAINS_A_STEP], cwd=tree, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree / "starter_code"), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.slow
def test_honest_submission_is_unaffected_by_the_hostile_ones(job, tmp_path):
    """Graded after every case above, the unchanged starter still matches the reference."""
    submission = folder(tmp_path / "in", "control", "")
    results = _grade(submission, job, tmp_path / "out")
    _, feedback = _part(results, "moe")
    assert feedback.startswith("matches"), feedback  # speed points may vary with load; the answer may not
    assert_kit_intact()


@pytest.mark.slow
def test_an_update_left_for_the_evidence_phase_earns_nothing_on_cpu(job, tmp_path):
    """The update deferred until the next step or the grader's reading of the optimizer's state
    trains exactly, so Part 1 stays correct; and it saves no step any time: the state is read once,
    after the last step, so every timed step runs the update of the one before it
    (`test_graded_step.py` holds the runner to that rule). The CPU profiles do not score the
    whole step's speed anyway."""
    results = _grade(a1_sessions.defers_the_update(KIT, tmp_path / "in"), job, tmp_path / "out")
    numbers = results["extra_data"]["numbers"]
    tests = [t for t in results["tests"] if "moe" in t["tags"]]
    correct = next(t for t in tests if t["name"].endswith("correctness"))
    speed = next(t for t in tests if t["name"].endswith("speed"))
    assert correct["score"] == correct["max_score"], correct["output"]
    assert numbers["reference_evidence_s"] is not None, numbers  # read once, after the last step
    assert "moe_step" not in job.profile.scored_speeds and "whole step" not in speed["output"], speed["output"]
