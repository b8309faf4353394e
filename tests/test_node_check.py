"""`make node-check` (cluster/node_check.py): each item passes, fails with its fix, or is
skipped (on a CPU-only machine, or after an item it needs failed); the profile is the one
cluster/grade_node.sh picks; the real CPU items pass on this machine (slow)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("node_check", ROOT / "cluster" / "node_check.py")
node_check = sys.modules.setdefault("node_check", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(node_check)
Failed, Item, Node = node_check.Failed, node_check.Item, node_check.Node


def _broken(node):
    raise Failed("the widget is broken", "apt-get install widget")


def _crashes(node):
    raise ZeroDivisionError("division by zero")


FAKE_ITEMS = [
    Item("fine", lambda node: "all good"),
    Item("broken", _broken),
    Item("gpu only", lambda node: "ran", gpu_only=True),
    Item("after broken", lambda node: "ran", needs=("broken",)),
    Item("after fine", lambda node: "ran too", needs=("fine",)),
    Item("crashes", _crashes),
]


def test_items_pass_fail_with_their_fix_or_are_skipped(tmp_path):
    lines = []
    outcomes = node_check.run_items(FAKE_ITEMS, Node([], "cpu-tiny", tmp_path), lines.append)
    assert [(o.name, o.status) for o in outcomes] == [
        ("fine", "PASS"), ("broken", "FAIL"), ("gpu only", "SKIP"), ("after broken", "SKIP"),
        ("after fine", "PASS"), ("crashes", "FAIL")]
    text = "\n".join(lines)
    assert "FAIL  broken               the widget is broken\n      fix: apt-get install widget" in text
    assert "SKIP  gpu only             CPU-only machine" in text
    assert "SKIP  after broken         needs broken to pass first" in text
    assert "FAIL  crashes              ZeroDivisionError: division by zero" in text
    assert "ZeroDivisionError" in (tmp_path / "crashes.error.txt").read_text()  # the traceback, for the kit's bug
    assert lines[-1].startswith("node check: 2 passed, 2 failed, 2 skipped on profile cpu-tiny")
    assert lines[-1].endswith("fix the failures above, then run it again")
    on_gpus = node_check.run_items(FAKE_ITEMS[2:3], Node(["NVIDIA H200"], "h200x1", tmp_path), lines.append)
    assert on_gpus[0].status == "PASS" and lines[-1].endswith("the node is ready to grade on")


def test_main_says_cpu_only_and_exits_by_the_outcomes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(node_check, "gpu_names", lambda: ([], None))
    monkeypatch.setattr(node_check, "ITEMS", FAKE_ITEMS[:1] + FAKE_ITEMS[2:3])
    assert node_check.main(["--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "CPU-only machine (no NVIDIA GPU found)" in out and "profile cpu-tiny" in out
    monkeypatch.setattr(node_check, "ITEMS", FAKE_ITEMS[:2])
    assert node_check.main(["--out", str(tmp_path / "out")]) == 1
    monkeypatch.setattr(node_check, "gpu_names", lambda: ([], "nvidia-smi cannot talk to the driver (x)"))
    assert node_check.main(["--out", str(tmp_path / "out")]) == 1
    assert "fix: check the NVIDIA driver" in capsys.readouterr().out
    kit = sys.modules["onenode"]
    monkeypatch.setitem(sys.modules, "onenode", None)  # a Python without the kit: one line, nothing run
    assert node_check.main(["--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "has no kit installed" in out and "fix: run `make node-check`" in out and "CPU-only" not in out
    monkeypatch.setitem(sys.modules, "onenode", kit)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "cohort.csv").write_text("")
    with pytest.raises(SystemExit):  # a folder of other files is never replaced
        node_check.main(["--out", str(tmp_path / "results")])
    assert "holds files of its own" in capsys.readouterr().err and (tmp_path / "results" / "cohort.csv").is_file()


def _grade_node_pick(tmp_path: Path, names: list[str]) -> str:
    """cluster/grade_node.sh's pick_profile, with an nvidia-smi that lists `names`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo '{n}'\n" for n in names))
    smi.chmod(0o755)
    script = (ROOT / "cluster" / "grade_node.sh").read_text()
    function = script[script.index("pick_profile() {"):script.index("\n}\n", script.index("pick_profile() {")) + 3]
    done = subprocess.run(["bash", "-c", f"{function}\npick_profile"], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    return done.stdout.strip() if done.returncode == 0 else None


@pytest.mark.parametrize("names", [["NVIDIA H200"], ["NVIDIA H200"] * 2, ["NVIDIA H200"] * 8,
                                   ["NVIDIA H100 80GB HBM3"] * 8, ["NVIDIA H100 80GB HBM3"] * 4, ["Tesla T4"]])
def test_the_profile_is_the_one_grade_node_picks(tmp_path, names):
    assert node_check.pick_profile(names) == _grade_node_pick(tmp_path, names)


def test_no_profile_for_the_gpus_fails_with_the_fix(tmp_path):
    with pytest.raises(Failed) as e:
        node_check.check_machine(Node(["Tesla T4"], None, tmp_path))
    assert "no rubric profile for 1 x Tesla T4" in e.value.detail and "set PROFILE to one of" in e.value.fix
    assert node_check.pick_profile([]) == "cpu-tiny"


def test_a2_profile_of_the_node():
    profiles = {name: type("P", (), {"device": device}) for name, device in
                (("cpu-tiny", "cpu"), ("h100x8", "cuda"), ("h200x1", "cuda"))}
    assert [node_check.a2_profile(p, profiles) for p in ("cpu-tiny", "cpu-8proc", "h200x1", "h200x2", "h100x8")] == [
        "cpu-tiny", "cpu-tiny", "h200x1", "h200x1", "h100x8"]


def _results(**scores) -> dict:
    tests = [{"name": f"Part 1: x: {kind}", "score": got, "max_score": most} for kind, (got, most) in scores.items()]
    return {"score": sum(t["score"] for t in tests), "tests": tests, "output": "",
            "extra_data": {"max_score": sum(t["max_score"] for t in tests)}}


def test_a1_verdict_needs_every_correctness_point_not_every_speed_point(tmp_path):
    assert node_check.a1_verdict(_results(correctness=(4, 4), speed=(3, 6)), tmp_path, "cpu-tiny") == (
        f"reference scored 7/10 of the code parts on cpu-tiny (speed 3/6; the notebook is not graded here): "
        f"{tmp_path / 'feedback.md'}")
    with pytest.raises(Failed) as e:
        node_check.a1_verdict(_results(correctness=(0, 4), speed=(6, 6)), tmp_path, "cpu-tiny")
    assert "lost points on Part 1: x: correctness" in e.value.detail and "feedback.md" in e.value.fix


def test_health_check_failure_is_split_into_what_and_fix(tmp_path, monkeypatch):
    """cluster/health_check.sh's FAIL line on a node whose driver is gone (no nvidia-smi on PATH)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    if os.path.exists("/usr/bin/nvidia-smi"):
        pytest.skip("this machine has nvidia-smi in /usr/bin")
    with pytest.raises(Failed) as e:
        node_check.check_gpus_and_nccl(Node(["NVIDIA H200"], "h200x1", tmp_path))
    assert (e.value.detail, e.value.fix) == ("nvidia-smi not found", "no NVIDIA driver on this node")


def test_a_command_that_hangs_fails_with_its_log(tmp_path):
    with pytest.raises(Failed) as e:
        node_check._run(Node([], "cpu-tiny", tmp_path, timeout_s=1), "hang",
                        ["bash", "-c", "echo started; sleep 30"])
    assert e.value.detail == "did not finish in 1 s: -c echo started; sleep 30"
    assert "started" in (tmp_path / "hang.log").read_text() and str(tmp_path / "hang.log") in e.value.fix


def test_the_a2_run_trains_as_every_profiles_replay_needs():
    """The GPU profiles replay only runs trained with `train.deterministic` (`deterministic_runs`):
    on one H200 (2026-12-03) the node check's own run lacked it, and its replay refused it."""
    from grader.a2.rubric import load_rubric
    from onenode.train.recipe import load_recipe

    profiles = load_rubric().profiles.values()
    assert any(profile.deterministic_runs for profile in profiles)
    for device in ("cpu", "cuda"):
        recipe = load_recipe(node_check.A2_RECIPE, {**node_check.A2_RUN, "train.device": device})
        assert recipe.train.deterministic or not any(profile.deterministic_runs for profile in profiles)


@pytest.mark.slow  # the bench of the patched tree and a short A2 run replayed: about a minute on 2 idle cores
def test_the_cpu_items_pass_on_this_machine(tmp_path, monkeypatch):
    """The real items a CPU machine runs, but the A1 grade (the demo and calibration tests grade
    the reference on cpu-tiny) and the starter's bench (the same command on a pristine tree); the
    A2 run replayed as the GPU profiles replay (only a run trained deterministically)."""
    import dataclasses

    import grader.a2.rubric

    kit = grader.a2.rubric.load_rubric()
    gpu_like = {name: dataclasses.replace(profile, deterministic_runs=True) for name, profile in kit.profiles.items()}
    monkeypatch.setattr(grader.a2.rubric, "load_rubric", lambda *a: dataclasses.replace(kit, profiles=gpu_like))
    lines = []
    names = ("machine", "bubblewrap", "solution bench", "a2 train and replay")
    items = [item for item in node_check.ITEMS if item.name in names]
    outcomes = node_check.run_items(items, Node([], "cpu-tiny", tmp_path), lines.append)
    assert [o.status for o in outcomes] == ["PASS"] * 4, "\n".join(lines)
    assert "tokens/s" in outcomes[2].detail and "bit for bit" in outcomes[3].detail


def test_a_gpu_node_without_a_cpu_cgroup_fails_with_the_fix(tmp_path, monkeypatch):
    """A1's timed turns on a GPU node need a CPU cgroup per child (its cap, and its usage while
    frozen): without one delegated the item fails and says how to delegate one; with one it names it."""
    import grader.sandbox

    item = next(item for item in node_check.ITEMS if item.name == "cpu cgroup")
    assert item.gpu_only
    node = Node(["NVIDIA H200"], "h200x1", tmp_path)
    monkeypatch.setattr(grader.sandbox, "cpu_cgroup_parent", lambda: None)
    with pytest.raises(Failed) as failed:
        item.run(node)
    assert "no cgroup v2 with the cpu controller" in failed.value.detail
    assert "Delegate=yes" in failed.value.fix and "ONENODE_CGROUP=" in failed.value.fix
    monkeypatch.setattr(grader.sandbox, "cpu_cgroup_parent", lambda: tmp_path / "grader.slice")
    assert item.run(node) == f"each child gets a CPU cgroup of its own under {tmp_path / 'grader.slice'}"
