"""A1's sessions, seeds and timing (docs/SECURITY.md, "Sessions, seeds and timing"): each session
on a process tree and scratch of its own with seeds of its own, the starter run on each layout's
seeds, the expert gradients read from the parameters, the CPUs pinned, and on a GPU the
submission's child ended before the starter is timed. Unit tests on made-up harnesses and layers;
the red-team cases (tests/redteam/a1_sessions.py) run the same rules through the real grader."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_grader_calibration import needs_solutions
from torch import nn

from grader import runner, sandbox
from grader.a1.job import A1Job
from grader.a1.rubric import load_rubric
from grader.errors import GraderError
from grader.report import environment
from grader.runner import Harness, Session, SessionResult, run_sessions
from grader.sandbox import capabilities

KIT = Path(__file__).resolve().parents[1]
SANDBOXED = pytest.mark.skipif(
    not capabilities()["filesystem_isolated"] and os.environ.get("ONENODE_REQUIRE_SANDBOX") != "1",
    reason="needs bubblewrap (apt-get install bubblewrap)")


# -- seeds ---------------------------------------------------------------------------------------
def _job(tmp_path, profile: str = "cpu-tiny", seed: int = 7) -> A1Job:
    rubric = load_rubric()
    return A1Job(rubric, rubric.profile(profile), seed, tmp_path, tmp_path / "logs")


@pytest.mark.parametrize("profile", ["cpu-tiny", "h200x2", "h100x8"])
def test_every_session_has_seeds_of_its_own(tmp_path, profile):
    sessions = _job(tmp_path, profile).sessions()
    seen = [set(s.seeds) for s in sessions]
    assert all(len(s.seeds) == len(set(s.seeds)) for s in sessions)
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:]), [s.name for s in sessions]


@pytest.mark.parametrize("profile", ["cpu-tiny", "h200x1", "h200x2"])
def test_each_layout_is_compared_with_the_starter_on_its_own_seeds(tmp_path, profile):
    job = _job(tmp_path, profile)
    starter = {s.name: s for s in job.sessions(starter=True)}
    # the starter's runs each submission session is compared with (scoring.py)
    against = {"moe": "moe-exact" if "moe-exact" in starter else "moe", "reference": "reference", "ep": "ep",
               "pp": "pp-reference"}
    for session in job.sessions():
        ref = starter[against[session.name]]
        assert ref.seeds == session.seeds, session.name
        assert ref.spec.get("overrides") == session.spec.get("overrides"), session.name  # the same model


def test_seeds_come_from_the_job_not_from_the_rubric(tmp_path):
    one, other = _job(tmp_path, seed=1).sessions(), _job(tmp_path, seed=2).sessions()
    assert all(not set(a.seeds) & set(b.seeds) for a, b in zip(one, other))
    assert all(str(seed) not in (KIT / "a1_infra" / "rubric.toml").read_text() for s in one for seed in s.seeds)


def test_sessions_start_the_ranks_of_their_layout_and_copy_only_what_they_read(tmp_path):
    job = _job(tmp_path)
    worlds = {s.name: (s.world, s.reads) for s in job.sessions()}
    assert worlds == {"moe": (1, ("moe.pt",)), "reference": (1, ("model.pt",)), "ep": (2, ("model.pt",)),
                      "pp": (2, ("model-pp.pt",))}


# -- one process tree per session --------------------------------------------------------------
# A harness of the runner's protocol that answers each seed with what it finds left
# behind (a file in its folder, in /tmp, a module-level note), and leaves some of each.
ECHO_HARNESS = textwrap.dedent("""
    import json, os, sys
    setup = json.loads(sys.stdin.readline())
    left = []
    for line in sys.stdin:
        msg = json.loads(line)
        if "session" in msg:
            reply = {"ready": {"world": setup["world"]}}
        else:
            found = [p for p in ("here.txt", "/tmp/there.txt") if os.path.exists(p)]
            for p in ("here.txt", "/tmp/there.txt"):
                open(p, "w").write("left by an earlier session")
            reply = {"digest": {"found": found, "remembered": list(left),
                                "cpus": sorted(os.sched_getaffinity(0))}}
            left.append(msg["seed"])
        print(json.dumps(reply), flush=True)
""")


def _echo(tmp_path) -> Harness:
    script = tmp_path / "echo_harness.py"
    script.write_text(ECHO_HARNESS)
    return Harness(script)


def _tree(tmp_path) -> Path:
    (tmp_path / "tree" / "starter_code").mkdir(parents=True)
    return tmp_path / "tree"


@SANDBOXED
def test_no_session_sees_what_another_left(tmp_path):
    profile = load_rubric().profile("cpu-tiny")
    sessions = [Session(name, {}, [1, 2]) for name in ("first", "second")]
    runs = run_sessions(_echo(tmp_path), _tree(tmp_path), profile, sessions, tmp_path / "logs")
    assert all(run.ok for run in runs.values()), runs
    first, second = (runs[name].digests for name in ("first", "second"))
    assert first[1]["found"] and first[1]["remembered"] == [1]  # within a session, state persists...
    assert second[0]["found"] == [] and second[0]["remembered"] == []  # ...never into the next
    kept = json.loads((tmp_path / "logs" / runner.EVIDENCE).read_text())  # the logs keep what came back
    assert set(kept) == {"first", "second"} and kept["first"]["digests"] == first and kept["second"]["error"] is None


@SANDBOXED
def test_a_child_runs_on_its_cpus_alone(tmp_path):
    profile = load_rubric().profile("cpu-tiny")  # one thread per rank
    runs = run_sessions(_echo(tmp_path), _tree(tmp_path), profile, [Session("one", {}, [1], world=1)], tmp_path / "l")
    assert runs["one"].digests[0]["cpus"] == list(runner.child_cpus(profile, 1))
    assert len(runner.child_cpus(profile, 1)) == 1


def test_child_cpus_are_threads_per_rank_of_the_graders_own():
    profile = load_rubric().profile("h200x1")  # 8 threads
    mine = sorted(os.sched_getaffinity(0))
    assert runner.child_cpus(profile, 1) == tuple(mine[:min(8, len(mine))])
    assert set(runner.child_cpus(profile, 64)) == set(mine)


@SANDBOXED
def test_the_sandbox_pins_from_outside(tmp_path):
    """Read by the grader from /proc, not from what the child says."""
    from grader.sandbox import Limits, make_scratch, spawn_sandboxed

    cpu = min(os.sched_getaffinity(0))
    scratch = make_scratch()
    with spawn_sandboxed([sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=scratch,
                         limits=Limits(cpus=(cpu,), memory_mb=None)) as proc:
        allowed = {pid: Path(f"/proc/{pid}/status").read_text() for pid in proc.pids()}
        proc.stdin.close()
        proc.wait(timeout=30)
    assert allowed and all(f"Cpus_allowed_list:\t{cpu}\n" in status for status in allowed.values()), allowed


def test_cpus_the_grader_cannot_use_are_refused():
    from grader.sandbox import Limits

    with pytest.raises(ValueError, match="give CPUs the grader itself may run on"):
        Limits(cpus=(max(os.sched_getaffinity(0)) + 1,))


# -- on a GPU the starter is timed after the submission's child has ended -------------------------
class FakeChild:
    def __init__(self, name: str, events: list, profile):
        self.name, self.events, self.profile = name, events, profile

    def run(self, session, baseline=None):
        self.events.append(("run", self.name, baseline is not None))
        return SessionResult(seconds=[1.0]), (SessionResult(seconds=[2.0]) if baseline else None)

    def close(self, logs):
        self.events.append(("closed", self.name))
        return "", ""


class FakeBaseline:
    def __init__(self, events, profile):
        self.events, self.session, self.profile = events, Session("moe", {}, [1]), profile

    def next_child(self):
        return FakeChild("starter", self.events, self.profile)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_on_a_gpu_the_submission_has_ended_before_the_starter_is_timed(tmp_path, device):
    import dataclasses

    profile = dataclasses.replace(load_rubric().profile("h200x1"), device=device)
    events: list = []
    result, starter = runner.run_beside(FakeChild("submission", events, profile), Session("moe", {}, [1]),
                                        FakeBaseline(events, profile), tmp_path)
    assert result.ok and starter.ok
    if device == "cuda":
        assert events == [("run", "submission", False), ("closed", "submission"), ("run", "starter", False)]
    else:  # on CPU the two take turns, the idle one frozen (SIGSTOP stops all of its work)
        assert events == [("run", "submission", True)]


# -- expert gradients from the parameters ----------------------------------------------------------
def _harness():
    sys.path.insert(0, str(KIT / "a1_infra" / "tests"))
    try:
        sys.path.insert(0, str(KIT / "grader" / "a1"))
        import harness
    finally:
        sys.path[:2] = []
    return harness


def _starter_state(experts: int = 4, hidden: int = 6, inter: int = 5) -> dict:
    gen = torch.Generator().manual_seed(0)
    state = {}
    for j in range(experts):
        state[f"m.experts.{j}.up_proj.weight"] = torch.randn(inter, hidden, generator=gen)
        state[f"m.experts.{j}.down_proj.weight"] = torch.randn(hidden, inter, generator=gen)
    return state


class Stacked(nn.Module):
    def __init__(self, state, transposed=False, experts=range(4)):
        super().__init__()
        up = torch.stack([state[f"m.experts.{j}.up_proj.weight"] for j in experts])
        down = torch.stack([state[f"m.experts.{j}.down_proj.weight"] for j in experts])
        self.up = nn.Parameter(up.transpose(1, 2).contiguous() if transposed else up.clone())
        self.down = nn.Parameter(down.clone())


def test_expert_gradients_are_read_from_the_parameters_holding_each_expert():
    harness, state = _harness(), _starter_state()
    for layer in (Stacked(state), Stacked(state, transposed=True)):
        slots = harness.ExpertSlots(layer, state, "m.", 4)
        layer.up.grad = torch.arange(layer.up.numel(), dtype=torch.float32).view_as(layer.up)
        layer.down.grad = -torch.ones_like(layer.down)
        up, down = slots.grads()
        expected = layer.up.grad.transpose(1, 2) if layer.up.shape[1] == 6 else layer.up.grad
        assert torch.equal(up, expected) and torch.equal(down, layer.down.grad)


def test_a_gradient_in_another_experts_row_reads_as_that_row():
    """What the optimizer applies is what is read: rows swapped in the parameter stay swapped."""
    harness, state = _harness(), _starter_state()
    layer = Stacked(state)
    slots = harness.ExpertSlots(layer, state, "m.", 4)
    layer.up.grad, layer.down.grad = torch.randn_like(layer.up), None
    up, down = slots.grads()
    assert torch.equal(up, layer.up.grad) and torch.equal(down, torch.zeros_like(layer.down))


def test_experts_not_held_as_loaded_are_refused_in_one_line():
    harness, state = _harness(), _starter_state()
    layer = Stacked(state)
    with torch.no_grad():
        layer.down.mul_(2)
    with pytest.raises(RuntimeError, match=r"expert 0's down_proj was not found among the MoE layer's parameters"):
        harness.ExpertSlots(layer, state, "m.", 4)


def test_the_ranks_moments_merge_into_one_reading_and_a_lost_expert_fails(monkeypatch):
    """Over several ranks each holds some experts (expert parallelism) or some parameters (a
    pipeline stage): merged, they read as one rank would; an expert no rank holds fails."""
    harness = _harness()
    layer = Stacked(_starter_state())
    # [squared norm, projection], held whole / a shard's part
    whole, part = (lambda v, p=0.5: [[v, p], False]), (lambda v, p=0.5: [[v, p], True])
    first = {"params": {"b": whole(2.0), "c": part(0.5, -0.25)},
             "experts": {"m.": [[whole(1.0), part(1.5)], [None, None]]}}
    second = {"params": {"a": whole(1.0), "b": whole(2.0), "c": part(0.25, 1.0)},
              "experts": {"m.": [[None, part(0.5)], [whole(3.0), whole(4.0)]]}}
    moments = harness.OptimizerMoments(layer, {}, type("Config", (), {"n_routed_experts": 2})(), world=2)
    monkeypatch.setattr(harness, "gathered", lambda reading: [first, second])
    assert moments._merged(first) == {"params": {"a": [1.0, 0.5], "b": [2.0, 0.5], "c": [0.75, 0.75]},
                                      "experts": {"m.": [[[1.0, 0.5], [2.0, 1.0]], [[3.0, 0.5], [4.0, 0.5]]]}}
    second["params"]["b"] = whole(2.0, -0.5)  # a replica another rank trained otherwise
    assert all(math.isnan(v) for v in moments._merged(first)["params"]["b"])
    second["experts"]["m."][1][1] = None
    with pytest.raises(RuntimeError, match=r"m\.: expert 1's down_proj was not found .* on some rank"):
        moments._merged(first)


# -- the optimizer's moments: how far and which way ------------------------------------------------
class TwoWeights(nn.Module):
    """Two parameters of one size (the swap's pair) and a bias."""

    def __init__(self, shape=(5, 3)):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.first = nn.Parameter(torch.randn(shape, generator=gen))
        self.second = nn.Parameter(torch.randn(shape, generator=gen))
        self.bias = nn.Parameter(torch.randn(3, generator=gen))


def _stepped(model: nn.Module, grads: dict) -> torch.optim.Optimizer:
    """One AdamW step of `model` on the gradients `grads` (by name)."""
    for name, param in model.named_parameters():
        param.grad = grads[name].reshape(param.shape).clone()
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    return optimizer


def _moments_reading(model, grads, seed, state=None):
    harness = _harness()
    moments = harness.OptimizerMoments(model, state or {}, type("Config", (), {"n_routed_experts": 0})())
    return moments.digest(_stepped(model, grads), seed)


def _grads():
    gen = torch.Generator().manual_seed(2)
    first = torch.randn(5, 3, generator=gen)
    return {"first": first, "second": first.flip(0), "bias": torch.randn(3, generator=gen)}  # one norm, two ways


def test_a_negated_or_swapped_gradient_keeps_every_norm_and_turns_the_projections():
    from grader.a1.compare import moments_direction_problem

    honest = _moments_reading(TwoWeights(), _grads(), seed=11)
    negated = _moments_reading(TwoWeights(), {**_grads(), "bias": -_grads()["bias"]}, seed=11)
    swapped = _moments_reading(TwoWeights(), {**_grads(), "first": _grads()["second"], "second": _grads()["first"]},
                               seed=11)
    for name, (squared, projection) in honest["params"].items():
        assert squared > 0 and abs(projection) > 1e-3 * math.sqrt(squared), name
        assert negated["params"][name][0] == pytest.approx(squared, rel=1e-6)
        assert swapped["params"][name][0] == pytest.approx(squared, rel=1e-6)
    assert negated["params"]["bias"][1] == pytest.approx(-honest["params"]["bias"][1], rel=1e-6)
    assert negated["params"]["first"] == honest["params"]["first"]
    steps = [{"moments": honest}]
    assert moments_direction_problem(steps, [{"moments": negated}], 1e-3).startswith("bias: its gradient points")
    assert moments_direction_problem(steps, [{"moments": swapped}], 1e-3).startswith("first, second: their gradients")


def test_directions_come_from_the_seed_and_the_starters_layout():
    """The same seed reads the same projections in every child, another seed others; a parameter
    kept in another shape than the starter's is read in the starter's; one of another size is
    refused in one line."""
    harness = _harness()
    same, again = _moments_reading(TwoWeights(), _grads(), 11), _moments_reading(TwoWeights(), _grads(), 11)
    assert same == again
    other = _moments_reading(TwoWeights(), _grads(), 12)
    assert all(other["params"][n][1] != same["params"][n][1] for n in same["params"])
    state = {name: p.detach().clone() for name, p in TwoWeights().named_parameters()}
    flat = _moments_reading(TwoWeights((15,)), _grads(), 11, state)  # the starter's [5, 3], kept flat
    assert flat["params"] == {name: pytest.approx(value, rel=1e-6) for name, value in same["params"].items()}
    with pytest.raises(RuntimeError, match=r"a parameter of shape \(4, 3\) is kept under the name of the starter's "
                                           r"of shape \(5, 3\): keep the starter's parameters"):
        _moments_reading(TwoWeights((4, 3)), {**_grads(), "first": torch.ones(12), "second": torch.ones(12)}, 11,
                         state)
    assert len({harness._generator(11, name, "cpu").initial_seed() for name in ("first", "second")}) == 2


class Experts(nn.Module):
    """A MoE layer of 4 experts as `backbone.layers.0.mixer`, its experts per expert (the
    starter's), stacked or stacked transposed, with the starter's values."""

    def __init__(self, state, layout):
        super().__init__()
        mixer = nn.Module()
        if layout == "loop":
            mixer.experts = nn.ModuleList()
            for j in range(4):
                expert = nn.Module()
                for name in ("up_proj", "down_proj"):
                    setattr(expert, name, nn.Module())
                    getattr(expert, name).weight = nn.Parameter(state[f"m.experts.{j}.{name}.weight"].clone())
                mixer.experts.append(expert)
        else:
            stacked = Stacked(state, transposed=layout == "transposed")
            mixer.up, mixer.down = stacked.up, stacked.down
            if layout in ("first-half", "second-half"):  # expert parallelism: a rank's experts
                half = slice(0, 2) if layout == "first-half" else slice(2, 4)
                mixer.up = nn.Parameter(stacked.up[half].detach())
                mixer.down = nn.Parameter(stacked.down[half].detach())
        mixer.gate = nn.Parameter(torch.ones(4, 6))
        self.backbone = nn.Module()
        self.backbone.layers = nn.ModuleList([nn.Module()])
        self.backbone.layers[0].mixer = mixer


def test_each_expert_reads_alike_whatever_the_layout_holds_it():
    """Per expert, stacked, stacked transposed: the same moments read the same, expert by expert;
    two experts' gradients of one norm swapped in a stacked parameter read otherwise."""
    harness, starter = _harness(), _starter_state()
    state = {k.replace("m.", "backbone.layers.0.mixer."): v for k, v in starter.items()}
    state["backbone.layers.0.mixer.gate"] = torch.ones(4, 6)
    gen = torch.Generator().manual_seed(3)
    up, down = torch.randn(4, 5, 6, generator=gen), torch.randn(4, 6, 5, generator=gen)
    up[1], up[2] = up[0].flip(0), 0  # expert 1: expert 0's norm; expert 2: no token chose it

    def read(layout, up=up, world=1):
        model = Experts(starter, layout)
        grads = {"backbone.layers.0.mixer.gate": torch.ones(4, 6)}
        half = {"first-half": slice(0, 2), "second-half": slice(2, 4)}.get(layout, slice(0, 4))
        for name, _ in model.named_parameters():
            if name.endswith("up"):
                grads[name] = up.transpose(1, 2) if layout == "transposed" else up[half]
            elif name.endswith("down"):
                grads[name] = down[half]
            elif ".experts." in name:
                j, projection = int(name.split(".")[5]), name.split(".")[6]
                grads[name] = (up if projection == "up_proj" else down)[j]
        moments = harness.OptimizerMoments(model, state, type("Config", (), {"n_routed_experts": 4})(), world)
        return moments.digest(_stepped(model, grads), seed=5)

    loop = read("loop")
    assert loop["experts"]["backbone.layers.0.mixer."][2][0] == [0.0, 0.0]
    for layout in ("stacked", "transposed"):
        reading = read(layout)
        assert set(reading["params"]) == set(loop["params"]) == {"backbone.layers.0.mixer.gate"}
        for ours, theirs in zip(loop["experts"]["backbone.layers.0.mixer."],
                                reading["experts"]["backbone.layers.0.mixer."]):
            assert theirs == [pytest.approx(pair, rel=1e-5, abs=1e-9) for pair in ours], layout
    # expert parallelism: each rank reads the experts it holds, merged they read as one rank's
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness.OptimizerMoments, "_merged", lambda self, reading: reading)
        ranks = [read(layout, world=2) for layout in ("first-half", "second-half")]
    assert [[up is None for up, _ in rank["experts"]["backbone.layers.0.mixer."]] for rank in ranks] == \
        [[False, False, True, True], [True, True, False, False]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "gathered", lambda reading: ranks)
        merged = harness.OptimizerMoments._merged(None, ranks[0])
    for ours, theirs in zip(loop["experts"]["backbone.layers.0.mixer."], merged["experts"]["backbone.layers.0.mixer."]):
        assert theirs == [pytest.approx(pair, rel=1e-5, abs=1e-9) for pair in ours]
    swapped = read("stacked", up=up[[1, 0, 2, 3]])
    from grader.a1.compare import moments_direction_problem
    assert moments_direction_problem([{"moments": loop}], [{"moments": swapped}], 1e-3).startswith(
        "backbone.layers.0.mixer.experts.0.up_proj, backbone.layers.0.mixer.experts.1.up_proj: their gradients")


def _weights(shapes: list[tuple]) -> tuple[nn.Module, dict]:
    """A model of one parameter per shape, and a gradient for each (the same on every rank)."""
    gen = torch.Generator().manual_seed(4)
    model = nn.Module()
    model.layers = nn.ModuleList()
    for shape in shapes:
        layer = nn.Module()
        layer.weight = nn.Parameter(torch.randn(shape, generator=gen))
        model.layers.append(layer)
    return model, {f"layers.{i}.weight": torch.randn(shape, generator=gen) for i, shape in enumerate(shapes)}


def sharded_moments(shapes: list[tuple]) -> list[dict]:
    """On each rank, for FSDP2 over all ranks and over a (replicate, shard) mesh of (2, 1): the
    parameters of `shapes` sharded, one AdamW step on the same gradients, and the harness's merged
    reading of the moments."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    harness = _harness()
    readings = []
    for mesh in (init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))):
        model, grads = _weights(shapes)
        fully_shard(model, mesh=mesh)
        for name, param in model.named_parameters():
            param.grad = distribute_tensor(grads[name], param.device_mesh, param.placements)
        optimizer = torch.optim.AdamW(model.parameters())
        optimizer.step()
        moments = harness.OptimizerMoments(model, {}, type("Config", (), {"n_routed_experts": 0})(), world=2)
        readings.append(moments.digest(optimizer, seed=9))
    return readings


def test_a_sharded_moment_reads_as_one_rank_would():
    """Each rank projects its shard on its slice of the direction: the parts add up to the whole's
    projection (uneven shards and a shard of nothing included), replicas count once."""
    from dist_utils import run_distributed

    shapes = [(5, 3), (1, 4), (3,), (2, 1, 4)]
    ranks = run_distributed(sharded_moments, world_size=2, args=(shapes,))
    assert ranks[0] == ranks[1]
    one_rank = _moments_reading(*_weights(shapes), seed=9)
    for layout, reading in zip(("sharded", "replicated"), ranks[0]):
        assert reading["params"] == {name: pytest.approx(value, rel=1e-5)
                                     for name, value in one_rank["params"].items()}, layout
def test_a_rank_reports_the_experts_it_holds_with_their_gradients_and_optimizer_state():
    """Part 2's evidence that a rank holds its experts only: counted in the parameters found
    holding the loaded experts (not in another parameter of the layer), after an AdamW step."""
    harness, state = _harness(), _starter_state()
    whole = 4 * 2 * 5 * 6  # experts x projections x their [5, 6] weights
    for layer, held in ((Stacked(state), whole), (Stacked(state, experts=(2, 3)), whole // 2)):
        layer.other = nn.Parameter(torch.randn(5, 6))
        session = object.__new__(harness.TrainSession)
        session.moments = SimpleNamespace(experts={"m.": harness.ExpertSlots(layer, state, "m.", 4, whole=False)})
        session.optimizer = torch.optim.AdamW(layer.parameters())
        sum(p.sum() for p in layer.parameters()).backward()
        session.optimizer.step()
        assert session.experts_held() == [held, held, 2 * held]


class Router(nn.Module):
    """A router that chooses `choice` ([tokens, k] expert ids) whatever it is given."""

    def __init__(self, choice):
        super().__init__()
        self.choice = torch.tensor(choice)

    def forward(self, x):
        return self.choice, torch.ones(self.choice.shape)


def test_the_starters_routers_count_each_token_once_per_other_rank_holding_one_of_its_experts():
    """ep = 2 over 4 experts: rank 0 of the group holds experts 0 and 1. Tokens 1 and 2 need rank 1
    (token 2 twice over: still once); the forward recomputed for backward does not count again."""
    harness = _harness()
    gate = Router([[0, 1], [0, 2], [3, 2], [1, 0]])
    session = object.__new__(harness.TrainSession)
    session.spec, session.rank, session.device = {"layout": {"ep": 2}}, 2, torch.device("cpu")  # world 4: ep rank 0
    session.config = SimpleNamespace(n_routed_experts=4)
    session.model = nn.ModuleDict({"backbone": nn.ModuleDict({"layers": nn.ModuleList(
        [nn.ModuleDict({"mixer": nn.ModuleDict({"gate": gate})})])})})
    session.moments, session.optimizer = SimpleNamespace(experts={}), SimpleNamespace(state={})
    session.count_routes()
    for _ in range(2):
        gate(torch.zeros(4, 6))
        gate(torch.zeros(4, 6))  # the recomputation
        assert session.take_routes() == 2  # each step's, then reset


def test_the_harness_never_reads_the_submissions_adapter():
    assert "onenode.adapters" not in (KIT / "grader" / "a1" / "harness.py").read_text()



def test_a_session_whose_input_was_never_written_fails_in_one_line(tmp_path):
    """On GPU profiles the starter's moe-exact session loads the weights its moe session saves: if
    that one failed, the next says so (no child is started for it) instead of a KeyError."""
    profile = load_rubric().profile("cpu-tiny")
    runs = run_sessions(_echo(tmp_path), _tree(tmp_path), profile, [Session("moe-exact", {}, [1], reads=("moe.pt",))],
                        tmp_path / "logs")
    assert not runs["moe-exact"].ok and "no moe.pt to load" in runs["moe-exact"].error


def test_a_failed_starter_fails_every_submission_with_its_error_and_runs_once(tmp_path, monkeypatch):
    job = _job(tmp_path, "h200x1")
    calls = []

    def failing():
        calls.append(1)
        raise GraderError("the unpatched starter's moe session failed (sandbox: no bwrap)")

    monkeypatch.setattr(job, "_run_reference", failing)
    for _ in range(3):
        with pytest.raises(GraderError, match="moe session failed"):
            _ = job.reference
    assert calls == [1]


# -- the ranks of a child share nothing but the counted network ----------------------------------
# A submission whose ranks try every shared place of their sandbox: rank 1 leaves something in
# each (a file in /tmp, /dev/shm, the scratch folder and its own folder; a System V segment, a
# POSIX queue, a kernel key, an abstract socket), then rank 0, told rank 1's pid and folder through
# a counted collective, looks for each, writes to its netlink socket, reads rank 1's memory and tries to leave its own
# namespaces. Rank 0 answers what it found.
RANKS_PROBE = textwrap.dedent("""
    import ctypes, json, os, socket, subprocess, time
    import torch.distributed as dist

    libc = ctypes.CDLL(None, use_errno=True)
    KEY, NAME = 0x4F4E, b"/onenode-rank-1"
    def places(folder):
        return {"tmp": "/tmp/left", "shm": "/dev/shm/left", "scratch": os.path.join(os.getcwd(), "left"),
                "own": os.path.join(folder, "left")}
    rank = dist.get_rank()
    if rank == 1:
        made = {}
        for name, path in places(os.environ["TMPDIR"]).items():
            try:
                open(path, "w").write("rank 1 was here")
                made[name] = True
            except OSError:
                made[name] = False
        made["sysv"] = libc.shmget(KEY, 4096, 0o1666) >= 0
        made["mqueue"] = libc.mq_open(NAME, os.O_CREAT | os.O_RDWR, 0o666, None) >= 0
        made["key"] = libc.syscall(248 if os.uname().machine == "x86_64" else 217, b"user", b"onenode", b"x",
                                   ctypes.c_size_t(1), ctypes.c_int(-4)) >= 0
        listener = socket.socket(socket.AF_UNIX)
        listener.bind("\\0onenode-rank-1")
        listener.listen()
        try:
            netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2)  # NETLINK_USERSOCK
            netlink.bind((0, 0))
            made["netlink"] = netlink.getsockname()[0]
        except OSError:
            made["netlink"] = None
    else:
        made = None
    told = [None, None]
    dist.all_gather_object(told, (os.getpid(), os.environ["TMPDIR"], made))
    if rank == 1:
        time.sleep(5)  # rank 0's answer comes first
        raise RuntimeError("rank 1 done")
    pid, folder, made = told[1]
    seen = {name: os.path.exists(path) for name, path in places(folder).items()}
    seen["sysv"] = libc.shmget(KEY, 0, 0) >= 0
    seen["mqueue"] = libc.mq_open(NAME, os.O_RDONLY, 0, None) >= 0
    seen["key"] = libc.syscall(250 if os.uname().machine == "x86_64" else 219, 0, ctypes.c_int(-4), 0, 0) > 0
    try:
        socket.socket(socket.AF_UNIX).connect("\\0onenode-rank-1")
        seen["socket"] = True
    except OSError:
        seen["socket"] = False
    try:
        sender = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2)
        sender.sendto(b"\\x15\\0\\0\\0\\x10\\0\\0\\0" + bytes(13), (made["netlink"] or 1, 0))
        seen["netlink"] = True
    except OSError:
        seen["netlink"] = False
    try:
        with open(f"/proc/{pid}/mem", "rb") as mem:
            seen["mem"] = True
    except OSError:
        seen["mem"] = False
    # nor can it undo its confinement: no namespace of its own (to remount), no user namespace
    seen["unshare"] = subprocess.run(["unshare", "--user", "--map-root-user", "true"]).returncode == 0
    raise RuntimeError("PROBE " + json.dumps({"made": made, "seen": seen}))
""")


# where the machine lacks a part of the ranks' isolation (grader.sandbox.rank_isolation), what of
# the probe's channels that part alone closes
CLOSED_BY = {"landlock": {"mem", "socket"}, "namespaces": {"tmp", "shm", "scratch", "own"}}
FULLY_ISOLATED = pytest.mark.skipif(
    not all(sandbox.rank_isolation().values()) and os.environ.get("ONENODE_REQUIRE_SANDBOX") != "1",
    reason=f"this machine cannot isolate the ranks of a child: {sandbox.rank_isolation()}")


def _probe_ranks(tmp_path) -> dict:
    """RANKS_PROBE as the submission of a two-rank child of the real harness: what it found."""
    from grader.a1.job import COLLECTIVES, CONFINE, HARNESS

    tree = _tree(tmp_path)
    (tree / "starter_code" / "onenode").mkdir()
    (tree / "starter_code" / "onenode" / "__init__.py").write_text(RANKS_PROBE)
    profile = load_rubric().profile("cpu-tiny")
    session = Session("probe", {"kind": "train", "layout": {"world": 2}}, [1], world=2)
    run = run_sessions(Harness(HARNESS, (COLLECTIVES, CONFINE)), tree, profile, [session], tmp_path / "logs")["probe"]
    assert run.error and "PROBE " in run.error, (run.error, run.log_tail)
    return json.loads(run.error.split("PROBE ", 1)[1])


@SANDBOXED
@FULLY_ISOLATED
def test_ranks_of_a_child_reach_nothing_of_each_other_but_the_counted_network(tmp_path):
    found = _probe_ranks(tmp_path)
    assert found["made"]["own"], found  # rank 1 did leave something in its own folder...
    assert not any(found["seen"].values()), found  # ...and rank 0 reached none of it


def _lacking(monkeypatch, missing: str) -> None:
    """Pretend this machine lacks `missing` of the ranks' isolation (and warn of gaps afresh). The
    grader reads ONENODE_REQUIRE_SANDBOX in its own process as it starts a child (the child's
    environment never holds it): unset here, as on a TA's machine, so the child runs with the gap
    recorded and warned of; CI sets it, and a test that wants the refusal sets it back."""
    monkeypatch.delenv(sandbox.REQUIRE_ENV, raising=False)
    if missing == "landlock":
        monkeypatch.setattr(sandbox, "landlock_abi", lambda: 5)  # Linux 6.7 to 6.11
    else:
        monkeypatch.setattr(sandbox, "_user_namespaces_openable", lambda: False)
    monkeypatch.setattr(sandbox, "_warn_about_gaps", functools.cache(sandbox._warn_about_gaps.__wrapped__))


@SANDBOXED
@FULLY_ISOLATED
@pytest.mark.parametrize("missing, warned", [("landlock", "Landlock ABI 5, not 6"),
                                             ("namespaces", "cannot open a user namespace")])
def test_ranks_lacking_part_of_their_isolation_run_with_the_rest_and_the_gap_is_recorded(tmp_path, monkeypatch,
                                                                                        missing, warned):
    """A kernel without Landlock's scopes (before 6.12), or a sandbox whose children may open no
    user namespace: a child of two ranks still runs, each rank closing what the other parts close;
    the job's env.json names the part missing, and the grader warns of it."""
    _lacking(monkeypatch, missing)
    with pytest.warns(RuntimeWarning, match=warned):
        found = _probe_ranks(tmp_path)
    reached = {channel for channel, seen in found["seen"].items() if seen}
    assert reached and reached <= CLOSED_BY[missing], found  # that part is off, and only that part
    recorded = environment(load_rubric().profile("cpu-tiny"), 1)["sandbox"]["rank_isolation"]
    assert recorded == {"namespaces": missing != "namespaces", "landlock": missing != "landlock"}, recorded


@SANDBOXED
@pytest.mark.parametrize("missing", ["landlock", "namespaces"])
def test_with_the_sandbox_required_a_child_of_ranks_lacking_isolation_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                                             missing):
    """ONENODE_REQUIRE_SANDBOX=1 (CI): a child of several ranks the machine cannot fully isolate is
    refused, saying what the machine needs; a single rank has no other to be isolated from."""
    _lacking(monkeypatch, missing)
    monkeypatch.setenv("ONENODE_REQUIRE_SANDBOX", "1")
    sessions = [Session("one", {}, [1], world=1), Session("two", {}, [1], world=2)]
    runs = run_sessions(_echo(tmp_path), _tree(tmp_path), load_rubric().profile("cpu-tiny"), sessions, tmp_path / "l")
    assert runs["one"].ok, runs["one"].error
    error = runs["two"].error
    assert error and "\n" not in error and "ONENODE_REQUIRE_SANDBOX=1" in error, error
    assert ("Linux 6.12" if missing == "landlock" else "allow unprivileged user namespaces") in error, error


# A harness of the runner's protocol whose ready answer says whether it may open a user namespace.
USERNS_HARNESS = textwrap.dedent("""
    import json, subprocess, sys
    sys.stdin.readline()
    for line in sys.stdin:
        opened = subprocess.run(["unshare", "--user", "--map-root-user", "true"]).returncode == 0
        print(json.dumps({"ready": {"opened": opened}}), flush=True)
""")


@SANDBOXED
@pytest.mark.parametrize("world", [1, 2])
def test_a_child_opens_user_namespaces_only_for_ranks_that_close_their_own(tmp_path, world):
    """`Limits.user_namespaces` only for a child of several ranks that each close their own
    (grader/a1/confine.py): a single rank confines nothing, so its child may open none."""
    script = tmp_path / "userns_harness.py"
    script.write_text(USERNS_HARNESS)
    runs = run_sessions(Harness(script), _tree(tmp_path), load_rubric().profile("cpu-tiny"),
                        [Session("one", {}, [], world=world)], tmp_path / "logs")
    assert runs["one"].ok, runs["one"].error
    assert runs["one"].info["opened"] == (world > 1 and sandbox.rank_isolation()["namespaces"])


@needs_solutions
@SANDBOXED
@FULLY_ISOLATED
@pytest.mark.slow
def test_part_2_earns_its_points_on_a_kernel_without_landlocks_scopes(tmp_path, monkeypatch):
    """Graded where the kernel lacks Landlock's scopes, the example Part 2 submission earns every
    point cpu-tiny gives Part 2 (its ranks confined by namespaces and seccomp), and its env.json
    says the ranks had no Landlock."""
    from grader.a1 import A1, scoring
    from grader.a1.demo import build_cohort
    from grader.a1.job import new_job
    from grader.cohort import grade_one

    _lacking(monkeypatch, "landlock")
    rubric = load_rubric()
    tiny = rubric.profile("cpu-tiny")
    profile = dataclasses.replace(tiny, layouts={k: tiny.layouts[k] for k in ("reference", "ep")}, warmup=1,
                                  repeats=1, moe=dict(tiny.moe, warmup=1, repeats=1))
    rubric = dataclasses.replace(rubric, profiles={**rubric.profiles, "cpu-tiny": profile})
    monkeypatch.setattr(scoring, "STEPS", [scoring.grade_ep])
    job = new_job(rubric, "cpu-tiny", tmp_path / "work", tmp_path / "starter-logs", seed=62)
    submission = next(f for f in build_cohort(tmp_path / "cohort") if f.name == "part2-ep")
    results = grade_one(A1, submission, job, tmp_path / "out")
    ep = [t for t in results["tests"] if "ep" in t["tags"]]
    part = rubric.parts["ep"]
    assert sum(t["score"] for t in ep) == part.points - (0 if tiny.scores_speed_of("ep") else part.speed), ep
    env = json.loads((tmp_path / "out" / "part2-ep" / "env.json").read_text())
    assert env["sandbox"]["rank_isolation"] == {"namespaces": True, "landlock": False}, env["sandbox"]
