"""Cohort grading: atomic results, resume after a kill, the table and the CSV."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grader.a1 import A1
from grader.a1.rubric import RUBRIC_PATH
from grader.cohort import find_submissions, is_done, publish, table, write_cohort_csv
from grader.report import results_json

ROOT = Path(__file__).resolve().parents[1]


def fake_results(name: str, score: float, seed: int = 1) -> dict:
    tests = [{"name": "Part 1: x: correctness", "score": score, "max_score": 4, "status": "passed",
              "output": "", "visibility": "visible", "tags": ["moe"]}]
    return results_json(name, tests, [], 1.0, "", {"profile": "cpu-tiny", "seed": seed,
                                                   "numbers": {"moe_speedup": 2.5}})


def test_publish_replaces_a_result_atomically(tmp_path):
    for score in (1, 3):
        staging = tmp_path / f".partial-a-{score}"
        staging.mkdir()
        (staging / "results.json").write_text(json.dumps(fake_results("a", score)))
        publish(staging, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "results.json").read_text())["score"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert is_done(tmp_path, "a") and not is_done(tmp_path, "b")


def test_grader_errors_are_not_done(tmp_path):
    results = fake_results("a", 0)
    results["extra_data"]["grader_error"] = True
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text(json.dumps(results))
    assert not is_done(tmp_path, "a")


def test_find_submissions_and_name_clashes(tmp_path):
    (tmp_path / "g1").mkdir()
    (tmp_path / "g2.zip").write_bytes(b"")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "notes.txt").write_text("")
    assert [p.name for p in find_submissions(tmp_path)] == ["g1", "g2.zip"]
    (tmp_path / "g1.tar.gz").write_bytes(b"")
    with pytest.raises(ValueError, match="share the name 'g1'"):
        find_submissions(tmp_path)


def test_csv_and_table(tmp_path):
    rows = [fake_results("a", 4), fake_results("b", 0)]
    write_cohort_csv(A1, tmp_path / "cohort.csv", rows)
    with open(tmp_path / "cohort.csv") as f:
        read = list(csv.DictReader(f))
    assert [r["name"] for r in read] == ["a", "b"] and read[0]["moe_score"] == "4"
    text = table(A1, rows)
    header, a, b = (line.split() for line in text.splitlines())
    assert header[:3] == ["submission", "score/4", "part1/4"] and a[:3] == ["a", "4", "4"] and b[:3] == ["b", "0", "0"]


def test_the_table_has_a_notebook_column_and_each_maximum_in_its_header():
    """The demo's starter-unchanged: 10 of 34, all of it the notebook's, which has its column; the
    maximum of each column in its header where every graded row shares it, else in the cell."""
    def graded(name, parts, notebook):
        tests = [{"name": f"{part}", "score": got, "max_score": most, "tags": [part]}
                 for part, (got, most) in zip(("moe", "ep", "pp"), parts)]
        if notebook is not None:
            tests.append({"name": "Report notebook: x", "score": notebook, "max_score": 10, "tags": ["notebook"]})
        return results_json(name, tests, [], 1.0, "", {"profile": "cpu-tiny", "seed": 1, "numbers": {}})

    starter, full = graded("starter", [(0, 10), (0, 7), (0, 7)], 10), graded("full", [(10, 10), (7, 7), (7, 7)], 10)
    header, *rows = (line.split() for line in table(A1, [starter, full]).splitlines())
    assert header[:6] == ["submission", "score/34", "part1/10", "part2/7", "part3/7", "notebook/10"]
    assert rows == [["starter", "10", "0", "0", "0", "10", "-"], ["full", "34", "10", "7", "7", "10", "-"]]
    without = graded("no-notebook", [(10, 10), (7, 7), (7, 7)], None)
    header, *rows = (line.split() for line in table(A1, [starter, without]).splitlines())
    assert header[1:6] == ["score", "part1/10", "part2/7", "part3/7", "notebook"]
    assert rows[0][1] == "10/34" and rows[1][1] == "24/24" and rows[1][5] == "-"


def test_the_table_shows_no_whole_step_speed_on_cpu_and_no_speed_of_a_zeroed_part():
    """cpu-tiny scores the MoE layer alone: its whole steps' tokens/s (noise there) are left out;
    a part that earned nothing (b: wrong, 12x) shows no speed. On h200x1 the step is scored."""
    def graded(name, score, profile):
        results = fake_results(name, score)
        results["extra_data"].update(profile=profile, numbers={"moe_speedup": 12.39 if not score else 2.5,
                                                               "reference_tokens_per_s": 9321.0})
        return results

    cpu = table(A1, [graded("a", 4, "cpu-tiny"), graded("b", 0, "cpu-tiny")])
    assert "step tok/s" not in cpu and "9321" not in cpu
    assert "2.5" in cpu.splitlines()[1] and "12.39" not in cpu
    gpu = table(A1, [graded("a", 4, "h200x1"), graded("b", 0, "h200x1")])
    assert "step tok/s" in gpu and "9321" in gpu.splitlines()[1] and "12.39" not in gpu


# Its MoE speed range starts at 3x: the unchanged starter, timed beside itself over two repeats on a
# loaded 2-core CI machine, once read above 1.5x and earned Part 1's speed points.
QUICK_PROFILE = """
[profiles.quick]
description = "tests: cpu-tiny's Part 1 only, few repeats"
device = "cpu"
dtype = "float32"
threads = 1
preset = "tiny"
overrides = {}
batch = 2
seq_len = 16
warmup = 1
repeats = 1
rtol = 1e-4
train_rtol = 1e-4
timeout_s = 240
memory_mb = 4096
moe = { tokens = 64, warmup = 1, repeats = 2, overrides = { n_routed_experts = 8, n_group = 1, topk_group = 1 } }
speed = { moe_layer = [3.0, 4.0], moe_step = [0.5, 1.0], ep_step = [0.2, 0.3], pp_step = [0.2, 0.3] }
scored_speeds = ["moe_layer", "moe_step"]
max_expert_traffic = 0.25
pipeline_traffic = [0.5, 0.7]
layouts.reference = { world = 1, dp = 1, ep = 1, pp = 1 }
"""


def _quick_rubric(tmp_path: Path) -> Path:
    """The real parts with a cheap profile: a real grading job in seconds."""
    path = tmp_path / "quick.toml"
    path.write_text(RUBRIC_PATH.read_text().split("[profiles.")[0] + QUICK_PROFILE)
    return path


@pytest.mark.slow
def test_cohort_killed_midway_resumes_with_every_result_once(tmp_path):
    cohort = tmp_path / "cohort"
    for name in ("a-starter", "b-starter"):
        (cohort / name).mkdir(parents=True)
        (cohort / name / "submission.patch").write_text("")
    (cohort / "d-nopatch").mkdir()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "grader.cli", "a1", "--cohort", str(cohort), "--out", str(out),
           "--profile", "quick", "--rubric", str(_quick_rubric(tmp_path)), "--quiet", "--no-notebook"]
    first = subprocess.Popen(cmd + ["--seed", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not (out / "a-starter" / "results.json").exists():
        assert first.poll() is None, first.stdout.read().decode()
        assert time.monotonic() < deadline, "the first submission never finished"
        time.sleep(0.2)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert not (out / "cohort.csv").exists()

    second = subprocess.run(cmd + ["--seed", "2"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert second.returncode == 1, second.stdout + second.stderr  # d-nopatch has no grade
    assert "d-nopatch: no submission.patch" in second.stdout
    assert not list(out.glob(".partial-*"))  # nothing half-written left
    graded = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert graded == ["a-starter", "b-starter", "cohort.csv", "d-nopatch"]
    seeds = {name: json.loads((out / name / "results.json").read_text())["extra_data"]["seed"]
             for name in graded if name != "cohort.csv"}
    assert seeds["a-starter"] == 1  # done before the kill: kept, not graded again
    assert seeds["b-starter"] == 2
    with open(out / "cohort.csv") as f:
        names = [row["name"] for row in csv.DictReader(f)]
    assert sorted(names) == ["a-starter", "b-starter", "d-nopatch"]
    nopatch = json.loads((out / "d-nopatch" / "results.json").read_text())
    assert nopatch["score"] == 0 and "no submission.patch" in nopatch["output"]
    starter = json.loads((out / "b-starter" / "results.json").read_text())
    assert starter["score"] == 0 and "not faster" in starter["tests"][0]["output"]
