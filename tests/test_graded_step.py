"""The step the A1 grader times is the step `onenode bench` measures: the profile's bench command
(`A1Profile.bench_command`) and the grader's harness, driven through its protocol, assemble the
same recipe and give the same losses from the same seeds; and the evidence is read on a clock of
its own, once, after the session's last step, so that every timed step follows another step."""

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grader.a1.rubric import load_rubric
from onenode.cli import build_parser

KIT = Path(__file__).resolve().parents[1]
STEPS = 3
SEED = 11


def bench_record(command: str) -> dict:
    """`onenode bench` run in this process from its command line, its JSON record."""
    from onenode.bench import measure

    argv = shlex.split(command)[1:] + ["--steps", str(STEPS), "--warmup", "0", "--quiet"]
    return measure.run(build_parser("bench").parse_args(argv))


def harness_session(tmp: Path, spec: dict, seeds: list[int]) -> tuple[dict, list[dict]]:
    """The grader's harness in a child process (no sandbox: the kit's own starter), one training
    session on `seeds`, its evidence read after the last: its ready info and, per seed, the timed
    reply (the last merged with the evidence)."""
    for src in (KIT / "grader/a1/harness.py", KIT / "grader/a1/confine.py", KIT / "a1_infra/tests/collectives.py"):
        shutil.copy2(src, tmp / src.name)
    messages = [{"world": 1, "threads": 1, "device": "cpu", "tree": str(KIT / "starter_code"), "confine": None},
                {"session": spec}]
    messages += [{"seed": seed} for seed in seeds] + [{"evidence": True}]
    env = {"PYTHONPATH": str(KIT / "starter_code"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-u", "harness.py"], cwd=tmp, env=env, capture_output=True, text=True,
                         input="".join(json.dumps(m) + "\n" for m in messages), timeout=600)
    replies = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert "ready" in replies[0], f"{replies[:1]}\n{out.stderr[-2000:]}"
    *timed, evidence = replies[1:]
    assert all("digest" in reply for reply in timed) and "evidence" in evidence, (replies, out.stderr[-2000:])
    assert not any("moments" in reply["digest"] for reply in timed)  # not read inside a timed step
    steps = [reply["digest"] for reply in timed]
    steps[-1] = {**steps[-1], **evidence["evidence"]}
    return replies[0]["ready"], steps


@pytest.mark.slow
def test_the_graded_step_is_the_bench_commands_step(tmp_path):
    profile = load_rubric().profiles["cpu-tiny"]
    reference = profile.layouts["reference"]
    recipe = profile.recipe(reference, SEED)
    spec = {"kind": "train", "preset": profile.preset, "overrides": profile.overrides, "device": "cpu",
            "dtype": profile.dtype, "init_seed": SEED, "moe": profile.moe, "batch": profile.batch,
            "seq_len": profile.seq_len, "layout": reference, "recipe": recipe}
    info, steps = harness_session(tmp_path, spec, [SEED + 1 + i for i in range(STEPS)])
    record = bench_record(profile.bench_command(SEED))

    assert [s["loss"] for s in steps] == pytest.approx(record["steps"]["losses"], rel=1e-6)
    assert isinstance(steps[-1]["moments"], dict) and steps[-1]["moments"]["params"]
    same = ("seed", "model", "train", "optimizer", "moe", "parallel")
    # the number of steps; cpu vs auto; the layout spelled out vs derived from one process (0 = batch / dp, -1 = 1)
    ignore = {"token_budget", "device", "micro_batch_size", "dp"}

    def decisive(r: dict) -> dict:
        return {k: ({f: v for f, v in r[k].items() if f not in ignore} if isinstance(r[k], dict) else r[k])
                for k in same}

    assert decisive(info["recipe"]) == decisive(record["recipe"])


def test_bench_command_sets_every_step_field_of_the_profile():
    """Each GPU profile's `step` fields reach its bench command, and the command parses."""
    for profile in load_rubric().profiles.values():
        command = profile.bench_command(3)
        for key, value in profile.step.items():
            assert f"--set {key}={str(value).lower() if isinstance(value, bool) else value}" in command
        words = shlex.split(command)
        argv = words[words.index("bench"):]
        args = build_parser("bench").parse_args(argv)
        assert args.seed == 3 and args.seq_len == profile.seq_len


def test_the_handout_gives_each_profiles_graded_step_command():
    handout = (KIT / "a1_infra/README.md").read_text()
    for name, profile in load_rubric().profiles.items():
        assert f"| `{name}` | `{profile.bench_command(0)}` |" in handout, f"a1_infra/README.md: {name}'s command"


def test_the_evidence_is_read_once_after_the_last_step(monkeypatch):
    """`runner.Child.run`: a training session's evidence is asked for after its last workload only,
    a MoE session's never; with the profiles' warmup of at least one step, every timed step follows
    another, so an update a step leaves for whatever message comes next is timed in the next step."""
    from types import SimpleNamespace

    from grader.runner import Child, Session, SessionResult

    asked = []

    def step(self, result, seed, deadline, evidence=False):
        asked.append((seed, evidence))
        result.digests.append({})

    monkeypatch.setattr(Child, "open", lambda self, session, deadline: SessionResult(info={}))
    monkeypatch.setattr(Child, "step", step)
    monkeypatch.setattr(Child, "gpu_memory", lambda self: None)
    child = Child.__new__(Child)
    child.profile = SimpleNamespace(timeout_s=60)
    child.run(Session("reference", {"kind": "train"}, [5, 6, 7, 8]))
    assert asked == [(5, False), (6, False), (7, False), (8, True)]
    asked.clear()
    child.run(Session("moe", {"kind": "moe"}, [5, 6]))
    assert asked == [(5, False), (6, False)]
    assert min(p.warmup for p in load_rubric().profiles.values()) >= 1
