"""The course node's layouts (cpu-8proc) graded at tiny scale on 8 gloo processes: apart from the
cpu-tiny calibration (tests/test_grader_calibration.py) so that the two, the suite's longest,
run side by side under pytest-xdist."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_grader_calibration import needs_solutions

from grader.a1 import A1, scoring
from grader.a1.demo import build_cohort
from grader.a1.job import new_job
from grader.a1.rubric import load_rubric
from grader.cohort import grade_one


@needs_solutions
@pytest.mark.slow
@pytest.mark.dist
def test_course_node_layouts_on_eight_processes(tmp_path, monkeypatch):
    """cpu-8proc: the course node's layouts (dp=8 with ep=8; pp=2 with dp=4 and ep=4) at tiny
    scale on 8 gloo processes, the code path of h100x8. The example submissions that earn Part 2
    or 3 points are graded on the parts they fix, each earning their correctness and evidence
    points in full from the traffic the grader reads (the starter's own runs are the job's
    reference, so the unchanged starter's traffic is the job's; Part 1 runs in one process on every
    profile, and cpu-tiny's calibration
    covers it and the parts a submission does not fix). Part 3 alone is the case that once failed
    here: its stages, each sharded over 4 ranks, moved 0.52 of plain FSDP's traffic. The reference
    solution is graded on its pp layout alone, where Parts 1 to 3 run together (each stage's
    stacked experts parallel over 4 ranks): its ep layout would add only Part 1's layer to
    part2-ep's run, which the cpu-tiny calibration grades, at the cost of one more 8-process run."""
    rubric = load_rubric()
    profile = dataclasses.replace(rubric.profile("cpu-8proc"), warmup=1, repeats=1,
                                  moe=dict(rubric.profile("cpu-8proc").moe, repeats=1))
    rubric = dataclasses.replace(rubric, profiles={**rubric.profiles, "cpu-8proc": profile})
    job = new_job(rubric, "cpu-8proc", tmp_path / "work", tmp_path / "starter-logs", seed=88)
    cohort = {folder.name: folder for folder in build_cohort(tmp_path / "cohort")}
    # each graded on the parts it fixes only (the layouts of the others are 8-process runs to no end)
    parts = {"part2-ep": {"ep"}, "part3-pp": {"pp"}, "reference-full": {"pp"}}
    steps = {"ep": scoring.grade_ep, "pp": scoring.grade_pp}
    results = {}
    for name, earns in parts.items():
        monkeypatch.setattr(scoring, "STEPS", [steps[part] for part in sorted(earns)])
        results[name] = grade_one(A1, cohort[name], job, tmp_path / "out")
    for name, earns in parts.items():
        for test in (t for t in results[name]["tests"] if t["tags"][0] in earns):
            # correctness and the evidence exactly; no speed: 8 processes over 2 cores time nothing
            # of the layouts, so cpu-8proc scores no whole step (scored_speeds) and tells no timing
            assert test["score"] == test["max_score"], (name, test)
            if test["name"].endswith("speed"):
                assert test["max_score"] == 0 and not re.search(r"\d\.\d\dx", test["output"]), (name, test)
    numbers = {name: r["extra_data"]["numbers"] for name, r in results.items()}
    ep = numbers["part2-ep"]  # expert parallelism: each rank its eighth of the experts
    assert ep["expert_traffic_ratio"] < profile.max_expert_traffic
    assert ep["ep_experts_held_share"] == 1 / 8
    assert ep["ep_traffic_mb_per_step"] > ep["ep_token_traffic_mb_per_step"] > 0
    assert all(t > 0 for t in job.reference.ep.traffic), "the starter's dp=8 FSDP traffic, read from outside"
