"""A1's comparisons and points on made-up evidence: `grader/a1/compare.py` (malformed answers are
infinitely wrong; each expert's gradient is judged on its own scale), `speed_share`, and Part 1
and 2's scoring from made-up runs, with speed ranges where a ratio taken upside down would show
(cpu-tiny's step ranges give full points to 0.68x and to 1.47x alike)."""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from grader.a1 import scoring
from grader.a1.compare import (
    loss_error,
    moe_error,
    moments_direction_problem,
    moments_error,
    relative_error,
    worst_moments,
)
from grader.a1.rubric import load_rubric, speed_share
from grader.runner import SessionResult

KIT = Path(__file__).resolve().parents[1]
RTOL = 1e-4


def digest() -> dict:
    """One forward+backward pass's digest (harness `MoeSession.step`): four experts, the third a
    rarely routed one (its gradient a thousandth of the others'), the fourth chosen by no token;
    the router's and a shared expert's gradients by name."""
    return {
        "out": [1.5, -2.0, 4.0],
        "dx": [0.25, 0.5, 2.0],
        "experts": {"up": [[0.3, 2.0], [-0.7, 1.5], [0.001, 0.002], [0.0, 0.0]],
                    "down": [[1.1, 3.0], [0.2, 2.5], [-0.0005, 0.001], [0.0, 0.0]]},
        "named": {"gate.weight": [-0.2, 0.5], "shared_experts.up_proj.weight": [1.2, 2.0]},
        "dparams": [1000.0, 80.0, 40.0],
    }


def workloads(n: int = 2, iters: int = 2) -> list[list[dict]]:
    return [[digest() for _ in range(iters)] for _ in range(n)]


def changed(edit) -> list[list[dict]]:
    """The made-up workloads with `edit(first digest)` applied."""
    sub = workloads()
    edit(sub[0][0])
    return sub


# -- relative_error and the MoE digests --------------------------------------------------------
def test_identical_digests_match():
    assert moe_error(workloads(), workloads()) == 0.0


def test_rounding_stays_within_tolerance():
    sub = changed(lambda d: d["experts"]["up"][2].__setitem__(0, 0.001 * (1 + 1e-6)))
    assert 0 < moe_error(workloads(), sub) < RTOL


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1.5", None, True, [1.5]])
@pytest.mark.parametrize("where", ["out", "dx", "up", "down", "gate.weight", "dparams"])
def test_a_value_that_is_not_a_finite_number_is_infinitely_wrong(bad, where):
    def edit(d):
        target = d["experts"][where][1] if where in ("up", "down") else d["named"].get(where, d.get(where))
        target[0] = bad

    assert moe_error(workloads(), changed(edit)) == math.inf


@pytest.mark.parametrize("edit", [
    lambda d: d["out"].pop(),                       # a short sketch
    lambda d: d["dx"].append(0.0),                  # an extra projection
    lambda d: d["experts"]["up"].pop(),             # an expert missing
    lambda d: d["experts"]["down"].append([0.0, 0.0]),  # an extra expert
    lambda d: d["experts"]["up"][1].pop(),          # an expert's sketch short
    lambda d: d["experts"]["up"][1].append(0.0),    # ...or long
    lambda d: d["experts"].pop("down"),             # a projection missing
    lambda d: d["experts"].__setitem__("gate", []),  # an extra projection
    lambda d: d.__setitem__("extra", 0.0),          # an extra entry
    lambda d: d.pop("dparams"),                     # a missing one
    lambda d: d["dparams"].append(1.0),             # totals of the wrong length
    lambda d: d.__setitem__("experts", []),         # the wrong type
    lambda d: d["experts"].__setitem__("up", {}),
    lambda d: d.__setitem__("out", {"0": 1.5}),
    lambda d: d["named"].pop("gate.weight"),       # a parameter missing
    lambda d: d["named"].__setitem__("router.weight", [0.0, 0.0]),  # ...or extra
    lambda d: d["named"]["gate.weight"].pop(),      # its sketch short
    lambda d: d.__setitem__("named", [[-0.2, 0.5]]),
], ids=["short-sketch", "long-sketch", "expert-missing", "extra-expert", "short-expert", "long-expert",
        "projection-missing", "extra-projection", "extra-entry", "missing-entry", "long-totals",
        "experts-not-a-dict", "projection-not-a-list", "sketch-not-a-list", "parameter-missing", "extra-parameter",
        "short-parameter", "parameters-not-a-dict"])
def test_malformed_digests_are_infinitely_wrong(edit):
    assert moe_error(workloads(), changed(edit)) == math.inf


@pytest.mark.parametrize("sub", [[], workloads(1), workloads(3), [[]] + workloads()[1:], workloads(iters=1),
                                 workloads(iters=3), [digest(), digest()], None, "digests"],
                         ids=["empty", "short", "extra-workload", "empty-workload", "short-workload",
                              "long-workload", "not-nested", "none", "string"])
def test_missing_or_extra_workloads_are_infinitely_wrong(sub):
    assert moe_error(workloads(), sub) == math.inf


def test_a_digest_that_is_not_a_dict_is_infinitely_wrong():
    sub = workloads()
    sub[1][1] = [1.5, -2.0, 4.0]
    assert moe_error(workloads(), sub) == math.inf


def test_swapped_experts_are_wrong():
    def swap(d):
        up = d["experts"]["up"]
        up[0], up[1] = up[1], up[0]

    assert moe_error(workloads(), changed(swap)) > 0.1


def test_a_rarely_routed_experts_gradient_is_judged_on_its_own_scale():
    """Its sign flipped: a thousandth of the largest expert's norm, all of its own."""
    sub = changed(lambda d: d["experts"]["up"][2].__setitem__(0, -0.001))
    assert moe_error(workloads(), sub) == pytest.approx(1.0)
    sub = changed(lambda d: d["experts"]["down"][2].__setitem__(1, 0.002))  # twice its norm
    assert moe_error(workloads(), sub) == pytest.approx(1.0)


def test_only_zero_matches_an_expert_no_token_chose():
    assert moe_error(workloads(), changed(lambda d: d["experts"]["up"][3].__setitem__(1, 1e-9))) > 1


def test_a_parameters_gradient_pointing_another_way_shows_though_the_totals_match():
    """The router's gradient negated: its norm, and every total, the starter's."""
    sub = changed(lambda d: d["named"]["gate.weight"].__setitem__(0, 0.2))
    assert moe_error(workloads(), sub) == pytest.approx(0.8)


def test_wrong_gradient_totals_show():
    assert moe_error(workloads(), changed(lambda d: d["dparams"].__setitem__(2, 44.0))) == pytest.approx(0.05)


def test_relative_error():
    assert relative_error(1.1, 1.0, 2.0) == pytest.approx(0.05)
    assert relative_error(0.0, 0.0, 0.0) == 0.0
    assert relative_error(1e-20, 0.0, 0.0) > 1e9
    assert relative_error(math.nan, 1.0, 1.0) == relative_error("1", 1.0, 1.0) == math.inf


# -- the training steps' losses --------------------------------------------------------------------
def moments() -> dict:
    """One step's optimizer moments (harness `OptimizerMoments`), each [squared norm, projection on
    a random direction]: two parameters, one of them a rarely moved one (norm 0.02), and a MoE
    layer of two experts, the second chosen by no token."""
    return {"params": {"backbone.embeddings.weight": [4.0, -1.0], "backbone.layers.0.mixer.dt_bias": [0.0004, 0.01]},
            "experts": {"backbone.layers.1.mixer.": [[[1.0, 0.5], [4.0, -1.0]], [[0.0, 0.0], [0.0, 0.0]]]}}


def steps(n: int = 3) -> list[dict]:
    return [{"loss": 4.0 - 0.1 * i, "grad_norm": 1.0 + i, "bytes": {}, "moments": moments()} for i in range(n)]


def test_the_same_steps_match_and_a_difference_is_relative():
    assert loss_error(steps(), steps()) == 0.0
    sub = steps()
    sub[2]["grad_norm"] *= 1.01
    assert loss_error(steps(), sub) == pytest.approx(0.01)


@pytest.mark.parametrize("edit", [
    lambda s: s[0].__setitem__("loss", math.nan),
    lambda s: s[1].__setitem__("grad_norm", math.inf),
    lambda s: s[2].__setitem__("loss", None),
    lambda s: s[2].__setitem__("loss", "4.0"),
    lambda s: s[0].pop("grad_norm"),
    lambda s: s[1].__setitem__("grad_norm_clipped", 1.0),
    lambda s: s.pop(),
    lambda s: s.append(dict(s[-1])),
    lambda s: s.clear(),
    lambda s: s.__setitem__(1, [3.9, 2.0]),
], ids=["nan-loss", "inf-grad-norm", "none", "string", "missing-key", "extra-key", "short", "extra-step", "empty",
        "not-a-dict"])
def test_malformed_steps_are_infinitely_wrong(edit):
    sub = steps()
    edit(sub)
    assert loss_error(steps(), sub) == math.inf


def test_steps_that_are_not_a_list_are_infinitely_wrong():
    assert loss_error(steps(), None) == loss_error(steps(), {"0": steps()[0]}) == math.inf


# -- the optimizer's moments after the last step -------------------------------------------------
def test_the_same_moments_match_and_each_is_judged_on_its_own_scale():
    assert moments_error(steps(), steps()) == 0.0
    sub = steps()
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"][0] *= 1.02  # a squared norm: 1% of the norm
    assert moments_error(steps(), sub) == pytest.approx(0.01)
    sub = steps()
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"][1] += 0.0002  # a projection: 1% of the norm
    assert moments_error(steps(), sub, directions=True) == pytest.approx(0.01)
    assert moments_error(steps(), sub) == 0.0


def test_a_parameter_the_step_left_untrained_is_wrong():
    sub = steps()
    sub[0]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"] = [0.0, 0.0]
    assert moments_error(steps(), sub) == pytest.approx(0.5)


def test_only_zero_moments_match_an_expert_no_token_chose():
    sub = steps()
    sub[2]["moments"]["experts"]["backbone.layers.1.mixer."][1] = [[1e-9, 0.0], [0.0, 0.0]]
    assert moments_error(steps(), sub) > 1e6
    sub[2]["moments"]["experts"]["backbone.layers.1.mixer."][1] = [[0.0, 1e-9], [0.0, 0.0]]
    assert moments_error(steps(), sub, directions=True) > 1e6


@pytest.mark.parametrize("edit", [
    lambda m: m["params"].pop("backbone.embeddings.weight"),
    lambda m: m["params"].__setitem__("backbone.extra.weight", 1.0),
    lambda m: m["params"].__setitem__("backbone.embeddings.weight", math.nan),
    lambda m: m["params"].__setitem__("backbone.embeddings.weight", "2.0"),
    lambda m: m["params"]["backbone.embeddings.weight"].__setitem__(1, math.nan),
    lambda m: m["params"]["backbone.embeddings.weight"].__setitem__(1, "-1.0"),
    lambda m: m["params"]["backbone.embeddings.weight"].pop(),
    lambda m: m["params"].__setitem__("backbone.embeddings.weight", 4.0),
    lambda m: m["experts"].clear(),
    lambda m: m["experts"]["backbone.layers.1.mixer."].pop(),
    lambda m: m["experts"]["backbone.layers.1.mixer."][0].append([3.0, 0.0]),
    lambda m: m["experts"]["backbone.layers.1.mixer."][0][1].pop(),
    lambda m: m["experts"].__setitem__("backbone.layers.1.mixer.", [[[2.0, 1.0]] * 2] * 3),
    lambda m: m.pop("experts"),
], ids=["missing-param", "extra-param", "nan", "string", "nan-projection", "string-projection", "no-projection",
        "squared-norm-alone", "no-moe-layer", "short-experts", "long-pair", "short-entry", "extra-expert",
        "no-experts"])
def test_malformed_moments_are_infinitely_wrong(edit):
    sub = steps()
    edit(sub[1]["moments"])
    assert moments_error(steps(), sub) == moments_error(steps(), sub, directions=True) == math.inf


def test_the_worst_moments_name_where_the_error_comes_from():
    sub = steps()
    sub[2]["moments"]["experts"]["backbone.layers.1.mixer."][0][1][0] *= 3.0
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"][0] *= 1.02
    worst = worst_moments(steps(), sub, count=2)
    assert [(w["step"], w["name"]) for w in worst] == [(2, "backbone.layers.1.mixer.experts.0.down_proj"),
                                                        (1, "backbone.layers.0.mixer.dt_bias")]
    assert worst[0]["yours"] == pytest.approx(3 * worst[0]["starter"]) and worst[0]["error"] == pytest.approx(1.0)
    assert worst_moments(steps(), [None] * 3) == []


# -- which way the step went: the moments' projections -----------------------------------------------
def test_a_negated_gradient_keeps_every_norm_and_is_wrong():
    """The starter's projection of dt_bias is half its norm: negated, it is off by its norm."""
    sub = steps()
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"][1] *= -1
    assert moments_error(steps(), sub, directions=True) == pytest.approx(1.0)
    assert moments_error(steps(), sub) == 0.0
    worst = worst_moments(steps(), sub, count=2)
    assert worst[0]["name"] == "backbone.layers.0.mixer.dt_bias (direction)" and worst[1]["error"] == 0.0
    assert moments_direction_problem(steps(), sub, RTOL) == (
        "backbone.layers.0.mixer.dt_bias: its gradient points another way than the starter's (a sign or a swapped "
        "gradient?)")
    assert moments_direction_problem(steps(), steps(), RTOL) is None


def test_a_gradient_of_the_wrong_size_is_not_called_one_pointing_another_way():
    sub = steps()
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"] = [0.0016, 0.02]  # twice the gradient
    assert moments_error(steps(), sub) > 0.5
    assert moments_direction_problem(steps(), sub, RTOL) is None


def test_swapped_expert_gradients_point_another_way_each():
    sub = steps()
    experts = sub[0]["moments"]["experts"]["backbone.layers.1.mixer."]
    experts[0][0][1], experts[0][1][1] = 1.0, -0.5  # equal norms (made-up), the projections swapped
    experts[0][0][0] = experts[0][1][0] = 4.0
    ref = steps()
    ref[0]["moments"]["experts"]["backbone.layers.1.mixer."][0][0][0] = 4.0
    assert moments_direction_problem(ref, sub, RTOL) == (
        "backbone.layers.1.mixer.experts.0.up_proj, backbone.layers.1.mixer.experts.0.down_proj: their gradients "
        "point another way than the starter's (a sign or a swapped gradient?)")


def test_read_by_layer_projections_add_up_per_layer():
    """A negated gradient of a parameter that weighs in its layer is wrong on its own scale; one
    at bfloat16's noise (dt_bias, a ten-thousandth of its layer) only moves its layer's sum."""
    ref = steps()
    for step in ref:
        step["moments"]["params"].update({"backbone.layers.0.mixer.in_proj.weight": [1.0, 0.3],
                                          "backbone.layers.0.mixer.out_proj.weight": [1.0, -0.4]})
    h200x1 = load_rubric().profile("h200x1").moments_rtol  # its norms' (it records the directions only)
    sub = copy.deepcopy(ref)
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.in_proj.weight"][1] = -0.3
    assert moments_error(ref, sub, "layers", directions=True) == pytest.approx(0.6) and 0.6 > h200x1
    assert moments_direction_problem(ref, sub, h200x1, "layers").startswith(
        "backbone.layers.0.mixer.in_proj.weight, backbone.layers.0.* (summed): their gradients point another way")
    sub = copy.deepcopy(ref)
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"][1] = -0.01
    assert moments_error(ref, sub, "layers", directions=True) == pytest.approx(0.02 / math.sqrt(2.0004))


def test_records_of_squared_norms_alone_still_read_and_forms_must_agree():
    """Records made before the projections (benchmarks/results/) hold a squared norm per entry:
    read as such; an answer in another form than the starter's is malformed."""
    def squared_norms_alone(steps_):
        for step in steps_:
            moments = step["moments"]
            moments["params"] = {name: value[0] for name, value in moments["params"].items()}
            moments["experts"] = {prefix: [[up[0], down[0]] for up, down in pairs]
                                  for prefix, pairs in moments["experts"].items()}
        return steps_

    old = squared_norms_alone(steps())
    assert moments_error(old, squared_norms_alone(steps())) == moments_error(old, old, "layers") == 0.0
    assert moments_error(old, old, directions=True) == moments_error(old, old, "layers", directions=True) == 0.0
    sub = squared_norms_alone(steps())
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"] *= 1.02
    assert moments_error(old, sub) == pytest.approx(0.01)
    assert moments_error(old, steps()) == moments_error(steps(), old) == math.inf
    assert moments_error(old, steps(), "layers") == moments_error(steps(), old, "layers") == math.inf


# -- the moments read by layer (bfloat16 profiles) -----------------------------------------------------
def test_read_by_layer_a_parameter_at_the_noise_is_summed_into_its_layer():
    """bfloat16: a dt_bias whose moment reads 3x on another run (its gradient at the noise) is
    wrong entry by entry, and by its layer's sum only by its share of it."""
    ref = steps()
    for step in ref:
        step["moments"]["params"]["backbone.layers.0.mixer.in_proj.weight"] = [1.0, 0.3]
    sub = copy.deepcopy(ref)
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"][0] *= 3.0
    assert moments_error(ref, sub) == pytest.approx(1.0)
    assert moments_error(ref, sub, "layers") == pytest.approx(0.0008 / (2 * 1.0004))
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.in_proj.weight"] = [1.5, 0.3]  # the layer's weight: wrong
    assert moments_error(ref, sub, "layers") > 0.2


def test_read_by_layer_a_parameter_that_weighs_in_its_layer_is_read_on_its_own_scale():
    """Half the gradient of a parameter holding half its layer's moments moves the layer's sum by
    0.19, under h200x1's 0.2; on its own scale it is 0.375 wrong."""
    ref = steps()
    for step in ref:
        step["moments"]["params"].update({"backbone.layers.0.mixer.in_proj.weight": [1.0, 0.3],
                                          "backbone.layers.0.mixer.out_proj.weight": [1.0, -0.4]})
    sub = copy.deepcopy(ref)
    sub[1]["moments"]["params"]["backbone.layers.0.mixer.in_proj.weight"] = [0.25, 0.15]
    assert moments_error(ref, sub, "layers") == pytest.approx(0.375)
    worst = worst_moments(ref, sub, count=2, reading="layers")
    assert [w["name"] for w in worst] == ["backbone.layers.0.mixer.in_proj.weight", "backbone.layers.0.* (summed)"]
    assert worst[1]["error"] == pytest.approx(0.75 / (2 * 2.0004))
    assert worst[1]["error"] < load_rubric().profile("h200x1").moments_rtol < worst[0]["error"]


def test_read_by_layer_a_parameter_stepped_on_one_side_only_is_infinitely_wrong():
    sub = steps()
    sub[0]["moments"]["params"]["backbone.layers.0.mixer.dt_bias"] = [0.0, 0.0]  # never trained
    assert moments_error(steps(), sub, "layers") == math.inf
    worst = worst_moments(steps(), sub, count=1, reading="layers")
    assert worst[0]["name"] == "backbone.layers.0.mixer.dt_bias" and worst[0]["error"] is None


def test_read_by_layer_routed_experts_are_summed_apart_from_the_layers_other_parameters():
    sub = steps()
    sub[2]["moments"]["experts"]["backbone.layers.1.mixer."][1] = [[1e-9, 0.0], [0.0, 0.0]]  # a routing flip
    assert moments_error(steps(), sub, "layers") == pytest.approx(1e-9 / 10)  # no longer inf
    sub = steps()
    sub[2]["moments"]["experts"]["backbone.layers.1.mixer."][0] = [[2.0, 1.0], [8.0, -2.0]]  # twice over
    assert moments_error(steps(), sub, "layers") == pytest.approx(0.5)
    assert worst_moments(steps(), sub, count=1, reading="layers")[0]["name"] == \
        "backbone.layers.1.routed experts (summed)"


@pytest.mark.parametrize("edit", [
    lambda m: m["params"].__setitem__("backbone.layers.0.mixer.dt_bias", math.nan),
    lambda m: m["experts"]["backbone.layers.1.mixer."][0].__setitem__(0, "1.0"),
    lambda m: m["experts"]["backbone.layers.1.mixer."].pop(),
    lambda m: m["params"].pop("backbone.embeddings.weight"),
], ids=["nan", "string", "short-experts", "missing-param"])
def test_read_by_layer_malformed_moments_are_infinitely_wrong(edit):
    sub = steps()
    edit(sub[1]["moments"])
    assert moments_error(steps(), sub, "layers") == math.inf


def test_part_2_reads_the_busiest_ranks_share_of_the_experts_and_what_the_routing_must_move():
    from onenode.model import routed_expert_parameters

    profile = load_rubric().profile("cpu-tiny")
    whole = routed_expert_parameters(scoring._profile_config(profile))
    half = [whole // 2, whole // 2, whole]  # parameters, gradients, two AdamW moments
    run = SessionResult(digests=[{"experts_held": [half, half]}])
    assert scoring.experts_held_share(profile, run) == 0.5
    run.digests.append({"experts_held": [half, [whole // 2, whole // 2, 2 * whole]]})  # one rank's moments of all
    assert scoring.experts_held_share(profile, run) == 1.0
    starter = SessionResult(digests=[{"routes": 1000}] * profile.warmup + [{"routes": r} for r in (3, 5, 100)])
    hidden_bytes = scoring._profile_config(profile).hidden_size * 4  # float32
    assert scoring.token_traffic(profile, starter) == 4 * hidden_bytes * 5  # there and back, forward and backward


def test_an_ep_layout_without_part_2s_bounds_is_refused():
    profile = load_rubric().profile("cpu-tiny")
    with pytest.raises(ValueError, match="ep layout needs max_expert_state and min_token_traffic"):
        dataclasses.replace(profile, max_expert_state=None)


def test_a_profile_names_a_reading_the_grader_has():
    profile = load_rubric().profile("h200x1")
    assert profile.moments_reading == "layers" and profile.moments_rtol is not None
    with pytest.raises(ValueError, match="moments_reading = 'sums'"):
        dataclasses.replace(profile, moments_reading="sums")


@pytest.mark.parametrize("sub", [None, [], [{"loss": 4.0}] * 3], ids=["none", "empty", "no-moments"])
def test_steps_without_moments_are_infinitely_wrong(sub):
    assert moments_error(steps(), sub) == math.inf
    assert moments_error(steps(), [{**s, "moments": None} for s in steps()]) == math.inf


# -- speed_share -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, share", [(0.5, 0.0), (1.2, 0.0), (math.sqrt(1.2 * 3.0), 0.5), (3.0, 1.0),
                                          (30.0, 1.0), (math.nan, 0.0), (-2.0, 0.0)])
def test_speed_share_below_at_and_above_its_range(value, share):
    assert speed_share(value, 1.2, 3.0) == pytest.approx(share)


def test_a_speed_range_must_rise_from_above_zero():
    tiny = load_rubric().profile("cpu-tiny")
    for bad in ([0.0, 2.0], [2.0, 2.0], [3.0, 1.2], [1.2]):
        with pytest.raises(ValueError, match="moe_step"):
            dataclasses.replace(tiny, speed={**tiny.speed, "moe_step": bad})


# -- Part 1 and Part 2 scored from made-up runs ------------------------------------------------------
def run(digests: list, seconds: float, traffic: int = 0) -> SessionResult:
    return SessionResult(digests=copy.deepcopy(digests), seconds=[seconds] * len(digests),
                         traffic=[traffic] * len(digests))


@pytest.fixture
def profile():
    """cpu-tiny with the GPU profiles' speed ranges, every one scored (h200x1): a ratio taken upside
    down scores differently there."""
    rubric = load_rubric()
    gpu = rubric.profile("h200x1")
    return dataclasses.replace(rubric.profile("cpu-tiny"), speed=gpu.speed, scored_speeds=gpu.scored_speeds)


def context(profile, runs: dict[str, SessionResult], starter_step_s: float = 2.0) -> scoring.Context:
    """A grading context whose starter ran its MoE layer in 1 s a workload and its steps in
    `starter_step_s`; `runs` are the submission's (moe, moe-starter, reference, ep)."""
    n_moe = profile.moe["warmup"] + profile.moe["repeats"]
    n_steps = profile.warmup + profile.repeats
    moe = run(workloads(n_moe), 1.0)
    reference = SimpleNamespace(moe=moe, moe_exact=moe, train=run(steps(n_steps), starter_step_s),
                                ep=run(ep_steps(profile, n_steps), starter_step_s, traffic=100 * 2**20), pp_train=None)
    job = SimpleNamespace(rubric=load_rubric(), profile=profile, reference=reference)
    runs = {"moe-starter": run(workloads(n_moe), 1.0), **runs}
    return scoring.Context(job, SimpleNamespace(name="made-up"), runs, logs=None)


def part1(profile, layer_s: float, step: SessionResult | None, layer: list | None = None) -> tuple[list, list]:
    n_moe = profile.moe["warmup"] + profile.moe["repeats"]
    runs = {"moe": run(layer if layer is not None else workloads(n_moe), layer_s)}
    if step is not None:
        runs["reference"] = step
    ctx = context(profile, runs)
    scoring.grade_moe(ctx)
    return [t["score"] for t in ctx.tests], [t["output"] for t in ctx.tests]


def honest_step(profile, seconds: float) -> SessionResult:
    return run(steps(profile.warmup + profile.repeats), seconds)


def test_part1_speed_is_the_mean_of_the_layer_and_step_shares(profile):
    """Layer 1/0.25 = 4x the starter, step 2/1 = 2x: each share on its own range, never inverted."""
    scores, outputs = part1(profile, 0.25, honest_step(profile, 1.0))
    layer, whole = speed_share(4.0, *profile.speed["moe_layer"]), speed_share(2.0, *profile.speed["moe_step"])
    assert 0 < layer < 1 and 0 < whole < 1
    assert scores == [4.0, pytest.approx(6 * (layer + whole) / 2, abs=1e-3)]
    assert "2.00x the starter" in outputs[1] and "4.00x" in outputs[1]


def test_a_step_slower_than_the_starter_earns_no_step_points(profile):
    scores, _ = part1(profile, 0.25, honest_step(profile, 4.0))  # 0.5x: upside down it would be 2x
    assert scores == [4.0, pytest.approx(6 * speed_share(4.0, *profile.speed["moe_layer"]) / 2, abs=1e-3)]


def wrong_step(profile) -> SessionResult:
    """The top-1-instead-of-top-k kind: it trains, fast, to other losses."""
    wrong = steps(profile.warmup + profile.repeats)
    wrong[-1]["loss"] *= 1.2
    return run(wrong, 0.1)


@pytest.mark.parametrize("step, says", [
    (wrong_step, r"whole step, reference layout: loss and gradient norm .* worst relative error 0\.2"),
    (lambda p: SessionResult(error="RuntimeError: boom"), r"whole step, reference layout: failed \(RuntimeError"),
    (lambda p: None, r"whole step, reference layout: failed \(it did not run\)"),
    (lambda p: run([{**s, "grad_norm": math.nan} for s in steps(p.warmup + p.repeats)], 1.0),
     r"worst relative error inf"),
], ids=["wrong-losses", "failed", "missing", "nan"])
def test_a_wrong_or_failed_step_zeroes_part1(profile, step, says):
    """The layer is exact and fast (8x: all its speed points); the step is not right."""

    scores, outputs = part1(profile, 1 / 8, step(profile))
    assert scores == [0, 0]
    assert outputs[0].startswith("wrong: ") and re.search(says, outputs[0]), outputs[0]
    assert outputs[1].startswith("zeroed (wrong results)")


def moments_off_step(profile) -> SessionResult:
    """A step whose losses are the starter's but that left one parameter untrained."""
    wrong = steps(profile.warmup + profile.repeats)
    for step in wrong:
        step["moments"]["params"]["backbone.layers.0.mixer.dt_bias"] = [0.0, 0.0]
    return run(wrong, 0.1)


def test_a_step_that_applied_other_gradients_zeroes_part1(profile):
    assert profile.moments_rtol is not None  # the CPU profiles score the moments
    scores, outputs = part1(profile, 1 / 8, moments_off_step(profile))
    assert scores == [0, 0]
    assert re.search(r"first moments .* worst relative error 0\.5 \(tolerance", outputs[0]), outputs[0]


def negated_step(profile) -> SessionResult:
    """Every norm the starter's, the losses too: one parameter's gradient negated."""
    negated = steps(profile.warmup + profile.repeats)
    for step in negated:
        step["moments"]["params"]["backbone.layers.0.mixer.dt_bias"][1] *= -1
    return run(negated, 0.1)


def test_a_step_whose_gradient_points_another_way_zeroes_part1(profile):
    scores, outputs = part1(profile, 1 / 8, negated_step(profile))
    assert scores == [0, 0]
    assert re.search(r"first moments .* worst relative error 0 \(tolerance 0\.001\), along random directions 1 "
                     r"\(tolerance 0\.001\): backbone\.layers\.0\.mixer\.dt_bias: its gradient points another way "
                     r"than the starter's", outputs[0]), outputs[0]


def test_a_renamed_parameter_is_named_in_the_feedback(profile):
    renamed = steps(profile.warmup + profile.repeats)
    for step in renamed:
        params = step["moments"]["params"]
        params["backbone.layers.0.mixer.delta_bias"] = params.pop("backbone.layers.0.mixer.dt_bias")
    scores, outputs = part1(profile, 1 / 8, run(renamed, 0.1))
    assert scores == [0, 0]
    assert "missing backbone.layers.0.mixer.dt_bias; new backbone.layers.0.mixer.delta_bias" in outputs[0]
    assert "keep the starter's names outside the routed experts" in outputs[0]


def test_a_profile_without_a_moments_tolerance_records_them_only(profile):
    unscored = dataclasses.replace(profile, moments_rtol=None, moments_direction_rtol=None)
    scores, outputs = part1(unscored, 1 / 8, moments_off_step(profile))
    assert scores[0] == 4.0
    assert re.search(r"worst relative error 0\.5 \(recorded, not scored.*\), along random directions 0\.5 "
                     r"\(recorded, not scored", outputs[0]), outputs[0]
    scores, outputs = part1(dataclasses.replace(profile, moments_direction_rtol=None), 1 / 8, negated_step(profile))
    assert scores[0] == 4.0 and "points another way" not in outputs[0]


def test_the_cpu_profiles_score_the_directions_and_the_bfloat16_ones_record_them():
    rubric = load_rubric()
    assert [rubric.profile(name).moments_direction_rtol for name in ("cpu-tiny", "cpu-8proc")] == [1e-3, 1e-3]
    assert all(rubric.profile(name).moments_direction_rtol is None for name in ("h200x1", "h200x2", "h100x8"))


def test_breaking_the_step_never_earns_more_than_an_honest_slow_one(profile):
    honest, _ = part1(profile, 1 / 8, honest_step(profile, 2.0))  # a fast layer, the starter's step time
    broken, _ = part1(profile, 1 / 8, wrong_step(profile))
    assert sum(broken) == 0 < sum(honest) == pytest.approx(4 + 3)


def test_a_wrong_layer_zeroes_part1_whatever_its_step(profile):
    n_moe = profile.moe["warmup"] + profile.moe["repeats"]
    layer = workloads(n_moe)
    layer[-1][0]["experts"]["up"][2][0] *= -1  # the rare expert's gradient, sign flipped
    scores, outputs = part1(profile, 1 / 8, honest_step(profile, 0.5), layer=layer)
    assert scores == [0, 0] and outputs[0].startswith("wrong: ")


def ep_steps(profile, n: int, held: float = 0.5, routes: int = 100) -> list[dict]:
    """`steps` of the ep layout (two ranks): each rank holding `held` of the routed experts, and
    `routes` (token, other rank) pairs counted by the starter's routers (0.1 MiB on cpu-tiny)."""
    from onenode.model import routed_expert_parameters

    part = int(held * routed_expert_parameters(scoring._profile_config(profile)))
    return [dict(step, experts_held=[[part, part, 2 * part]] * 2, routes=routes) for step in steps(n)]


def part2(profile, step_s: float, losses: list[dict], traffic_mb: float) -> tuple[list, list]:
    ctx = context(profile, {"ep": run(losses, step_s, traffic=int(traffic_mb * 2**20))})
    scoring.grade_ep(ctx)
    return [t["score"] for t in ctx.tests], [t["output"] for t in ctx.tests]


def test_part2_speed_is_the_starter_time_over_yours(profile):
    n = profile.warmup + profile.repeats
    scores, _ = part2(profile, 1.0, ep_steps(profile, n), traffic_mb=1.0)  # the starter's ep step took 2 s
    assert scores == [3.0, 4.0, pytest.approx(3 * speed_share(2.0, *profile.speed["ep_step"]), abs=1e-3)]
    scores, _ = part2(profile, 4.0, ep_steps(profile, n), traffic_mb=1.0)  # 0.5x
    assert scores == [3.0, 4.0, 0.0]


HOLDS = r"a rank holds more than its 1/2 of the routed experts \(their parameters, gradients or optimizer state\)"
NO_TOKENS = "too little travels between the ranks for the tokens to reach the experts other ranks hold"


@pytest.mark.parametrize("held, traffic_mb, missing", [
    (1.0, 1.0, HOLDS), (0.5, 0.05, NO_TOKENS), (1.0, 0.05, f"{HOLDS}; {NO_TOKENS}"),
    (0.5, 90.0, "the expert weights still travel between the ranks"),
], ids=["whole-experts", "no-tokens", "whole-batch-on-every-rank", "weights-travel"])
def test_part2_is_earned_by_expert_parallelism_only(profile, held, traffic_mb, missing):
    """Right losses, and the expert weights' traffic gone, earn nothing unless each rank holds its
    share of the experts and the tokens' hidden states travel (and the other way round)."""
    scores, outputs = part2(profile, 1.0, ep_steps(profile, profile.warmup + profile.repeats, held), traffic_mb)
    assert scores == [0, 0, 0] and re.match(f"matches, but {missing}: loss and gradient norm", outputs[0]), outputs[0]


def test_wrong_ep_losses_zero_part2(profile):
    wrong = ep_steps(profile, profile.warmup + profile.repeats)
    wrong[0]["grad_norm"] = math.inf
    scores, outputs = part2(profile, 0.5, wrong, traffic_mb=1.0)
    assert scores == [0, 0, 0] and outputs[0].startswith("wrong: ")


# -- what a profile does not score (scored_speeds): no points, no timing told ------------------------
def test_cpu_profiles_score_the_layer_alone_and_tell_no_whole_step_speed():
    """cpu-tiny scores the MoE layer only: a whole step 20x the starter's (CPU timing noise) adds
    nothing to Part 1's speed and appears nowhere in its feedback or Gradescope leaderboard."""
    tiny = load_rubric().profile("cpu-tiny")
    assert tiny.scored_speeds == ["moe_layer"]
    n_moe = tiny.moe["warmup"] + tiny.moe["repeats"]
    ctx = context(tiny, {"moe": run(workloads(n_moe), 1 / 1.8), "reference": honest_step(tiny, 0.1)})
    scoring.grade_moe(ctx)
    correctness, speed = ctx.tests
    assert correctness["score"] == 4.0
    layer = speed_share(1.8, *tiny.speed["moe_layer"])
    assert 0 < layer < 1 and speed["score"] == pytest.approx(6 * layer, abs=1e-3)  # not halfway to a full step's
    assert "1.80x" in speed["output"] and "whole step" not in speed["output"]
    assert "x the starter" not in speed["output"] and "tokens/s" not in speed["output"]
    assert [e["name"] for e in ctx.leaderboard] == ["Part 1: MoE speedup"]
    assert ctx.measurements["reference_step_speedup"] == pytest.approx(20.0)  # recorded all the same


def test_a_part_whose_step_is_not_scored_has_a_speed_test_worth_nothing():
    """cpu-tiny's Part 2 is worth 7 (its ep step is not scored), whether the run is right, wrong
    or failed: every submission of a profile is graded out of the same points."""
    tiny = load_rubric().profile("cpu-tiny")
    n = tiny.warmup + tiny.repeats
    wrong = ep_steps(tiny, n)
    wrong[0]["loss"] *= 2
    for ep, earned in ((run(ep_steps(tiny, n), 0.1, traffic=2**20), [3.0, 4.0, 0]),  # 20x the starter's ep step
                       (run(wrong, 0.1, traffic=2**20), [0, 0, 0]), (SessionResult(error="boom"), [0, 0, 0])):
        ctx = context(tiny, {"ep": ep})
        scoring.grade_ep(ctx)
        assert [(t["score"], t["max_score"]) for t in ctx.tests] == list(zip(earned, [3.0, 4.0, 0]))
        assert ctx.tests[2]["output"] == "not scored on profile cpu-tiny (CPU timing noise)"
        assert not any(re.search(r"\d\.\d\dx", t["output"]) for t in ctx.tests)
        assert ctx.leaderboard == []


def test_a_part_that_earned_nothing_puts_no_speed_on_the_gradescope_leaderboard(profile):
    """wrong-fast-moe: a layer 8x the starter's, a step that trains differently: Part 1 is zeroed,
    and its 8x goes on no leaderboard (the numbers stay in extra_data); a right one's does."""
    n_moe = profile.moe["warmup"] + profile.moe["repeats"]
    for step, earned in ((wrong_step(profile), False), (honest_step(profile, 1.0), True)):
        ctx = context(profile, {"moe": run(workloads(n_moe), 1 / 8), "reference": step})
        scoring.grade_steps(ctx, [scoring.grade_moe])
        assert ctx.measurements["moe_speedup"] == pytest.approx(8.0)
        assert ("Part 1: MoE speedup" in [e["name"] for e in ctx.leaderboard]) == earned, ctx.leaderboard


@pytest.mark.parametrize("scored", [["moe_layer", "warp_step"], ["moe_layer", "moe_step"]],
                         ids=["unknown", "no-range"])
def test_a_scored_speed_needs_a_known_name_and_a_range(scored):
    tiny = load_rubric().profile("cpu-tiny")  # it has moe_layer's range only
    with pytest.raises(ValueError, match="scored_speeds"):
        dataclasses.replace(tiny, scored_speeds=scored)


# -- the kit's own training comparison (tests/dist_utils.py) ------------------------------------------
def test_the_kits_training_comparison_judges_each_stacked_expert_on_its_own_scale():
    import torch
    from dist_utils import assert_same_training

    experts = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(0))
    experts[2] *= 1e-4  # a rarely routed expert: its sign flipped is within 1e-3 of the largest

    def training(grads):
        return {"losses": [2.0], "grad_norms": [1.0], "grads": {"layers.0.mixer.experts.up_proj": grads.tolist()}}

    noise = 1e-4 * experts.abs().flatten(1).amax(1)[:, None, None]
    assert_same_training(training(experts), training(experts + noise), "noise")
    wrong = experts.clone()
    wrong[2] *= -1
    with pytest.raises(AssertionError, match="gradient of layers.0.mixer.experts.up_proj"):
        assert_same_training(training(experts), training(wrong), "the rare expert's sign flipped")


def test_the_h200_tolerance_sits_between_the_recorded_honest_and_wrong_steps():
    """The whole steps one H200 trained (benchmarks/results/2026-12-02-h200-a1-step-evidence/), read
    as h200x1 reads them: the starter and the honest fix within its tolerance, each wrong step
    beyond it, and the reading per entry separating nothing there."""
    record = KIT / "benchmarks" / "results" / "2026-12-02-h200-a1-step-evidence" / "reference-steps.json.gz"
    with gzip.open(record, "rt") as f:
        runs = json.load(f)
    profile = load_rubric().profile("h200x1")
    starter = runs.pop("starter")
    errors = {name: moments_error(starter, steps, profile.moments_reading) for name, steps in runs.items()}
    honest = ("starter-unchanged", "reference-full")
    assert max(errors[name] for name in honest) * 3 < profile.moments_rtol, errors
    assert min(errors[name] for name in set(errors) - set(honest)) > 2 * profile.moments_rtol, errors
    assert moments_error(starter, runs["reference-full"], "entries") > 1e6  # entry by entry it would zero the fix


def test_the_h200x1_tolerances_sit_between_the_recorded_honest_and_wrong_submissions():
    """The h200x1 re-grade over three seeds (benchmarks/results/2026-12-02-h200-a1-regrade/): every
    honest submission's whole-step and moments errors under the rubric's tolerances, the top-1 step
    beyond both, the step that skips a parameter beyond the moments'. Fails if a tolerance moves
    past what one H200 measured."""
    profile = load_rubric().profile("h200x1")
    record = KIT / "benchmarks" / "results" / "2026-12-02-h200-a1-regrade"
    step, moments = {}, {}
    for path in record.glob("*/*/results.json"):
        results = json.loads(path.read_text())
        feedback = " ".join(t["output"] for t in results["tests"] if "moe" in t["tags"])
        key = (path.parent.parent.name, path.parent.name)
        step[key] = float(re.search(r"on the same seeds: worst relative error (\S+) ", feedback)[1])
        moments[key] = results["extra_data"]["numbers"]["moments_error"]
    wrong = ("exact-layer-top1-in-the-model", "step-skips-a-parameter", "wrong-fast-moe")
    honest = [key for key in step if key[1] not in wrong]
    assert len(honest) == 8 and len(step) == 13, sorted(step)
    assert max(step[key] for key in honest) < profile.train_rtol, step
    assert max(moments[key] for key in honest) < profile.moments_rtol, moments
    for key in step:
        if key[1] == "exact-layer-top1-in-the-model":
            assert step[key] > profile.train_rtol and moments[key] > profile.moments_rtol, key
        elif key[1] == "step-skips-a-parameter":
            assert moments[key] is None, key  # infinitely wrong: recorded as null
