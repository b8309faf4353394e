"""`make node-check`: what a TA runs on a fresh node before grading on it.

    make node-check                                  # or: .venv/bin/python cluster/node_check.py
    PROFILE=h200x1 make node-check                   # force the A1 profile
    .venv/bin/python cluster/node_check.py --out out/node-check --min-free-gb 100

It picks the rubric's profile from the GPUs it finds (as cluster/grade_node.sh does) and checks,
each item in turn, printing PASS, FAIL (with the fix) or SKIP:
- the GPUs and NCCL: cluster/health_check.sh (driver, torch's CUDA, an all-reduce across every
  GPU through cluster/nccl_smoke.py, free disk);
- bubblewrap: the grader's sandbox can be built here (the grader refuses to run submissions
  without it);
- the starter and the reference solution: `onenode bench`, a few steps each, on a copy of
  starter_code and on one with solutions/a1/submission.patch applied, as the grader builds them;
- one A1 grade of the reference solution on the node's profile (`onenode-grade a1`);
- one short A2 training run on the grader's A2 stack, and the grader's replay of its spans.
On a machine without an NVIDIA GPU it says so and runs the CPU items on profile cpu-tiny. Logs
of every item are kept under --out. Exit status 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[1]
if str(KIT_ROOT) not in sys.path:
    sys.path.insert(0, str(KIT_ROOT))

CPU_PROFILE = "cpu-tiny"
MARKER = ".node-check"  # in --out: a folder the check may replace
BENCH_TIMEOUT_S = 600  # a few steps: a bench still running then hangs (as the starter's once did on one H200)
# The bench each tree runs: the handout's one-GPU command (on a GPU), the tiny preset (on a CPU)
BENCH_ARGS = {"cuda": ["--preset", "a1-1gpu", "--seq-len", "4096", "--micro-batch", "1", "--steps", "3",
                       "--warmup", "1"],
              "cpu": ["--preset", "tiny", "--steps", "3", "--warmup", "1"]}
# The A2 run: the tiny recipe, 10 steps of 4 x 32 tokens with a checkpoint after each (the grader
# replays the first and the last span, and random ones within a tenth of the run's steps), trained
# as graded runs are (`train.deterministic`: the GPU profiles replay no other run)
A2_RECIPE = KIT_ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"
A2_STEPS = 10
A2_RUN = {"train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
          "train.token_budget": A2_STEPS * 4 * 32, "checkpoint.every_steps": 1, "checkpoint.keep_last": 0,
          "eval.every_steps": 0, "log.every_steps": 1, "log.tensorboard": False, "log.progress_bar": False,
          "train.deterministic": True}


class Failed(Exception):
    """An item's failure: what was found, and what the TA does about it."""

    def __init__(self, detail: str, fix: str):
        super().__init__(detail)
        self.detail, self.fix = detail, fix


@dataclass
class Node:
    """The machine under check: its GPUs, the profile picked for it, where logs go."""

    gpus: list[str]
    profile: str | None
    out: Path
    min_free_gb: int = 100
    timeout_s: int = 1800  # any other command of an item
    figures: dict = field(default_factory=dict)  # what items measured, for the items after them

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"


@dataclass(frozen=True)
class Item:
    """One check: `run(node)` returns a one-line detail, or raises Failed."""

    name: str
    run: Callable[[Node], str]
    gpu_only: bool = False  # skipped on a machine without GPUs
    needs: tuple[str, ...] = ()  # items that must have passed first


@dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    fix: str = ""
    seconds: float = 0.0


# -- the machine ---------------------------------------------------------------------------------
def kit_not_installed() -> str | None:
    """Why this Python cannot run the items, or None: every item imports the kit (`onenode`) from
    it, which only an install puts there (a bare image's python3 has torch, not the kit)."""
    try:
        import onenode  # noqa: F401
    except ModuleNotFoundError:
        return f"{sys.executable} has no kit installed (import onenode failed)"
    return None


def gpu_names() -> tuple[list[str], str | None]:
    """The GPUs nvidia-smi lists, and why they could not be read (None: read, or no NVIDIA
    driver at all: a CPU-only machine)."""
    if shutil.which("nvidia-smi") is None:
        return [], "nvidia-smi not found" if os.path.exists("/dev/nvidia0") else None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return [], f"nvidia-smi did not answer ({e})"
    if done.returncode != 0:
        return [], f"nvidia-smi cannot talk to the driver ({(done.stderr or done.stdout).strip()[:200]})"
    return [line.strip() for line in done.stdout.splitlines() if line.strip()], None


def pick_profile(names: list[str]) -> str | None:
    """The A1 rubric's profile for these GPUs, as cluster/grade_node.sh picks it (None: none fits)."""
    if not names:
        return CPU_PROFILE
    if any("H100" in n for n in names) and len(names) >= 8:
        return "h100x8"
    if any("H200" in n for n in names):
        return "h200x2" if len(names) >= 2 else "h200x1"
    return None


def check_machine(node: Node) -> str:
    from grader.a1.rubric import load_rubric

    profiles = load_rubric().profiles
    if node.profile not in profiles:
        found = f"{len(node.gpus)} x {node.gpus[0]}" if node.gpus else "no GPU"
        raise Failed(f"no rubric profile for {found}" if node.profile is None else
                     f"PROFILE={node.profile} is not in a1_infra/rubric.toml",
                     f"set PROFILE to one of {', '.join(profiles)}")
    if not node.gpus:
        return f"no NVIDIA GPU: profile {node.profile}"
    return f"{len(node.gpus)} x {node.gpus[0]}: profile {node.profile}"


# -- the items -----------------------------------------------------------------------------------
def _run(node: Node, name: str, argv: list[str], env: dict | None = None,
         timeout_s: int | None = None) -> subprocess.CompletedProcess:
    """A command from the kit root, its output in OUT/<name>.log; a timeout is a failure."""
    log = node.out / f"{name}.log"
    timeout_s = timeout_s or node.timeout_s
    try:
        done = subprocess.run(argv, cwd=KIT_ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        log.write_text(f"$ {' '.join(argv)}\n{_decoded(e.stdout)}{_decoded(e.stderr)}")
        raise Failed(f"did not finish in {timeout_s} s: {' '.join(argv[1:])}",
                     f"run it by hand to see where it stops (its output so far: {log})") from None
    log.write_text(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}")
    return done


def _decoded(output) -> str:
    """What a timed-out command printed (bytes, whatever `text` asked for)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:300]


def check_gpus_and_nccl(node: Node) -> str:
    """cluster/health_check.sh; its FAIL line is "what: what to do"."""
    done = _run(node, "gpus-and-nccl", ["bash", "cluster/health_check.sh", str(len(node.gpus)),
                                        str(node.min_free_gb), str(node.out)], {"PYTHON": sys.executable})
    if done.returncode != 0:
        fail = next((ln.removeprefix("FAIL: ") for ln in done.stderr.splitlines() if ln.startswith("FAIL: ")),
                    _last_line(done.stderr + done.stdout))
        what, _, fix = fail.partition(": ")
        raise Failed(what, fix or f"see {node.out / 'gpus-and-nccl.log'}")
    smoke = next((ln for ln in done.stdout.splitlines() if ln.startswith("nccl_smoke:")), "")
    return f"{smoke.removeprefix('nccl_smoke: ')}; {_last_line(done.stdout)}"


def check_bubblewrap(node: Node) -> str:
    from grader.sandbox import capabilities

    found = capabilities()
    problem = found["sandbox_problem"]
    if problem is None:
        who = "as root, each child under a uid of its own" if found["separate_uid"] else "not as root"
        return f"the grader's sandbox builds here ({who})"
    if "not installed" in problem:
        what, _, fix = problem.partition(": ")
        raise Failed(what, f"{fix} (or `make bubblewrap`, as root)")
    raise Failed(problem, "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on "
                          "Ubuntu 24.04 kernel.apparmor_restrict_unprivileged_userns=0) or run the grader as root; "
                          "see docs/SECURITY.md")


def check_cpu_cgroup(node: Node) -> str:
    """A GPU node grades A1's timed turns: each child needs a cgroup of its own, which caps its CPU
    time and whose usage shows CPU spent while the child was frozen for the other's turn by any of
    its processes, ended or forked since (`SandboxedProcess.resume`); without it only the
    per-process counters do, which a process forked and stopped again can slip past."""
    from grader.sandbox import CGROUP_ENV, cpu_cgroup_parent

    parent = cpu_cgroup_parent()
    if parent is None:
        raise Failed("no cgroup v2 with the cpu controller delegated to the grader: A1's timed turns cannot cap "
                     "a child's CPU time or see all of what it ran while frozen",
                     f"run the grader in a cgroup v2 whose cgroup.subtree_control has cpu (`systemd-run --scope "
                     f"-p Delegate=yes make ...`, or a SLURM job with cgroup v2), or set {CGROUP_ENV}=/sys/fs/cgroup/"
                     "DIR for one the grader may write in; see docs/SECURITY.md")
    return f"each child gets a CPU cgroup of its own under {parent}"


def _tree(node: Node, which: str) -> Path:
    """A copy of starter_code as the grader builds it: pristine, or with the reference patch."""
    from grader.submission import load_submission, patched_tree, pristine_tree

    dest = node.out / "trees" / which
    shutil.rmtree(dest, ignore_errors=True)
    if which == "starter":
        return pristine_tree(dest)
    return patched_tree(load_submission(KIT_ROOT / "solutions" / "a1", node.out / "trees"), dest)


def _bench(node: Node, which: str) -> dict:
    tree = _tree(node, which)
    record = node.out / f"bench-{which}.json"
    done = _run(node, f"bench-{which}", [sys.executable, "-m", "onenode.cli", "bench", *BENCH_ARGS[node.device],
                                         "--out", str(record), "--quiet"],
                {"PYTHONPATH": str(tree / "starter_code")}, BENCH_TIMEOUT_S)
    if done.returncode != 0 or not record.is_file():
        raise Failed(f"onenode bench failed on the {which}: {_last_line(done.stderr + done.stdout)}",
                     f"see {node.out / f'bench-{which}.log'}; the kit's own tests (`make test-fast`) say more")
    results = json.loads(record.read_text())["results"]
    node.figures[which] = results
    return results


def _bench_line(results: dict, device: str) -> str:
    mfu = f", MFU {100 * results['mfu']:.2f}%" if device == "cuda" else ""
    return f"{results['tokens_per_s']:,.0f} tokens/s{mfu}, peak memory {results['peak_memory_gib']:.1f} GiB"


def check_starter_bench(node: Node) -> str:
    return f"{' '.join(BENCH_ARGS[node.device])}: {_bench_line(_bench(node, 'starter'), node.device)}"


def check_solution_bench(node: Node) -> str:
    results = _bench(node, "solution")
    starter = node.figures.get("starter")  # on a CPU the tiny preset's steps time nothing worth comparing
    against = (f", {results['tokens_per_s'] / starter['tokens_per_s']:.2f}x the starter's"
               if starter and node.device == "cuda" else "")
    return f"solutions/a1/submission.patch applied: {_bench_line(results, node.device)}{against}"


def check_a1_grade(node: Node) -> str:
    """The reference solution graded as a TA grades a submission (`a1_verdict` judges it)."""
    out = node.out / "a1-grade"
    shutil.rmtree(out, ignore_errors=True)
    done = _run(node, "a1-grade", [sys.executable, "-m", "grader.cli", "a1", "solutions/a1", "--profile", node.profile,
                                   "--out", str(out), "--no-notebook", "--seed", "1", "--quiet"])
    path = out / "a1" / "results.json"
    if done.returncode != 0 or not path.is_file():
        raise Failed(f"onenode-grade a1 failed: {_last_line(done.stderr + done.stdout)}",
                     f"see {node.out / 'a1-grade.log'} and {out / '.starter-logs' / 'seed-1'}")
    return a1_verdict(json.loads(path.read_text()), out / "a1", node.profile)


def a1_verdict(results: dict, folder: Path, profile: str) -> str:
    """The reference's results.json: every correctness and feature test must earn its points
    (speed points are reported, not required: a busy machine moves them)."""
    feedback = folder / "feedback.md"
    if results["extra_data"].get("grader_error"):
        raise Failed(f"grader error: {results['output']}", f"see {folder / 'logs' / 'grader-error.txt'}")
    missed = [t["name"] for t in results["tests"] if t["score"] < t["max_score"] and not t["name"].endswith("speed")]
    if missed:
        raise Failed(f"the reference solution lost points on {missed[0]}", f"read {feedback}")
    speed = [t for t in results["tests"] if t["name"].endswith("speed") and t["max_score"]]
    return (f"reference scored {results['score']:g}/{results['extra_data']['max_score']:g} of the code parts on "
            f"{profile} (speed {sum(t['score'] for t in speed):g}/{sum(t['max_score'] for t in speed):g}; the "
            f"notebook is not graded here): {feedback}")


def a2_profile(a1_profile: str, profiles: dict) -> str:
    """The A2 rubric's profile for the node: the A1 profile's name, else one of the same GPU
    (h200x2 -> h200x1), else the first on the same device."""
    if a1_profile in profiles:
        return a1_profile
    device = "cpu" if a1_profile.startswith("cpu") else "cuda"
    same = [name for name, p in profiles.items() if p.device == device]
    return next((name for name in same if name.split("x")[0] == a1_profile.split("x")[0]), same[0])


def check_a2_train_and_replay(node: Node) -> str:
    """A short run trained on the grader's A2 stack, then the grader's replay checks on it."""
    from grader.a2.intake import load_submission
    from grader.a2.job import a2_stack, train_on_stack
    from grader.a2.replay import run_harness
    from grader.a2.rubric import load_rubric
    from onenode.verify.replay import replay_checks

    rubric = load_rubric()
    name = a2_profile(node.profile, rubric.profiles)
    run, logs = node.out / "a2-run", node.out / "a2-replay-logs"
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    start = time.monotonic()
    try:
        train_on_stack(A2_RECIPE, run, {**A2_RUN, "train.device": node.device}, "--fresh")
    except RuntimeError as e:
        raise Failed(str(e).splitlines()[-1][:300], f"run `onenode train {A2_RECIPE.relative_to(KIT_ROOT)}` "
                     "on the A2 stack by hand (grader/a2/job.py train_on_stack)") from None
    trained = time.monotonic() - start
    sub, profile, stack = load_submission(run, notebook=False), rubric.profile(name), a2_stack()
    checks, cost = replay_checks(sub, profile, "node-check",
                                 lambda spans: run_harness(sub, stack, spans, profile, logs))
    failed = next((c for c in checks if not c.ok), None)
    if failed is not None:
        raise Failed(f"{failed.name}: {failed.detail[:300]}", f"see {logs / 'replay.log'}")
    replay = next(c for c in checks if c.name == "replay").detail.split(";")[0]
    return (f"{A2_STEPS} steps trained in {trained:.0f} s; {cost['replay_steps']} steps replayed on profile {name} in "
            f"{cost['replay_seconds']:.1f} s, every check passed ({replay})")


ITEMS = [
    Item("machine", check_machine),
    Item("gpus and nccl", check_gpus_and_nccl, gpu_only=True, needs=("machine",)),
    Item("bubblewrap", check_bubblewrap),
    Item("cpu cgroup", check_cpu_cgroup, gpu_only=True),
    Item("starter bench", check_starter_bench, needs=("machine",)),
    Item("solution bench", check_solution_bench, needs=("machine",)),
    Item("a1 grade", check_a1_grade, needs=("machine", "bubblewrap")),
    Item("a2 train and replay", check_a2_train_and_replay, needs=("machine", "bubblewrap")),
]


# -- running them --------------------------------------------------------------------------------
def run_item(item: Item, node: Node, done: dict[str, Outcome]) -> Outcome:
    if item.gpu_only and not node.gpus:
        return Outcome(item.name, "SKIP", "CPU-only machine")
    blocked = [name for name in item.needs if done.get(name) is None or done[name].status != "PASS"]
    if blocked:
        return Outcome(item.name, "SKIP", f"needs {', '.join(blocked)} to pass first")
    start = time.monotonic()
    try:
        return Outcome(item.name, "PASS", item.run(node), seconds=time.monotonic() - start)
    except Failed as e:
        return Outcome(item.name, "FAIL", e.detail, e.fix, time.monotonic() - start)
    except Exception as e:  # a bug in the check or the kit: the other items still run
        (node.out / f"{item.name.replace(' ', '-')}.error.txt").write_text(traceback.format_exc())
        return Outcome(item.name, "FAIL", f"{type(e).__name__}: {e}"[:300],
                       f"a kit bug, not the node's: see {node.out / (item.name.replace(' ', '-') + '.error.txt')}",
                       time.monotonic() - start)


def format_outcome(outcome: Outcome) -> str:
    took = f" ({outcome.seconds:.0f} s)" if outcome.seconds >= 1 else ""
    line = f"{outcome.status:<5} {outcome.name:<20} {outcome.detail}{took}"
    return line + (f"\n      fix: {outcome.fix}" if outcome.fix else "")


def run_items(items: list[Item], node: Node, echo: Callable[[str], None] = print) -> list[Outcome]:
    """Every item in order, each printed as it finishes; then one summary line."""
    done: dict[str, Outcome] = {}
    for item in items:
        done[item.name] = run_item(item, node, done)
        echo(format_outcome(done[item.name]))
    counts = {status: sum(o.status == status for o in done.values()) for status in ("PASS", "FAIL", "SKIP")}
    verdict = "the node is ready to grade on" if not counts["FAIL"] else "fix the failures above, then run it again"
    echo(f"node check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped on profile "
         f"{node.profile}; logs in {node.out}: {verdict}")
    return list(done.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(KIT_ROOT / "out" / "node-check"), help="where each item's logs go")
    parser.add_argument("--profile", default=os.environ.get("PROFILE"),
                        help="the A1 profile (default: $PROFILE, else picked from the GPUs found)")
    parser.add_argument("--min-free-gb", type=int, default=int(os.environ.get("MIN_FREE_GB", 100)),
                        help="free disk the GPU health check asks for in --out and $TMPDIR")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        parser.error(f"--out {out} holds files of its own: pass a new folder (each run replaces the one before)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / MARKER).write_text("logs of cluster/node_check.py; the next run replaces this folder\n")
    problem = kit_not_installed()
    if problem is not None:
        fix = ("run `make node-check` (on a node with its own CUDA torch: `make TORCH_SPEC=torch node-check`), or "
               "`pip install -e .` into this Python")
        print(format_outcome(Outcome("kit", "FAIL", problem, fix)))
        return 1
    names, problem = gpu_names()
    if problem is not None:
        print(format_outcome(Outcome("machine", "FAIL", problem,
                                     "check the NVIDIA driver (nvidia-smi), or drain the node and reboot it")))
        return 1
    node = Node(names, args.profile or pick_profile(names), out, args.min_free_gb)
    print(f"node check: {len(names)} NVIDIA GPU(s)" if names else
          "node check: CPU-only machine (no NVIDIA GPU found): GPU items are skipped, the CPU items run on "
          f"profile {CPU_PROFILE}")
    outcomes = run_items(ITEMS, node)
    return 1 if any(o.status == "FAIL" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
