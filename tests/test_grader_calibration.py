"""Calibration: the example cohort earns exactly what the rubric promises on cpu-tiny.

The unchanged starter earns nothing, each single-part patch earns its part and only its part,
the full reference earns every point, a fast but wrong MoE earns nothing for Part 1, and a
second grading job (another seed) gives the same scores.

Each submission is graded on the parts whose sessions run code it changed (`GRADED`). A part whose
sessions run only the starter's code (the MoE layer and the one-rank step: moe.py; the ep layout:
moe.py and expert_parallel.py; the pp layout: pipeline.py, whose starter fails to split the model)
is the unchanged starter's, on the job's same seeds: starter-unchanged is graded on it, and any
other submission would earn there exactly what it earns.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest

from grader import runner
from grader.a1 import A1, scoring
from grader.a1.demo import MANIFEST, SOLUTIONS, build_cohort
from grader.a1.job import new_job
from grader.a1.rubric import load_rubric
from grader.cohort import grade_one
from grader.report import part_scores
from grader.rubric import tomllib
from grader.submission import load_submission, patched_tree

PARTS = ("moe", "ep", "pp")
GRADED = {"starter-unchanged": PARTS, "part1-moe": ("moe", "ep"), "part2-ep": ("ep",), "part3-pp": ("pp",),
          "reference-full": PARTS, "wrong-fast-moe": ("moe",)}


def _missing_solutions() -> list[str]:
    with open(MANIFEST, "rb") as f:
        patches = [p for ps in tomllib.load(f)["submissions"].values() for p in ps if not p.startswith("./")]
    return sorted({p for p in patches if not (SOLUTIONS / p).is_file()})


needs_solutions = pytest.mark.skipif(bool(_missing_solutions()), reason=f"solutions/a1 lacks {_missing_solutions()}")


@needs_solutions
def test_every_example_submission_applies(tmp_path):
    for folder in build_cohort(tmp_path / "cohort"):
        submission = load_submission(folder, tmp_path / f"work-{folder.name}")
        tree = patched_tree(submission, tmp_path / f"work-{folder.name}" / "tree")
        assert (tree / "starter_code" / "onenode" / "model" / "moe.py").is_file()
        assert bool(submission.changed_files) == (folder.name != "starter-unchanged")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The example cohort graded once, each submission on its `GRADED` parts (code parts only: the
    notebook has its own tests)."""
    out = tmp_path_factory.mktemp("calibration")
    rubric = load_rubric()
    started = collections.Counter()
    start_child = runner.Child.__init__

    def counting(self, name, *args, **kwargs):
        started[name.split("-")[0]] += 1
        start_child(self, name, *args, **kwargs)

    steps = {"moe": scoring.grade_moe, "ep": scoring.grade_ep, "pp": scoring.grade_pp}
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner.Child, "__init__", counting)
        job = new_job(rubric, "cpu-tiny", out / "work", out / "starter-logs", seed=1234)
        for folder in build_cohort(out / "cohort"):
            mp.setattr(scoring, "STEPS", [steps[part] for part in GRADED[folder.name]])
            results[folder.name] = grade_one(A1, folder, job, out / "results")
    # each part's points on cpu-tiny: a part's speed is worth 0 where the profile scores none of it
    tiny = rubric.profile("cpu-tiny")
    full = {key: part.points - (0 if tiny.scores_speed_of(key) else part.speed) for key, part in rubric.parts.items()}
    return results, full, out, started


def _scores(results: dict) -> dict[str, float]:
    scores = part_scores(results)
    return {part: scores.get(part, 0) for part in PARTS}


@needs_solutions
@pytest.mark.slow
@pytest.mark.dist
def test_calibration(graded):
    results, full, _, started = graded
    assert {name: {t["tags"][0] for t in r["tests"]} for name, r in results.items()} == \
        {name: set(parts) for name, parts in GRADED.items()}
    zero = dict.fromkeys(PARTS, 0)
    assert _scores(results["starter-unchanged"]) == zero
    for name, part in (("part1-moe", "moe"), ("part2-ep", "ep"), ("part3-pp", "pp")):
        assert _scores(results[name]) == {**zero, part: full[part]}, (name, results[name]["tests"])
    assert _scores(results["reference-full"]) == full
    wrong = results["wrong-fast-moe"]
    assert _scores(wrong)["moe"] == 0
    assert wrong["tests"][0]["output"].startswith("wrong:")
    assert "zeroed" in wrong["tests"][1]["output"]
    # the evidence behind parts 2 and 3 is what the grader saw move between the ranks
    numbers = {name: r["extra_data"]["numbers"] for name, r in results.items()}
    ratios = {name: numbers[name]["expert_traffic_ratio"] for name, parts in GRADED.items() if "ep" in parts}
    assert ratios["reference-full"] < 0.25 < min(ratios["starter-unchanged"], ratios["part1-moe"]), ratios
    # ...and that it is expert parallelism: each rank holds half of the routed experts, and more than
    # the hidden states the tokens' routing sends to the other rank travel
    for name in ("part2-ep", "reference-full"):
        assert numbers[name]["ep_experts_held_share"] == 0.5, name
        assert numbers[name]["ep_traffic_mb_per_step"] > numbers[name]["ep_token_traffic_mb_per_step"] > 0, name
    # every submission's MoE was timed beside the same starter child (one start for the cohort),
    # and each submission ran in children of its own
    assert started["starter"] == 1 and started["child"] >= len(results), started
    assert numbers["part3-pp"]["pp_traffic_mb_per_step"] > 0
    # ...and, on cpu-tiny, what the busiest pipeline rank holds: about half the model's state
    shares = {name: numbers[name]["pp_state_share"] for name in ("part3-pp", "reference-full")}
    assert all(0.3 < share <= load_rubric().profile("cpu-tiny").pipeline_memory["max_state_share"]
               for share in shares.values()), shares


@needs_solutions
@pytest.mark.slow
@pytest.mark.dist
def test_grading_twice_gives_the_same_score(graded, monkeypatch):
    """Part 1 of part1-moe (its timed layer and whole step) under another seed: other inputs, other
    timings, the same score. Parts 2 and 3 are left out: the calibration test covers them, and their
    layouts' runs would cost this test a fifth more time."""
    results, _, out, _ = graded
    monkeypatch.setattr(scoring, "STEPS", [scoring.grade_moe])
    rubric = load_rubric()  # the reference layout alone: the starter's ep and pp runs would go unread
    tiny = rubric.profile("cpu-tiny")
    profile = dataclasses.replace(tiny, layouts={"reference": tiny.layouts["reference"]}, pipeline_memory=None)
    rubric = dataclasses.replace(rubric, profiles={**rubric.profiles, "cpu-tiny": profile})
    job = new_job(rubric, "cpu-tiny", out / "work2", out / "starter-logs2", seed=4321)
    again = grade_one(A1, out / "cohort" / "part1-moe", job, out / "again")
    assert again["extra_data"]["seed"] != results["part1-moe"]["extra_data"]["seed"]
    assert _scores(again)["moe"] == _scores(results["part1-moe"])["moe"] > 0


def test_pipeline_memory_is_refused_where_the_grader_cannot_read_it():
    """Host memory against float32 state, pp layouts with dp = 1: a GPU profile or stages sharded
    over dp ranks (cpu-8proc) would grade Part 3 on a reading that does not mean what it says."""
    rubric = load_rubric()
    memory = rubric.profile("cpu-tiny").pipeline_memory
    for name in ("h200x2", "cpu-8proc"):
        with pytest.raises(ValueError, match=f"profile {name}: pipeline_memory"):
            dataclasses.replace(rubric.profile(name), pipeline_memory=memory)


@needs_solutions
@pytest.mark.slow
@pytest.mark.dist
def test_every_grade_comes_back_from_the_evidence_the_job_kept(graded):
    """`grader.a1.rescore` on each submission graded on every part: the points of every part (the
    traffic and memory readings of Parts 2 and 3 included) recomputed from `logs/evidence.json`
    alone (rescore reads every part's sessions, which the others' evidence lacks; a wrong Part 1
    rescored: tests/test_a1_rescore.py)."""
    from grader.a1.rescore import rescore

    results, _, out, _ = graded
    rubric = load_rubric()
    for name in (name for name, parts in GRADED.items() if parts == PARTS):
        recorded, ctx = rescore(out / "results", name, rubric, out / "starter-logs")
        assert [t["score"] for t in ctx.tests] == [t["score"] for t in recorded["tests"]], name
