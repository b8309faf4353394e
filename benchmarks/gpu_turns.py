"""Why a GPU profile times the starter only after the submission's child has ended.

    python3 benchmarks/gpu_turns.py --out turns.json

A child in the grader's own sandbox queues `--queued-s` seconds of bf16 matmuls on the GPU, behind
a short sleep, and says so. The grader's process then times matmuls of its own (standing in for
the starter's timed turn) three ways: alone; with the child frozen (`SandboxedProcess.pause`, how
the CPU profiles take turns: SIGSTOP stops a process, not the kernels it has queued); and after the
child has been ended the way `runner.run_beside` ends it on CUDA (killed, then waited on until
nvidia-smi lists none of its GPU contexts). Frozen, the turn is slowed by about the queued work;
ended, not at all. The red-team case `queues-into-the-starters-turn` (tests/redteam/a1_sessions.py)
is the attack this measures, graded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

KIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT))

from grader.sandbox import Limits, spawn_sandboxed  # noqa: E402
from onenode.train.logging import environment, git_commit  # noqa: E402

SIDE = 8192  # bf16 matmuls of SIDE^3: ~1.1 TFLOP each, a millisecond or two on an H100/H200

QUEUER = """
import sys, torch
a = torch.randn({side}, {side}, device="cuda", dtype=torch.bfloat16)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a @ a
start.record()
for _ in range(10):
    a @ a
end.record()
end.synchronize()
per_matmul_s = start.elapsed_time(end) / 1e4
torch.cuda._sleep(200_000_000)  # about 0.1 s: the grader's turn has begun when the work starts
for _ in range(int({seconds} / per_matmul_s)):
    a @ a
print("queued", flush=True)
sys.stdin.readline()
"""


def timed_turn(a: torch.Tensor, matmuls: int) -> float:
    """Seconds for `matmuls` products of `a`, between two synchronisations (the grader's clock)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(matmuls):
        a @ a
    torch.cuda.synchronize()
    return time.perf_counter() - start


def queueing_child(seconds: float):
    scratch = Path(tempfile.mkdtemp(prefix="onenode-turns-"))
    (scratch / "queuer.py").write_text(QUEUER.format(side=SIDE, seconds=seconds))
    proc = spawn_sandboxed([sys.executable, "-u", "queuer.py"], cwd=scratch,
                           limits=Limits(wall_s=300, cpu_s=None, memory_mb=None))
    line = proc.readline(timeout=120)
    if b"queued" not in line:
        proc.kill("no answer")
        raise SystemExit(f"the queueing child did not start: {proc.wait().stderr.decode()[-1000:]}")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued-s", type=float, default=2.0, help="GPU seconds the child leaves queued")
    parser.add_argument("--turn-matmuls", type=int, default=400, help="matmuls in the grader's timed turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_turns.py measures a GPU: run it on a machine with CUDA")
    a = torch.randn(SIDE, SIDE, device="cuda", dtype=torch.bfloat16)
    timed_turn(a, 20)
    turns: dict[str, list[float]] = {"alone": [], "child frozen": [], "child ended": []}
    for _ in range(args.repeats):
        turns["alone"].append(timed_turn(a, args.turn_matmuls))
        child = queueing_child(args.queued_s)
        child.pause()
        turns["child frozen"].append(timed_turn(a, args.turn_matmuls))
        child.kill("its turn is over")
        child.wait()
        child = queueing_child(args.queued_s)
        child.kill("its turn is over")
        child.wait()  # as the runner's close: the process tree gone, its GPU contexts released
        turns["child ended"].append(timed_turn(a, args.turn_matmuls))
    alone = statistics.median(turns["alone"])
    record = {"what": "a GPU turn timed beside a child that left work queued: alone, child frozen, child ended",
              "command": " ".join(["python3", "benchmarks/gpu_turns.py", *sys.argv[1:]]),
              "commit": os.environ.get("ONENODE_COMMIT") or git_commit() or "unknown", **environment(1),
              "queued_s": args.queued_s, "turn_matmuls": args.turn_matmuls,
              "seconds": turns, "slowdown": {k: statistics.median(v) / alone for k, v in turns.items()}}
    for name, ratio in record["slowdown"].items():
        print(f"{name:>13}: {statistics.median(turns[name]):.3f} s, {ratio:.2f}x the turn alone")
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
