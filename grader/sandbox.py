"""Run untrusted submission code in a sandbox. Every process that executes student code starts here.

What the sandbox enforces, and where (docs/SECURITY.md has the threat model):

- grader running as root: each run leases a dedicated uid from a pool (``ONENODE_SANDBOX_UIDS``,
  default 60100-60163, no passwd entry), the scratch copy is chowned to it, so the child can write
  nowhere else we care about and cannot read grader-private (0700 root) directories; RLIMIT_NPROC
  caps that uid's processes (a fork bomb stops there), and at the end every process of the uid is
  killed at once (``kill(-1)`` from the uid itself), daemons that left the session included.
- no network: a fresh network namespace (root, or an unprivileged user namespace where the kernel
  allows one) with only its own loopback, so multi-process gloo still works but nothing outside the
  sandbox, the machine's own 127.0.0.1 included, can be reached. Where neither works: a warning.
- rlimits on CPU time, address space, processes, open files and file size; ``no_new_privs`` so
  setuid binaries cannot give privileges back; wall time, whole-session kill and capped
  stdout/stderr are enforced from the grader process.
- a Python install the uid cannot reach (pyenv under a 0700 /root) is bind-mounted read-only
  into a private mount namespace, and nothing else of that directory.

Two entry points: ``run_sandboxed`` (run to completion, capture output) and ``spawn_sandboxed``
(pipes for the timed harness). The child's environment is built from an allow-list
(``sandbox_env``), never copied from the grader.
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import os
import pwd
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "Limits", "SandboxResult", "SandboxedProcess", "SandboxError", "run_sandboxed",
    "spawn_sandboxed", "sandbox_env", "make_private", "make_scratch", "capabilities",
]

MIB = 1 << 20
_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = (
    0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000, 0x40000)
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
# Top-level entries the sandbox uid leaves in these world-writable dirs are deleted after each run.
_SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_OOM_MARKERS = (b"MemoryError", b"can't allocate memory", b"Unable to allocate", b"std::bad_alloc",
                b"Cannot allocate memory", b"out of memory")


class SandboxError(RuntimeError):
    """The sandbox could not be set up (the submission never ran); the message says what to fix."""


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed process tree. ``None`` lifts a limit.

    ``memory_mb`` is RLIMIT_AS (virtual memory): importing torch maps about 600 MiB and each thread
    adds its stack and malloc arena (up to ~72 MiB); CUDA maps far more than it uses, so pass
    ``None`` on GPU profiles (docs/SECURITY.md).
    ``cpu_s`` is per process; ``nproc`` counts threads too (torch starts one per core).
    """

    wall_s: float = 600.0
    cpu_s: float | None = 600.0
    memory_mb: int | None = 8192
    nproc: int | None = 512
    nofile: int | None = 1024
    fsize_mb: int | None = 1024
    output_kb: int = 256
    network: bool = False

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "nproc", "nofile", "fsize_mb", "output_kb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"Limits.{name}={value}: must be positive (None lifts a limit)")
        if self.wall_s is None or self.output_kb is None:
            raise ValueError("Limits.wall_s and Limits.output_kb cannot be lifted: give them a number")


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended. ``reason`` is one line for feedback, empty when all went well."""

    returncode: int
    stdout: bytes
    stderr: bytes
    wall_s: float
    timed_out: bool
    killed_reason: str | None  # "wall time", "cpu time", "memory", "file size", "signal", "grader"
    stdout_truncated: bool
    stderr_truncated: bool
    network_isolated: bool
    reason: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


# ----------------------------------------------------------------------------- what this machine allows


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _is_root() -> bool:
    return os.geteuid() == 0


def _uid_pool() -> range:
    spec = os.environ.get("ONENODE_SANDBOX_UIDS", "60100-60163")
    try:
        first, last = (int(x) for x in spec.split("-"))
    except ValueError:
        raise SandboxError(f"ONENODE_SANDBOX_UIDS={spec!r}: expected FIRST-LAST, e.g. 60100-60163") from None
    return range(first, last + 1)


def _enter_network_namespace(own_uid: int, own_gid: int, as_root: bool) -> None:
    """In the child, before dropping privileges: a new netns whose only interface is its own lo."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNET if as_root else _CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    if not as_root:  # keep our own identity inside the user namespace
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{own_uid} {own_uid} 1")
        Path("/proc/self/gid_map").write_text(f"{own_gid} {own_gid} 1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # lo up: gloo rendezvous inside
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def _unreachable_python() -> dict[str, list[str]]:
    """Python installs the sandbox uid cannot reach (pyenv under 0700 /root), by blocking directory."""
    hidden: dict[str, list[str]] = {}
    for prefix in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}):
        blocker = next((str(d) for d in reversed(Path(prefix).parents)
                        if not d.stat().st_mode & stat.S_IXOTH), None)
        if blocker:
            hidden.setdefault(blocker, []).append(prefix)
    return hidden


def _expose_python(hidden: dict[str, list[str]]) -> None:
    """In the child, as root: a private mount namespace where each blocking directory is an empty
    tmpfs holding only read-only binds of the Python install, so the interpreter starts and the
    rest of, say, /root stays out of sight."""
    libc = _libc()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    for blocker, prefixes in hidden.items():
        fds = {prefix: os.open(prefix, os.O_PATH | os.O_DIRECTORY) for prefix in prefixes}
        check(libc.mount(b"tmpfs", blocker.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0755,size=64k"),
              f"mount tmpfs on {blocker}")
        for prefix, fd in fds.items():
            os.makedirs(prefix, mode=0o755, exist_ok=True)
            check(libc.mount(f"/proc/self/fd/{fd}".encode(), prefix.encode(), None, _MS_BIND | _MS_REC, None),
                  f"bind {prefix}")
            check(libc.mount(None, prefix.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None),
                  f"remount {prefix} read-only")
            os.close(fd)


@cache
def _network_namespace_available() -> bool:
    """Probe once with a throwaway child: containers and hardened kernels often forbid unshare."""
    _libc()
    uid, gid, root = os.getuid(), os.getgid(), _is_root()
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True, timeout=30,
                       preexec_fn=lambda: _enter_network_namespace(uid, gid, root),
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def capabilities() -> dict[str, object]:
    """Which guarantees hold on this machine (docs/SECURITY.md); the grader records it in env.json."""
    root = _is_root()
    return {
        "separate_uid": root,
        "uid_pool": f"{_uid_pool().start}-{_uid_pool().stop - 1}" if root else None,
        "private_dirs": root,
        "kill_escaped_daemons": root,
        "network_namespace": _network_namespace_available(),
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
    }


@cache
def _warn_about_gaps() -> None:
    gaps = []
    if not _is_root():
        gaps.append(f"the grader runs as uid {os.getuid()}, not root: submission code runs as that user, "
                    "can read whatever it can (solutions, hidden tests, results, other scratch copies), "
                    "and a daemon that leaves its session survives; run the grader as root to close this")
    if not _network_namespace_available():
        gaps.append("no network namespace can be created here (unshare refused): submission code has "
                    "the machine's network; grade on a machine that allows unshare --net")
    if gaps:
        warnings.warn("sandbox: " + "; ".join(gaps), RuntimeWarning, stacklevel=4)


# ----------------------------------------------------------------------------- files and directories


def make_private(path: str | os.PathLike) -> Path:
    """Make a grader-only directory (solutions, hidden tests, results): 0700, root-owned when root."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if _is_root():
        os.chown(path, 0, 0)
    path.chmod(0o700)
    return path


def make_scratch(parent: str | os.PathLike | None = None) -> Path:
    """A fresh, empty scratch directory the sandbox uid can reach (every ancestor traversable).

    The default parent is ``$TMPDIR/onenode-scratch`` (0711: others may pass through, not list).
    The caller copies the starter into it and deletes it when done.
    """
    parent = Path(parent) if parent else Path(tempfile.gettempdir()) / "onenode-scratch"
    parent.mkdir(parents=True, exist_ok=True)
    info = parent.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise SandboxError(f"{parent} is not a directory of ours (a submission may have planted it); "
                           "remove it or pass another parent")
    parent.chmod(0o711)
    return Path(tempfile.mkdtemp(prefix="sub-", dir=parent))


def _check_reachable(scratch: Path) -> None:
    for parent in scratch.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise SandboxError(f"scratch {scratch} cannot be reached by the sandbox user: {parent} is "
                               f"mode {parent.stat().st_mode & 0o777:04o}; create scratch copies with "
                               "grader.sandbox.make_scratch()")


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def sandbox_env(scratch: str | os.PathLike) -> dict[str, str]:
    """The child's whole environment, from an allow-list: caches, HOME and TMPDIR inside the scratch.

    PYTHONPATH points at ``<scratch>/starter_code`` when the scratch holds a starter copy, so the
    patched ``onenode`` shadows any installed one.
    """
    scratch = Path(scratch).resolve()
    cache_dir = scratch / ".cache"
    env = {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        "LANG": "C.UTF-8",
        "HOME": str(scratch / "home"),
        "TMPDIR": str(scratch / "tmp"),
        "XDG_CACHE_HOME": str(cache_dir),
        "HF_HOME": str(cache_dir / "hf"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
        "TRITON_CACHE_DIR": str(cache_dir / "triton"),
        "MPLCONFIGDIR": str(cache_dir / "matplotlib"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONNOUSERSITE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    for name in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH"):  # the grader's GPU choice, not secrets
        if name in os.environ:
            env[name] = os.environ[name]
    if (scratch / "starter_code").is_dir():
        env["PYTHONPATH"] = str(scratch / "starter_code")
    return env


# ----------------------------------------------------------------------------- processes of a uid


def _live_pids(uid: int | None = None, pgid: int | None = None) -> list[int]:
    """Pids of the live (not zombie) processes of ``uid`` or of process group ``pgid``, from /proc."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if pgid is None and entry.stat().st_uid != uid:
                continue
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] not in "ZX" and (pgid is None or int(fields[2]) == pgid):
            pids.append(int(entry.name))
    return pids


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` in one kernel pass: kill(-1) sent from that uid cannot be outrun."""

    def kill_all_as_uid() -> None:  # in a forked helper, which then execs /bin/true and is gone
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass

    for _ in range(50):
        if not _live_pids(uid):
            return
        subprocess.run(["/bin/true"], preexec_fn=kill_all_as_uid, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=30)
        time.sleep(0.02)
    raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL: {_live_pids(uid)}")


def _remove_files_of(uid: int) -> None:
    """Delete what the uid left at the top of world-writable dirs, so no later run can read it."""
    for top in {os.path.realpath(d) for d in _SHARED_TMP_DIRS if os.path.isdir(d)}:
        for entry in os.scandir(top):
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass


def _wait_gpu_released(pids: set[int], timeout_s: float = 15.0) -> None:
    """On CUDA machines: wait until none of ``pids`` holds a GPU context (memory freed)."""
    smi = shutil.which("nvidia-smi")
    if not smi or not pids:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout
        if not pids & {int(p) for p in out.split() if p.isdigit()}:
            return
        time.sleep(0.5)
    warnings.warn(f"sandbox: GPU contexts of killed pids {sorted(pids)} still listed by nvidia-smi "
                  f"after {timeout_s:g} s; the next submission may see less GPU memory", RuntimeWarning, stacklevel=2)


class _UidLease:
    """One uid of the pool, held through an flock (released by the kernel if the grader dies)."""

    def __init__(self) -> None:
        lock_dir = Path("/run/onenode-sandbox" if os.access("/run", os.W_OK) else
                        Path(tempfile.gettempdir()) / "onenode-sandbox-locks")
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        info = lock_dir.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
            raise SandboxError(f"{lock_dir} must be a root-owned 0700 directory; remove it and retry")
        for uid in _uid_pool():
            try:
                pwd.getpwuid(uid)
                continue  # a real account: never ours to kill or chown to
            except KeyError:
                pass
            fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            self.sweep()  # whatever a crashed grader left behind
            return
        raise SandboxError(f"all sandbox uids {_uid_pool().start}-{_uid_pool().stop - 1} are busy; "
                           "run fewer submissions at once or widen ONENODE_SANDBOX_UIDS")

    def sweep(self) -> None:
        _kill_uid(self.uid)
        _remove_files_of(self.uid)

    def release(self) -> None:
        self.sweep()
        os.close(self._fd)


# ----------------------------------------------------------------------------- output capture


class _Capture:
    """Drain a pipe in a thread, keeping the head and the tail within ``cap`` bytes."""

    def __init__(self, pipe, cap: int) -> None:
        self._pipe, self._head_cap, self._tail_cap = pipe, cap - cap // 4, cap // 4
        self._head, self._tail, self.total = bytearray(), bytearray(), 0
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        fd = self._pipe.fileno()
        while chunk := os.read(fd, 1 << 16):
            self.total += len(chunk)
            room = self._head_cap - len(self._head)
            self._head += chunk[:max(room, 0)]
            self._tail += chunk[max(room, 0):]
            del self._tail[:max(len(self._tail) - self._tail_cap, 0)]

    @property
    def truncated(self) -> bool:
        return self.total > self._head_cap + self._tail_cap

    def collect(self, timeout_s: float = 5.0) -> bytes:
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # a reader still blocked (escaped daemon) keeps its fd
            self._pipe.close()
        if not self.truncated:
            return bytes(self._head + self._tail)
        cut = self.total - len(self._head) - len(self._tail)
        return bytes(self._head) + f"\n[... {cut} bytes cut by the grader ...]\n".encode() + bytes(self._tail)


# ----------------------------------------------------------------------------- the sandboxed process


class SandboxedProcess:
    """A running sandboxed process tree. Use as a context manager: leaving it kills the whole tree.

    ``stdin``/``stdout`` are binary pipes for the harness protocol (``readline`` reads with a
    timeout and a size cap); stderr is captured (capped) and comes back in ``wait()``'s result.
    The wall limit runs from the start, whether or not anyone is waiting.
    """

    def __init__(self, argv: Sequence[str], *, cwd: Path, scratch: Path, env: dict[str, str],
                 limits: Limits, stdin_pipe: bool, capture_stdout: bool) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._killed_reason: str | None = None
        self._reaped = False
        self._wait_timeout: float | None = None
        self._buf = b""
        self._result: SandboxResult | None = None
        root = _is_root()
        self.network_isolated = not limits.network and _network_namespace_available()
        _warn_about_gaps()
        self._lease = _UidLease() if root else None
        try:
            if self._lease:
                _check_reachable(scratch)
                _chown_tree(scratch, self._lease.uid, self._lease.uid)
                scratch.chmod(0o700)
            self._start = time.monotonic()
            self._popen = subprocess.Popen(
                list(argv), cwd=cwd, env=env, close_fds=True, start_new_session=True,
                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                preexec_fn=self._child_setup_fn(self._lease.uid if self._lease else None))
        except subprocess.SubprocessError as e:  # the child's setup failed before exec
            self._release(scratch)
            raise SandboxError(f"cannot start a sandboxed process here ({e}); see "
                               "grader.sandbox.capabilities() and docs/SECURITY.md") from e
        except BaseException:
            self._release(scratch)
            raise
        self._scratch = scratch
        self.pid = self.pgid = self._popen.pid
        self._pids = {self.pid}  # every pid of the run seen, for the GPU check
        self.stdin, self.stdout = self._popen.stdin, self._popen.stdout
        self._pidfd = os.pidfd_open(self.pid)
        self._stderr = _Capture(self._popen.stderr, limits.output_kb * 1024)
        self._stdout = _Capture(self._popen.stdout, limits.output_kb * 1024) if capture_stdout else None
        self._watchdog = threading.Timer(limits.wall_s, self.kill, args=("wall time",))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _child_setup_fn(self, uid: int | None):
        limits, netns = self.limits, self.network_isolated
        own_uid, own_gid, root = os.getuid(), os.getgid(), uid is not None
        rlimits = [(resource.RLIMIT_CORE, 0)]
        if limits.cpu_s is not None:
            rlimits.append((resource.RLIMIT_CPU, (math.ceil(limits.cpu_s), math.ceil(limits.cpu_s) + 1)))
        if limits.memory_mb is not None:
            rlimits.append((resource.RLIMIT_AS, limits.memory_mb * MIB))
        if limits.nofile is not None:
            rlimits.append((resource.RLIMIT_NOFILE, limits.nofile))
        if limits.fsize_mb is not None:
            rlimits.append((resource.RLIMIT_FSIZE, limits.fsize_mb * MIB))
        if limits.nproc is not None:  # per uid: without a uid of our own, count on top of what runs
            base = 0 if root else sum(_thread_count(pid) for pid in _live_pids(own_uid))
            rlimits.append((resource.RLIMIT_NPROC, base + limits.nproc))
        hidden_python = _unreachable_python() if root else {}
        libc, grader_pid = _libc(), os.getpid()

        def setup() -> None:  # runs in the child between fork and exec: no imports, no locks
            if hidden_python:
                _expose_python(hidden_python)
            if netns:
                _enter_network_namespace(own_uid, own_gid, root)
            for which, value in rlimits:
                resource.setrlimit(which, value if isinstance(value, tuple) else (value, value))
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            if root:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            # If the grader dies (even by SIGKILL), so does the child; set after the uid change,
            # which clears it. The parent is the *thread* that spawned: see spawn_sandboxed.
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != grader_pid:  # the grader died before the line above
                os.kill(os.getpid(), signal.SIGKILL)
            os.umask(0o077)

        return setup

    # -- harness side

    def readline(self, timeout: float | None = None, max_bytes: int | None = None) -> bytes:
        """One line of the child's stdout, newline included; b"" once it closed stdout.

        Raises TimeoutError after ``timeout`` seconds and SandboxError for a line longer than
        ``max_bytes`` (default: the output cap), so a hung or flooding child cannot stall the grader.
        """
        max_bytes = max_bytes or self.limits.output_kb * 1024
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.stdout.fileno()
        while b"\n" not in self._buf:
            if len(self._buf) > max_bytes:
                raise SandboxError(f"submission wrote a line over {max_bytes} bytes")
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no line from the submission within {timeout:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                line, self._buf = self._buf, b""
                return line
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line + b"\n"

    def kill(self, reason: str = "grader") -> None:
        """Kill the whole tree now: the session's process group, then every process of the uid."""
        with self._lock:
            if self._reaped:
                return
            if self._killed_reason is None and not self._leader_exited():
                self._killed_reason = reason
            self._kill_tree()

    def _leader_exited(self) -> bool:
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def _kill_tree(self) -> None:
        if self._lease:
            self._pids.update(_live_pids(self._lease.uid))
        try:
            os.killpg(self.pgid, signal.SIGKILL)  # the leader is not reaped yet: the pgid is still ours
        except ProcessLookupError:
            pass
        if self._lease:
            _kill_uid(self._lease.uid)
            return
        for _ in range(100):  # SIGKILL lands asynchronously: wait until the group is really gone
            if not _live_pids(pgid=self.pgid):
                return
            time.sleep(0.01)

    def wait(self, timeout: float | None = None) -> SandboxResult:
        """Wait for the end (at most ``timeout`` s, then kill), clean up, and say how it went."""
        if self._result is not None:
            return self._result
        left = self._start + self.limits.wall_s - time.monotonic()
        if timeout is not None and timeout < left:
            left, self._wait_timeout = timeout, timeout
        if not select.select([self._pidfd], [], [], max(left, 0))[0]:
            self.kill("wall time" if self._wait_timeout is None else "wait timeout")
        select.select([self._pidfd], [], [])
        with self._lock:  # grandchildren outlive the leader: kill its group before reaping it
            self._watchdog.cancel()
            self._kill_tree()
            _, status, usage = os.wait4(self.pid, 0)
            self._reaped = True
        self._popen.returncode = os.waitstatus_to_exitcode(status)
        return self._finish(usage.ru_utime + usage.ru_stime)

    def _finish(self, cpu_used: float) -> SandboxResult:
        wall = time.monotonic() - self._start
        stderr = self._stderr.collect()
        stdout = self._stdout.collect() if self._stdout else b""
        os.close(self._pidfd)
        if self.stdin:
            _close_quietly(self.stdin)
        self._release(self._scratch)
        killed, reason = _explain(self._popen.returncode, self._killed_reason, stderr, cpu_used,
                                  self.limits, self._wait_timeout)
        truncated = [name for name, cap in (("stdout", self._stdout), ("stderr", self._stderr))
                     if cap is not None and cap.truncated]
        if truncated:
            note = f"{' and '.join(truncated)} over {self.limits.output_kb} KiB truncated"
            reason = f"{reason}; {note}" if reason else note
        self._result = SandboxResult(
            returncode=self._popen.returncode, stdout=stdout, stderr=stderr, wall_s=wall,
            timed_out=killed in ("wall time", "wait timeout"), killed_reason=killed,
            stdout_truncated="stdout" in truncated, stderr_truncated="stderr" in truncated,
            network_isolated=self.network_isolated, reason=reason)
        _wait_gpu_released(self._pids)
        return self._result

    def _release(self, scratch: Path) -> None:
        """Hand the scratch back to root (the uid may serve another submission next), then sweep
        the uid's files elsewhere and free it. In that order: a scratch made at the top of /tmp
        would otherwise be swept as the uid's leftovers."""
        if self._lease:
            _kill_uid(self._lease.uid)  # nothing may still write into the scratch
            os.chown(scratch, 0, 0)
            scratch.chmod(0o700)
            self._lease.release()
            self._lease = None

    def __enter__(self) -> SandboxedProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self._result is None:
            self.kill()
            self.wait()
        _close_quietly(self.stdout)


def _close_quietly(pipe) -> None:
    try:
        pipe.close()
    except (OSError, ValueError):
        pass  # the child is gone, or another thread closed it first: nothing left to flush to


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return 0


def _explain(rc: int, killed: str | None, stderr: bytes, cpu_used: float, limits: Limits,
             wait_timeout: float | None) -> tuple[str | None, str]:
    """(killed_reason, one-line reason) from how the process ended."""
    tail = stderr[-4096:]
    if killed == "wall time":
        return killed, f"killed: wall time {limits.wall_s:g} s exceeded"
    if killed == "wait timeout":
        return killed, f"killed: no exit within {wait_timeout:g} s"
    if killed:
        return killed, "killed by the grader"
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and limits.cpu_s and cpu_used >= limits.cpu_s):
        return "cpu time", f"killed: CPU time {limits.cpu_s:g} s exceeded"
    if rc == -signal.SIGXFSZ or (rc != 0 and b"File too large" in tail):
        return "file size", f"killed: file size limit {limits.fsize_mb} MiB exceeded"
    if rc != 0 and limits.memory_mb and any(m in tail for m in _OOM_MARKERS):
        return "memory", f"out of memory (limit {limits.memory_mb} MiB)"
    if rc < 0:
        return "signal", f"killed by {signal.Signals(-rc).name}"
    return None, f"exited with code {rc}" if rc else ""


# ----------------------------------------------------------------------------- entry points


def _open(argv, cwd, env, limits, scratch, *, stdin_pipe: bool, capture_stdout: bool) -> SandboxedProcess:
    cwd = Path(cwd).resolve()
    scratch = Path(scratch).resolve() if scratch else cwd
    if not scratch.is_dir():
        raise SandboxError(f"scratch directory {scratch} does not exist; create it with make_scratch()")
    for sub in ("home", "tmp"):
        (scratch / sub).mkdir(exist_ok=True)
    return SandboxedProcess(argv, cwd=cwd, scratch=scratch, env={**sandbox_env(scratch), **(env or {})},
                            limits=limits, stdin_pipe=stdin_pipe, capture_stdout=capture_stdout)


def spawn_sandboxed(argv: Sequence[str], *, cwd: str | os.PathLike, env: Mapping[str, str] | None = None,
                    limits: Limits = Limits(), scratch: str | os.PathLike | None = None) -> SandboxedProcess:
    """Start ``argv`` sandboxed with stdin/stdout pipes (the interactive form for the harness).

    ``scratch`` (default: ``cwd``) is the only place the child may write; ``env`` adds variables
    on top of ``sandbox_env(scratch)`` (never pass ``os.environ``). The child is killed when the
    thread that spawned it ends, so spawn from a thread that lives as long as the process.
    """
    return _open(argv, cwd, env, limits, scratch, stdin_pipe=True, capture_stdout=False)


def run_sandboxed(argv: Sequence[str], *, cwd: str | os.PathLike, env: Mapping[str, str] | None = None,
                  limits: Limits = Limits(), stdin: bytes | None = None,
                  scratch: str | os.PathLike | None = None) -> SandboxResult:
    """Run ``argv`` sandboxed to completion (or its limits) and return capped output and the verdict."""
    with _open(argv, cwd, env, limits, scratch, stdin_pipe=stdin is not None, capture_stdout=True) as proc:
        if stdin is not None:
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        return proc.wait()


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except (OSError, ValueError):
        pass  # the child stopped reading (or ended): its exit status tells the story
    _close_quietly(pipe)
