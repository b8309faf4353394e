"""A1's feedback a student can act on: each failed check names the public test that shows it, an
infinite error and the worst moments are said in words, a part that fails because Part 1 is wrong
says so, and a failed run's log shows one traceback with the student's own paths."""

from __future__ import annotations

import dataclasses
import math
import re
import sys

from test_a1_compare import context, ep_steps, honest_step, part1, profile, run, steps, workloads

from grader.a1 import explain, scoring
from grader.a1.compare import worst_moments
from grader.a1.rubric import load_rubric
from grader.report import one_traceback, student_paths
from grader.rubric import KIT_ROOT

ROUTER = "backbone.layers.1.mixer.gate.weight"
__all__ = ["profile"]  # test_a1_compare's fixture: cpu-tiny with every speed scored


def routerless(workload: list[list[dict]]) -> list[list[dict]]:
    """wrong-fast-moe's layer: the routing weights skipped, so the router gets no gradient (its
    sketch all zero, and one parameter fewer holds a gradient)."""
    for passes in workload:
        for digest in passes:
            digest["named"]["gate.weight"] = [0.0, 0.0]
            digest["dparams"][0] -= 10
    return workload


def test_every_part_names_a_public_test_that_exists():
    parts = load_rubric().parts
    assert [part.public_test for part in parts.values()] == [
        "a1_infra/tests/test_part1_moe.py", "a1_infra/tests/test_part2_ep.py", "a1_infra/tests/test_part3_pipeline.py"]
    assert all((KIT_ROOT / part.public_test).is_file() for part in parts.values())


def test_a_wrong_layer_names_the_router_and_the_public_test(profile):
    n_moe = profile.moe["warmup"] + profile.moe["repeats"]
    scores, outputs = part1(profile, 1 / 8, honest_step(profile, 1.0), layer=routerless(workloads(n_moe)))
    assert scores == [0, 0]
    assert "worst relative error inf (tolerance 0.0001; inf: the router (gate.weight) got no gradient where the " \
           "starter's has one: " \
           "usually the routing weights (the top-k scores) do not reach the layer's output" in outputs[0]
    assert outputs[0].endswith(". Reproduce it locally: `.venv/bin/python -m pytest "
                               "a1_infra/tests/test_part1_moe.py -q`.")
    assert "Reproduce" not in outputs[1]  # a speed zeroed by wrong results: the correctness test says what to run


def test_a_passing_part_names_no_test(profile):
    _, outputs = part1(profile, 1 / 8, honest_step(profile, 1.0))
    assert not any("Reproduce" in out for out in outputs)


def test_other_infinite_layers_are_said_in_words():
    ref = workloads()
    nan = workloads()
    nan[1][0]["out"][0] = math.nan
    fewer = workloads()
    fewer[0][1]["dparams"][0] = 990.0
    silent = workloads()
    silent[0][0]["experts"]["up"][1] = [0.0, 0.0]
    assert explain.moe_infinite(ref, nan) == "inf: NaN or infinite values in your layer's outputs or gradients"
    assert "hold 990 gradient values, the starter's 1e+03: a parameter gets no gradient" in explain.moe_infinite(ref,
                                                                                                               fewer)
    assert explain.moe_infinite(ref, silent).startswith("inf: routed expert 1 got no gradient")
    assert "another shape" in explain.moe_infinite(ref, workloads(n=1))
    assert "another shape" in explain.moe_infinite(ref, "garbage")


def test_an_infinite_loss_is_said_in_words(profile):
    nan = [{**step, "grad_norm": math.nan} for step in steps(profile.warmup + profile.repeats)]
    _, outputs = part1(profile, 1 / 8, run(nan, 1.0))
    assert "worst relative error inf (tolerance 0.0001; inf: a step missing or extra, or a loss or gradient norm" \
        in outputs[0]


def router_untrained_steps(n: int) -> list[dict]:
    """Steps whose moments show the router of layer 1 never stepped (the starter's did)."""
    ref = steps(n)
    for step in ref:
        step["moments"]["params"][ROUTER] = [0.25, 0.1]
    sub = steps(n)
    for step in sub:
        step["moments"]["params"][ROUTER] = [0.0, 0.0]
    return ref, sub


def test_the_moments_say_which_parameter_got_no_gradient(profile):
    n = profile.warmup + profile.repeats
    ref, sub = router_untrained_steps(n)
    ctx = context(profile, {"moe": run(workloads(profile.moe["warmup"] + profile.moe["repeats"]), 1 / 8),
                            "reference": run(sub, 1.0)})
    ctx.job.reference.train = run(ref, 2.0)
    scoring.grade_moe(ctx)
    output = ctx.tests[0]["output"]
    assert ctx.tests[0]["score"] == 0
    assert ". In words: the router (gate.weight) of layer 1 got no gradient (its moment is 0 where the starter's is " \
           "not): usually the routing weights" in output, output


def test_moments_in_words_puts_the_missing_gradient_first_and_counts_every_layer():
    worst = [{"step": 3, "name": "backbone.layers.4.mixer.experts.13.down_proj (direction)", "starter": 0.005,
              "yours": 0.0018, "error": 1.5},
             *({"step": 3, "name": f"backbone.layers.{layer}.mixer.gate.weight{suffix}", "starter": 6e-4, "yours": 0.0,
                "error": error} for layer, error in ((4, 1.2), (7, 0.9), (1, 0.6)) for suffix in ("", " (direction)")),
             *({"step": 3, "name": "backbone.layers.2.mixer.conv1d.weight (direction)", "starter": 1.0, "yours": 0.5,
                "error": 0.1} for _ in range(3))]
    words = explain.moments_in_words(worst)
    assert words.startswith("the router (gate.weight) of layers 1, 4 and 7 got no gradient")
    assert "the routed experts of layer 4 stepped another way than the starter's" in words
    assert "conv1d" not in words  # beyond the five worst, only what no gradient reached is told
    assert explain.moments_in_words([]) is None


def test_moments_read_by_layer_are_said_in_words_too():
    """bfloat16 profiles read each layer's moments summed, a parameter stepped on one side only
    infinitely wrong (error None in the record)."""
    ref, sub = router_untrained_steps(2)
    entries = worst_moments(ref, sub, sys.maxsize, "layers")
    assert any(entry["error"] is None for entry in entries)
    assert explain.moments_in_words(entries).startswith("the router (gate.weight) of layer 1 got no gradient")


def test_a_layout_wrong_because_part1_is_says_so(profile):
    n = profile.warmup + profile.repeats
    wrong = ep_steps(profile, n)
    wrong[-1]["loss"] *= 1.5
    for moe_wrong, says in ((True, True), (False, False)):
        ctx = context(profile, {"ep": run(wrong, 0.5, traffic=2**20)})
        if moe_wrong:
            ctx.wrong.add("moe")
        scoring.grade_ep(ctx)
        output = ctx.tests[0]["output"]
        assert output.startswith("wrong: ") and ("runs your code of Part 1 (the MoE layer) too" in output) == says
        assert "Reproduce it locally: `.venv/bin/python -m pytest a1_infra/tests/test_part2_ep.py -q`" in output
    # right losses beside a wrong Part 1: nothing to blame on it
    ctx = context(profile, {"ep": run(ep_steps(profile, n), 0.5, traffic=2**20)})
    ctx.wrong.add("moe")
    scoring.grade_ep(ctx)
    assert "Part 1" not in ctx.tests[0]["output"] and ctx.tests[0]["score"] == 3


def test_a_pipeline_with_expert_parallelism_names_part2_as_well(profile):
    """cpu-8proc and h100x8 run pp=2 with ep=4: Part 3's model holds Part 2's code as well."""
    pp_with_ep = {**profile.layouts, "pp": {"world": 8, "dp": 4, "ep": 4, "pp": 2}}
    ctx = context(dataclasses.replace(profile, layouts=pp_with_ep, pipeline_memory=None), {})
    ctx.wrong |= {"moe", "ep"}
    said = scoring._after_wrong_parts(ctx, "pp", False, "wrong losses")
    assert "your code of Part 1 (the MoE layer) and Part 2 (expert parallelism) too" in said and "fix them" in said
    assert scoring._after_wrong_parts(ctx, "pp", True, "right losses") == "right losses"
    ctx.wrong = {"ep"}
    assert "Part 2" not in scoring._after_wrong_parts(context(profile, {}), "pp", False, "x")  # pp=2 alone


# A two-rank pp run's log tail: the end of rank 0's traceback, then rank 1's whole (the demo's)
SCRATCH = "/tmp/onenode-scratch/sub-uyyj8cmv"
VENV = "/work/main/.venv/lib/python3.11/site-packages"
FRAMES = (f'  File "{SCRATCH}/harness.py", line 677, in _rank_main\n'
          "    session = TrainSession(spec, rank, counter)\n"
          f'  File "{SCRATCH}/starter_code/onenode/parallel/pipeline.py", line 69, in split_stage\n'
          "    decoder = model.model\n"
          f'  File "{VENV}/torch/nn/modules/module.py", line 1967, in __getattr__\n'
          "    raise AttributeError(\n"
          "AttributeError: 'NemotronHForCausalLM' object has no attribute 'model'\n")
FAILURE = ("rank 1: AttributeError: 'NemotronHForCausalLM' object has no attribute 'model'\n\n"
           + FRAMES.split("\n", 2)[2] + "Traceback (most recent call last):\n" + FRAMES)


def test_a_failure_shows_one_traceback_with_the_students_paths():
    shown = student_paths(one_traceback(FAILURE))
    assert shown.count("Traceback (most recent call last):") == 1
    assert shown.count("AttributeError: 'NemotronHForCausalLM'") == 2  # the error line, and the traceback's end
    assert 'File "starter_code/onenode/parallel/pipeline.py", line 69' in shown
    assert 'File ".venv/lib/python3.11/site-packages/torch/nn/modules/module.py"' in shown
    assert "onenode-scratch" not in shown and "/work/" not in shown


def test_a_chained_traceback_stays_whole_and_a_failure_without_one_is_kept():
    chained = ("RuntimeError: outer\n\nTraceback (most recent call last):\n  File \"a.py\"\nKeyError: 'x'\n\n"
               "During handling of the above exception, another exception occurred:\n\n"
               "Traceback (most recent call last):\n  File \"b.py\"\nRuntimeError: outer\n")
    assert one_traceback(chained).count("Traceback (most recent call last):") == 2
    assert one_traceback("no answer within the profile's 240 s\n\nsome log") == \
        "no answer within the profile's 240 s\n\nsome log"


def test_a_profile_that_scores_no_step_tells_no_step_speed_anywhere_in_a_wrong_part1():
    """cpu-tiny: the wrong layer's 8x and the step's figures stay out of every output but the
    layer's own timing."""
    tiny = load_rubric().profile("cpu-tiny")
    n_moe = tiny.moe["warmup"] + tiny.moe["repeats"]
    ctx = context(tiny, {"moe": run(routerless(workloads(n_moe)), 1 / 8), "reference": honest_step(tiny, 0.1)})
    scoring.grade_moe(ctx)
    text = " ".join(t["output"] for t in ctx.tests)
    assert not re.search(r"tokens/s|whole step, reference layout: [\d,]+|x the starter", text), text
