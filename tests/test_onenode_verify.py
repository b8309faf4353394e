"""`onenode verify RUN`: a student's own check of an A2 run, the grader's verification code run on
their install. It passes an honest run, fails a forged one with the check and the reason the
grader gives, and its verdict is the grader's on the same run with the same seed; a folder it
cannot verify is one line and exit status 1, a usage error exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from redteam.a2_forgeries import FORGERIES, Runs

from grader.a2.job import a2_stack, new_job
from grader.a2.rubric import load_rubric
from grader.a2.scoring import verify
from grader.rubric import KIT_ROOT
from onenode.verify.cli import load_profiles
from onenode.verify.intake import load_submission

FORGED = next(f for f in FORGERIES if f.name == "forged-middle-span")


def onenode_verify(run: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """`onenode verify` as a student runs it: from the repository root, on the install their run
    trained with (the A2 starter, here the grader's A2 stack, which trained the runs)."""
    env = {**os.environ, "PYTHONPATH": str(a2_stack() / "starter_code")}
    return subprocess.run([sys.executable, "-m", "onenode.cli", "verify", str(run), "--out", str(out), *options],
                          cwd=KIT_ROOT, env=env, capture_output=True, text=True, timeout=900)


def _verdicts(checks: list[dict]) -> dict[str, tuple[bool, str]]:
    """Each check's verdict and reason, the seconds a replay took left out."""
    return {c["name"]: (c["ok"], re.sub(r"in [\d.]+ s\b", "in _ s", c["detail"])) for c in checks}


@pytest.mark.slow  # a replay by the grader (sandboxed) and one by `onenode verify`, each of a tiny run
@pytest.mark.parametrize("forged", [False, True], ids=["honest", FORGED.name])
def test_onenode_verify_gives_the_graders_verdict(forged, tmp_path):
    runs = Runs()
    run = FORGED.build(runs, tmp_path) if forged else runs.honest
    job = new_job(load_rubric(), "cpu-tiny", tmp_path / "job", seed=0)
    job.eval_texts = []
    sub = load_submission(run, notebook=False)
    seed = f"{job.seed}:{sub.name}"  # the spans the grader draws for this run
    (tmp_path / "logs").mkdir()
    graders = [c.__dict__ for c in verify(job, sub, tmp_path / "logs")[0]]

    done = onenode_verify(run, tmp_path / "verify.json", "--seed", seed)
    record = json.loads((tmp_path / "verify.json").read_text())
    assert _verdicts(record["checks"]) == _verdicts(graders)
    assert done.returncode == (1 if forged else 0), done.stdout + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert record["profile"] == "cpu-tiny" and f"profile cpu-tiny ({Path('a2_pretrain') / 'rubric.toml'})" in lines[0]
    if forged:
        for name, reason in FORGED.caught_by.items():
            failed = next(line for line in lines if line.startswith(f"FAIL {name}: "))
            assert re.search(reason, failed.removeprefix(f"FAIL {name}: ")), failed
            assert lines[lines.index(failed) + 1].startswith("     what to do: ")
        assert lines[-1].startswith("NOT verified: ")
    else:
        assert all(line.startswith("PASS ") for line in lines[1:-1]), lines
        assert lines[-1].startswith("verified: every check passed (necessary, not sufficient: the TA's grading "
                                    "replays spans you cannot predict")


def test_a_folder_it_cannot_verify_is_one_line_and_usage_errors_exit_2(tmp_path, capsys):
    from onenode.cli import main

    (tmp_path / "run").mkdir()
    assert main(["verify", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("FAIL run folder: the A2 submission lacks final/config.json"), out
    assert main(["verify", str(tmp_path / "run"), "--profile", "no-such"]) == 2
    assert "unknown profile 'no-such': choose one of cpu-tiny" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "run"), "--rubric", str(tmp_path / "none.toml")]) == 2
    assert "pass a2_pretrain/rubric.toml with --rubric" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["verify"])
    assert usage.value.code == 2


def test_it_reads_the_profiles_the_grader_reads():
    """The verification's settings of each profile are the grader's (one rubric, two readers)."""
    graders = load_rubric().profiles
    for name, profile in load_profiles(KIT_ROOT / "a2_pretrain" / "rubric.toml").items():
        for field, value in profile.__dict__.items():
            assert getattr(graders[name], field) == value, (name, field)
