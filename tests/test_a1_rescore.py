"""`python -m grader.a1.rescore`: a graded A1 submission scored again from the evidence its job
kept, with no session run again (the dispute procedure of docs/INSTRUCTOR.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from grader.a1.rescore import main, rescore
from grader.a1.rubric import load_rubric

KIT = Path(__file__).resolve().parents[1]
JOB = KIT / "benchmarks" / "results" / "2026-12-03-h200-a1-graded-step" / "grade"  # one H200, h200x1


def test_the_recorded_grade_comes_back_from_its_evidence():
    """The reference fix graded on one H200: its points and every figure behind them, recomputed
    from `logs/evidence.json.gz` and the starter's, are the ones its results.json recorded."""
    recorded, ctx = rescore(JOB, "reference-full", load_rubric(), JOB / "starter-logs")
    assert [(t["name"], t["score"]) for t in ctx.tests] == [
        (t["name"], t["score"]) for t in recorded["tests"] if "notebook" not in t["tags"]]
    assert sum(t["score"] for t in ctx.tests) == recorded["score"] == 10
    for key in ("moe_speedup", "moments_error", "reference_tokens_per_s", "reference_step_speedup"):
        assert ctx.measurements[key] == recorded["extra_data"]["numbers"][key], key


def test_a_new_tolerance_is_applied_to_the_same_readings():
    """A tolerance under the reading the evidence holds (the whole step's 0.045) zeroes Part 1."""
    rubric = load_rubric()
    tight = dataclasses.replace(rubric.profile("h200x1"), train_rtol=0.01)
    rubric = dataclasses.replace(rubric, profiles={**rubric.profiles, "h200x1": tight})
    _, ctx = rescore(JOB, "reference-full", rubric, JOB / "starter-logs")
    part1 = [t for t in ctx.tests if t["name"].startswith("Part 1")]
    assert [t["score"] for t in part1] == [0, 0] and part1[0]["output"].startswith("wrong:")


def test_a_submission_without_evidence_is_one_line(tmp_path, capsys):
    (tmp_path / "refused").mkdir()
    (tmp_path / "refused" / "results.json").write_text('{"tests": [], "extra_data": {"profile": "h200x1", "seed": 1}}')
    assert main([str(tmp_path), "refused", "--starter-logs", str(JOB / "starter-logs")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no evidence.json in" in error and "onenode-grade a1" in error


def test_another_jobs_starter_is_refused(tmp_path, capsys):
    """A starter run on other seeds (a later job in the same --out) would make every comparison
    wrong: the submission's own reading of the starter's MoE layer shows it, and rescore refuses."""
    import gzip
    import json

    kept = json.loads(gzip.decompress((JOB / "starter-logs" / "evidence.json.gz").read_bytes()))
    kept["moe"]["digests"] = kept["moe"]["digests"][1:] + kept["moe"]["digests"][:1]  # other inputs' answers
    (tmp_path / "evidence.json").write_text(json.dumps(kept))
    assert main([str(JOB), "reference-full", "--starter-logs", str(tmp_path)]) == 2
    assert "another grading job's starter" in capsys.readouterr().err


def test_each_job_keeps_its_starter_in_a_folder_of_its_seed(tmp_path):
    """`onenode-grade a1` keeps the starter's logs under OUT/.starter-logs/seed-SEED: a second job in
    the same OUT (its own seed) leaves the first one's, and `rescore` finds a grade's by its seed."""
    import argparse
    import shutil

    from grader.a1 import job_from_args, starter_logs

    rubric = load_rubric()
    jobs = [job_from_args(rubric, "cpu-tiny", tmp_path / "work", argparse.Namespace(out=str(tmp_path), seed=seed,
                                                                                      no_notebook=True))
            for seed in (3, 5)]
    assert [job.starter_logs for job in jobs] == [tmp_path / ".starter-logs" / "seed-3",
                                                  tmp_path / ".starter-logs" / "seed-5"]
    shutil.copytree(JOB / "reference-full", tmp_path / "reference-full")
    seed = rescore(JOB, "reference-full", rubric, JOB / "starter-logs")[0]["extra_data"]["seed"]
    shutil.copytree(JOB / "starter-logs", starter_logs(tmp_path, seed))
    recorded, ctx = rescore(tmp_path, "reference-full", rubric)  # no --starter-logs: found by the seed
    assert sum(t["score"] for t in ctx.tests) == recorded["score"]
