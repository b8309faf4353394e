"""The replay of an A2 run on the grader's side: the checks and the plan are the kit's
(`onenode.verify.replay`, the code `onenode verify` runs too); here the harness runs on the
grader's pristine A2 stack (`job.a2_stack`), in the sandbox, since the checkpoints are untrusted
input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from onenode.verify import replay
from onenode.verify.intake import A2Submission

from ..sandbox import Limits, SandboxError, make_scratch, run_sandboxed
from .rubric import A2Profile


def run_harness(sub: A2Submission, stack: Path, spans: list[tuple[int, int]], profile: A2Profile, logs: Path,
                threads: int | None = None) -> tuple[dict, float]:
    """The harness of the pristine stack (`onenode.verify.replay_harness` of its copy), sandboxed,
    reading the submission's checkpoints and data in place (read-only; they must be readable by
    all) and a copy of final/; (its report, the wall seconds it took)."""
    scratch = make_scratch()
    try:
        shutil.copytree(stack / "starter_code", scratch / "starter_code", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(sub.checkpoint, scratch / "final")  # the export may be private to its owner (0600)
        (scratch / "plan.json").write_text(json.dumps(replay.harness_plan(sub, "final", spans, threads)))
        command, env, threads_used = replay.harness_launch(sub, profile, threads)
        limits = Limits(wall_s=profile.timeout_s, cpu_s=profile.timeout_s * max(1, threads_used),
                        memory_mb=profile.memory_mb or None, nproc=512)
        try:
            result = run_sandboxed(command, cwd=scratch, env=env, limits=limits, readable=[sub.root])
        except SandboxError as e:
            return {"error": f"sandbox: {e}"}, 0.0
        log = (result.stdout + b"\n" + result.stderr).decode("utf-8", errors="replace")
        (logs / "replay.log").write_text(log, encoding="utf-8")
        return replay.harness_report(scratch, log, result.reason), result.wall_s
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

