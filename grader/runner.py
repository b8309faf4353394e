"""The parent side of the harness: sessions in a sandboxed child, timed from the grader.

The clock is the grader's: it starts before the workload (a seed) is written to the child and
stops when the answer (a digest) is read back, so a child cannot report its own times, and it
cannot precompute anything, because the inputs come from a seed it has not seen yet.

Every session runs in a child of its own: a fresh sandbox, scratch copy, /tmp and process tree,
with the session's own ranks. Nothing one session leaves (a process, a module's state, a file)
exists when the next starts, so no session can answer with another's results, and a crash, hang
or OOM in one part never touches another.

A session timed beside the starter's takes turns with it step by step. On CPU the idle one is
frozen (SIGSTOP), and its processes' CPU time read before and after: one that ran meanwhile
(a timer's SIGCONT undoes a stop) fails its session. On a GPU a frozen process's queued kernels keep running,
so there the submission's session runs to its end and its child is ended, its GPU contexts gone
(`SandboxedProcess.wait` waits for nvidia-smi to list none), before the starter's is timed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .meters import PeakResident, nvlink_tx_bytes, resident_bytes
from .rubric import Profile
from .sandbox import Limits, SandboxedProcess, SandboxError, isolated_ranks, make_scratch, spawn_sandboxed

LOG_TAIL_LINES = 30
DIED = "the child stopped answering"
RAN_WHILE_FROZEN = ("it ran while frozen for the other child's timed turn, which it could slow: a submission must "
                    "leave nothing running between its steps")


@dataclass(frozen=True)
class Harness:
    """The grader's own program a child runs (an assignment's), copied into its scratch folder."""

    script: Path  # run as `python -u <name>` in the child
    beside: tuple[Path, ...] = ()  # modules the script imports, copied next to it
    max_file_mb: int = 1024  # the largest file the child may write (the weights it saves)


@dataclass
class Session:
    """One thing to run: a name (its log and feedback title), a harness spec, the seeds (one per
    workload, drawn by the grader), the ranks its child starts and the files it reads (names of
    `run_sessions`'s `files_in`, copied into its child)."""

    name: str
    spec: dict
    seeds: list[int]
    world: int = 1
    reads: tuple[str, ...] = ()


@dataclass
class SessionResult:
    """What one session gave back. `error` is one line for the feedback, or None."""

    info: dict | None = None
    digests: list[dict] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per workload, measured by the grader
    # Per workload, read by the grader from outside the child (meters.py, sandbox.py): bytes the
    # child's processes sent each other (its loopback on CPU, NVLink on GPU; None: not observable
    # here), and the most memory any one of its processes had resident at any moment of it.
    traffic: list[int | None] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)
    # A training session's evidence (the optimizer's moments, the experts each rank holds), read
    # once after its last workload, on a clock of its own: its seconds and traffic, recorded only
    # (no scored step follows the reading, so nothing left for it can shorten one)
    evidence_s: float | None = None
    evidence_traffic: int | None = None
    gpu_memory: int | None = None  # the most GPU memory one of its processes held, after the session
    setup_s: float = 0.0  # from the session spec to "ready"
    error: str | None = None
    log_tail: str = ""  # the end of the child's log, when this session failed

    @property
    def ok(self) -> bool:
        return self.error is None


def child_cpus(profile: Profile, world: int) -> tuple[int, ...]:
    """The CPUs a child of `world` ranks may use: `threads` per rank, the first of the grader's own
    (every child the same ones: a submission and the starter take turns on them)."""
    mine = sorted(os.sched_getaffinity(0))
    return tuple(mine[:max(1, min(len(mine), profile.threads * world))])


def limits_for(profile: Profile, world: int, sessions: int, max_file_mb: int,
               isolation: dict[str, bool] | None = None) -> Limits:
    """One child's limits. RLIMIT_AS is meaningless under CUDA (it maps far more than it uses).
    User namespaces stay closed but where `isolation` (`Child.isolation`) has each rank close its own."""
    return Limits(
        wall_s=profile.timeout_s * sessions + 60,
        cpu_s=profile.timeout_s * sessions * max(1, profile.threads),
        memory_mb=None if profile.device == "cuda" else profile.memory_mb,
        nproc=512 + 256 * world,  # threads count: torch, gloo and NCCL start many per rank
        fsize_mb=max_file_mb,
        cpus=child_cpus(profile, world),
        user_namespaces=bool(isolation and isolation["namespaces"]),
    )


class Child:
    """A sandboxed harness with `world` ranks, in its own scratch copy of `tree`."""

    def __init__(self, name: str, tree: Path, harness: Harness, profile: Profile, world: int, sessions: int,
                 files_in: dict[str, Path]):
        self.name, self.profile = name, profile
        self.ended: tuple[str, str] | None = None
        self.scratch = make_scratch()
        try:
            shutil.copytree(tree / "starter_code", self.scratch / "starter_code")
            for src in (harness.script, *harness.beside):
                shutil.copy2(src, self.scratch / src.name)
            for name, src in files_in.items():
                shutil.copy2(src, self.scratch / name)
            env = {"OMP_NUM_THREADS": str(profile.threads), "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                   "PYTHONHASHSEED": "0"}
            # a single rank has no other to be shut off from; several confine themselves (grader/a1/confine.py)
            self.isolation = isolated_ranks() if world > 1 else None
            limits = limits_for(profile, world, sessions, harness.max_file_mb, self.isolation)
            self.ends_by = time.monotonic() + limits.wall_s  # when the sandbox's wall limit ends it
            self.proc: SandboxedProcess = spawn_sandboxed([sys.executable, "-u", harness.script.name], cwd=self.scratch,
                                                          env=env, limits=limits)
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        self._write({"world": world, "threads": profile.threads, "device": profile.device,
                     "tree": str((self.scratch / "starter_code").resolve()), "confine": self.isolation})

    def _write(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def ask(self, message: dict, deadline: float) -> tuple[dict, float]:
        """Send one message, wait for one answer; the seconds in between by the grader's clock."""
        start = time.perf_counter()
        try:
            self._write(message)
            line = self.proc.readline(timeout=max(deadline - time.monotonic(), 0.1))
        except (BrokenPipeError, ConnectionResetError):
            return {"error": None}, 0.0
        except TimeoutError:
            self.proc.kill("wall time")
            return {"error": f"no answer within the profile's {self.profile.timeout_s:g} s"}, 0.0
        seconds = time.perf_counter() - start
        if not line.strip():
            return {"error": None}, seconds  # the child died: its exit says why
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            return {"error": f"the harness answered garbage: {line[:200]!r}"}, seconds
        return (reply if isinstance(reply, dict) else {"error": "the harness answered garbage"}), seconds

    def open(self, session: Session, deadline: float) -> SessionResult:
        result = SessionResult()
        reply, result.setup_s = self.ask({"session": session.spec}, deadline)
        if "ready" in reply:
            result.info = reply["ready"]
        else:
            result.error = reply.get("error") or DIED
        return result

    def release(self, deadline: float) -> bool:
        """Drop the session the child holds (its memory, on the GPU too); whether it answered."""
        reply, _ = self.ask({"release": True}, deadline)
        return "released" in reply

    def traffic(self) -> int | None:
        """Bytes sent between this child's processes so far, by a counter the child cannot reach:
        its own loopback (gloo), or the GPUs' NVLink counters (NCCL; the job owns the node)."""
        if self.profile.device == "cuda":
            return nvlink_tx_bytes()
        return self.proc.network_bytes()

    def step(self, result: SessionResult, seed: int, deadline: float, evidence: bool = False) -> None:
        """One timed workload; with `evidence` (the session's last), then its evidence on a clock of
        its own (merged into the workload's digest). Host memory is the peak over the workload, sampled while it runs
        (CPU profiles, where it is scored; on a GPU, where a sampling thread beside a host-bound
        step would be timed with it, it is read once the workload ends, and only recorded)."""
        traffic = self.traffic()
        with PeakResident(self.proc.pids if self.profile.device == "cpu" else list) as resident:
            reply, seconds = self.ask({"seed": seed}, deadline)
        if "digest" not in reply:
            result.error = reply.get("error") or DIED
            return
        after = self.traffic()
        digest = reply["digest"]
        if evidence:
            answer, evidence_s = self.ask({"evidence": True}, deadline)
            if "evidence" not in answer or not isinstance(answer["evidence"], dict) \
                    or not isinstance(digest, dict):
                result.error = answer.get("error") or DIED
                return
            read = self.traffic()
            digest = {**answer["evidence"], **digest}
            result.evidence_s = evidence_s
            result.evidence_traffic = None if read is None or after is None else read - after
        result.digests.append(digest)
        result.seconds.append(seconds)
        result.traffic.append(None if traffic is None or after is None else after - traffic)
        result.resident.append(resident.peak or max(resident_bytes(self.proc.pids()).values(), default=0))

    def gpu_memory(self) -> int | None:
        gpu = [m.gpu for m in self.proc.peak_memory_bytes().values() if m.gpu is not None]
        return max(gpu) if gpu else None

    def run(self, session: Session, baseline: tuple[Child, Session] | None = None
            ) -> tuple[SessionResult, SessionResult | None]:
        """Run a session; with a `baseline` (the starter's child and session) the two take
        turns step by step (ABBA), so both are timed on the same machine in the same minutes.
        Whichever is timed runs alone: every process of the other is frozen meanwhile, so
        nothing one leaves running (a CPU burner, say) can slow the other's turn; a child whose
        processes ran all the same (a signal that wakes them: `SandboxedProcess.resume` reads their
        CPU time) fails its session. CPU only: on a GPU see `run_beside`."""
        deadline = time.monotonic() + self.profile.timeout_s
        pairs = [(self, session, self.open(session, deadline))]
        if baseline is not None:
            pairs.append((*baseline, baseline[0].open(baseline[1], deadline)))
        for i, seed in enumerate(session.seeds):
            for child, timed, result in pairs if i % 2 == 0 else pairs[::-1]:
                others = [(other, its) for other, _, its in pairs if other is not child]
                if result.ok:
                    for other, _ in others:
                        other.proc.pause()
                    try:
                        child.step(result, seed, deadline,
                                   evidence=timed.spec.get("kind") == "train" and i == len(session.seeds) - 1)
                    finally:
                        for other, its in others:
                            ran = other.proc.resume()
                            if ran and its.ok:  # it ran in the other's timed turn: no turn of this session counts
                                its.error = f"{RAN_WHILE_FROZEN} ({ran})"
            if not pairs[0][2].ok:
                break
        for child, _, result in pairs:
            if result.ok:
                result.gpu_memory = child.gpu_memory()
        return pairs[0][2], (pairs[1][2] if baseline is not None else None)

    def close(self, logs: Path | None) -> tuple[str, str]:
        """End the child (politely, then not), save its log as `<name>.log` in `logs` (if given);
        (log, one-line reason it ended). Once ended, the same answer again."""
        if self.ended is not None:
            return self.ended
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        ended = self.proc.wait(timeout=60)
        log = ended.stderr.decode("utf-8", errors="replace")
        if logs is not None:
            (logs / f"{self.name}.log").write_text(log, encoding="utf-8")
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.ended = log, ended.reason
        return self.ended


class Baseline:
    """The unpatched starter's session that a submission's session of the same name is timed
    beside, on a one-rank child kept from one submission to the next: starting a child costs
    seconds (torch's import, the model's build; on a GPU its context too), and the starter's code
    is the kit's own. Between submissions the child holds no session (`Child.release`). It is
    replaced after a failure, and before its wall limit could end it during a session."""

    REUSE = 8  # sessions a child is sized for (its wall and CPU limits)

    def __init__(self, tree: Path, harness: Harness, profile: Profile, session: Session, files_in: dict[str, Path]):
        self.tree, self.harness, self.profile, self.session, self.files_in = tree, harness, profile, session, files_in
        self.child: Child | None = None
        self.served = 0

    def next_child(self) -> Child:
        """The child for the next submission: the kept one, or a fresh one."""
        spent = self.child is not None and (
            self.served >= self.REUSE or not self.child.proc.pids()
            or self.child.ends_by - time.monotonic() < 2 * self.profile.timeout_s)
        if spent:
            self.close()
        if self.child is None:
            self.child = Child(f"starter-{self.session.name}", self.tree, self.harness, self.profile, 1, self.REUSE,
                               self.files_in)
            self.served = 0
        self.served += 1
        return self.child

    def done(self, result: SessionResult, logs: Path) -> SessionResult:
        """Keep the child if its session went well and it let go of it; else end it (its log goes
        to `logs`, and a failed result gets the reason and the log's tail)."""
        if result.ok and self.child.release(time.monotonic() + self.profile.timeout_s):
            return result
        log, reason = self.child.close(logs)
        self.child = None
        return _with_reason(result, log, reason)

    def close(self, logs: Path | None = None) -> None:
        if self.child is not None:
            self.child.close(logs)
            self.child = None


def run_beside(child: Child, session: Session, starter: Baseline, logs: Path
               ) -> tuple[SessionResult, SessionResult]:
    """`session` on `child`, timed beside the starter's. On a GPU the submission's child is ended
    (its log saved) before the starter's first timed step: a stopped process's queued kernels
    would run on into the starter's turn, an ended one's cannot."""
    if child.profile.device != "cuda":
        return child.run(session, (starter.next_child(), starter.session))
    result, _ = child.run(session)
    child.close(logs)
    base_result, _ = starter.next_child().run(starter.session)
    return result, base_result


def run_sessions(harness: Harness, tree: Path, profile: Profile, sessions: list[Session], logs: Path,
                 files_in: dict[str, Path] | None = None, files_out: dict[str, Path] | None = None,
                 baselines: dict[str, Baseline] | None = None) -> dict[str, SessionResult]:
    """Run `sessions` in order, each on a fresh child of its own `world` ranks running `harness`.

    `files_in` are copied into each child's scratch under their keys before it starts (weights);
    `files_out` are copied out of a child's scratch once its session ends, if it wrote them, and
    handed in to the sessions after it (the starter's weights, saved by one session, loaded by the
    next). `baselines` maps a session name to the starter's `Baseline`: that session is timed in
    turns with the starter's; its result is returned under "<name>-starter".
    """
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, SessionResult] = {}
    files_in = dict(files_in or {})
    try:
        for i, session in enumerate(sessions):
            missing = [name for name in session.reads if name not in files_in]
            if missing:  # the session that writes it failed: its own result says why
                results[session.name] = SessionResult(error=f"no {', '.join(missing)} to load: the session that "
                                                            "writes it failed")
                continue
            child = Child(f"child-{i + 1}-{session.name}", tree, harness, profile, session.world, 1,
                          {name: files_in[name] for name in session.reads})
            try:
                starter = (baselines or {}).get(session.name)
                if starter is None:
                    result, _ = child.run(session)
                else:
                    result, base_result = run_beside(child, session, starter, logs)
                    results[f"{session.name}-starter"] = starter.done(base_result, logs)
                results[session.name] = result
                for name, dst in (files_out or {}).items():
                    if result.ok and (child.scratch / name).is_file():
                        shutil.copy2(child.scratch / name, dst)
                        files_in[name] = dst
            finally:
                log, reason = child.close(logs)
                if session.name in results:
                    _with_reason(results[session.name], log, reason)
    except SandboxError as e:
        for s in sessions:
            results.setdefault(s.name, SessionResult(error=f"sandbox: {e}"))
    keep_evidence(results, logs)
    return results


EVIDENCE = "evidence.json"


def keep_evidence(results: dict[str, SessionResult], logs: Path) -> None:
    """Every session's evidence as the grader received and measured it, in `logs`/evidence.json
    (beside what an earlier call kept there): what a disputed grade is re-examined from, and what
    a tolerance is set from, without running anything again."""
    path = logs / EVIDENCE
    kept = json.loads(path.read_text()) if path.is_file() else {}
    kept.update({name: {k: v for k, v in asdict(r).items() if k != "log_tail"}
                 for name, r in results.items()})
    path.write_text(json.dumps(kept))


def _with_reason(result: SessionResult, log: str, reason: str) -> SessionResult:
    """A failed session's error says how its child ended, and keeps the end of its log."""
    if not result.ok:
        if result.error == DIED and reason:
            result.error = reason
        result.log_tail = "\n".join(log.strip().splitlines()[-LOG_TAIL_LINES:])
    return result
