"""Run untrusted submission code in a sandbox. Every process that executes student code starts here.

What the sandbox enforces, and where (docs/SECURITY.md has the threat model):

- a file system of its own: bubblewrap (``bwrap``) starts the child in new mount, pid, network,
  ipc, uts and cgroup namespaces, on a root that holds only the system's programs and libraries
  (``/usr`` and its links), a few files of ``/etc``, the Python install (``sys.prefix`` and
  ``sys.base_prefix``), all read-only, a ``/proc`` of its own pid namespace, a minimal ``/dev``,
  private ``/tmp`` and ``/dev/shm``, and the scratch copy: the only host path it can write and the
  only one holding course material. Other submissions, copies of the kit (the one the venv lives
  in included), hidden tests and solutions are simply not there, whatever their permissions. On
  GPU machines (``/dev/nvidia0`` exists) the NVIDIA devices and ``/sys`` (read-only) are added.
- no network: the network namespace holds only its own loopback, so multi-process gloo works
  and nothing outside the sandbox, the machine's own 127.0.0.1 included, can be reached.
- grader running as root: each run leases a uid from a pool (``ONENODE_SANDBOX_UIDS``, default
  60100-60163, no passwd entry); bwrap sets up as root and ``setpriv`` drops to that uid inside
  (no groups, no capabilities), so RLIMIT_NPROC caps the run's processes and the scratch copy is
  the only thing it owns. Not root: bwrap runs as the grader's user in a user namespace of its
  own, which may create no further ones.
- CPUs: ``Limits.cpus`` pins the child to a CPU set (``sched_setaffinity`` before exec) and, where
  a cgroup v2 with the cpu controller is delegated to the grader (``ONENODE_CGROUP``, or its own),
  caps it at that many CPUs' time (``cpu.max``, and ``cpuset.cpus`` where that controller is on)
  in a cgroup of its own, which the leased uid cannot leave or change. Without such a cgroup the
  affinity is all there is, and the child could widen it: ``capabilities()["cpu_quota"]`` says so.
- rlimits on CPU time, address space, processes, open files and file size; ``no_new_privs``;
  wall time, killing the whole pid namespace at the end and capped stdout/stderr are enforced
  from the grader process.
- evidence the grader reads from outside the child, never from what it reports: ``pids()``,
  ``network_bytes()``, ``peak_memory_bytes()``; ``pause()``/``resume()`` freeze it.

Without a bwrap that works here the sandbox refuses to run anything (``SandboxError`` says what
to install) unless ``ONENODE_UNSAFE_NO_SANDBOX=1`` is set, which runs submission code with only
the rlimits, the uid and the kill at the end, and says so loudly.

Two entry points: ``run_sandboxed`` (run to completion, capture output) and ``spawn_sandboxed``
(pipes for the timed harness). The child's environment is built from an allow-list
(``sandbox_env``), never copied from the grader.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import json
import math
import os
import pwd
import resource
import select
import shutil
import signal
import stat
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

from .meters import gpu_memory_by_pid

__all__ = [
    "Limits", "SandboxResult", "SandboxedProcess", "SandboxError", "ProcessMemory", "run_sandboxed",
    "spawn_sandboxed", "sandbox_env", "make_private", "make_scratch", "capabilities", "UNSAFE_ENV",
]

MIB = 1 << 20
BWRAP = "bwrap"  # looked up on the grader's PATH (Debian/Ubuntu: apt-get install bubblewrap)
SETPRIV = "setpriv"  # util-linux: drops to the leased uid inside the sandbox when the grader is root
UNSAFE_ENV = "ONENODE_UNSAFE_NO_SANDBOX"  # "1": run submission code without bubblewrap (never for grading)
CGROUP_ENV = "ONENODE_CGROUP"  # a cgroup v2 directory delegated to the grader, for the children's CPU quota
REQUIRE_ENV = "ONENODE_REQUIRE_SANDBOX"  # "1" (CI): a child whose ranks cannot be isolated is refused, not warned of
LANDLOCK_SCOPES_ABI = 6  # Landlock's scopes (abstract unix sockets, signals): Linux 6.12
CPU_PERIOD_US = 100_000
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
# What of /etc the child sees: users and groups by number, name resolution of localhost, the
# dynamic linker's cache, time zone, certificates, Debian's alternatives links. Nothing else:
# pip.conf, gitconfig, npmrc and friends may hold tokens.
_ETC = ("passwd", "group", "nsswitch.conf", "hosts", "host.conf", "resolv.conf", "gai.conf", "ld.so.cache",
        "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "alternatives", "ssl", "ca-certificates",
        "mime.types", "os-release")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SIGNALS = {s.value for s in signal.Signals}
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
    ``fsize_mb`` also sizes the private /tmp and /dev/shm (tmpfs, in memory).
    ``cpus``: the CPUs the child runs on, and (with a cgroup, `cpu_cgroup_parent`) its CPU quota.
    ``user_namespaces``: the child may create user namespaces, for a child whose every process
    that runs untrusted code first closes its own (the ranks of an A1 child of several, where
    `rank_isolation()` has namespaces: grader/a1/confine.py).
    """

    wall_s: float = 600.0
    cpu_s: float | None = 600.0
    memory_mb: int | None = 8192
    nproc: int | None = 512
    nofile: int | None = 1024
    fsize_mb: int | None = 1024
    output_kb: int = 256
    network: bool = False
    cpus: tuple[int, ...] | None = None
    user_namespaces: bool = False

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "nproc", "nofile", "fsize_mb", "output_kb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"Limits.{name}={value}: must be positive (None lifts a limit)")
        if self.cpus is not None and not (self.cpus and set(self.cpus) <= os.sched_getaffinity(0)):
            raise ValueError(f"Limits.cpus={self.cpus}: give CPUs the grader itself may run on "
                             f"({sorted(os.sched_getaffinity(0))})")
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
    filesystem_isolated: bool = False  # bubblewrap built the child's file system (False only when unsafe)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


@dataclass(frozen=True)
class ProcessMemory:
    """The most memory the grader saw one sandboxed process hold: resident set (VmHWM, bytes) and,
    where nvidia-smi exists, GPU memory (bytes; None without nvidia-smi)."""

    rss: int
    gpu: int | None


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


def _unsafe_allowed() -> bool:
    return os.environ.get(UNSAFE_ENV) == "1"


def _gpu_machine() -> bool:
    return os.path.exists("/dev/nvidia0")


@cache
def _sandbox_problem() -> str | None:
    """Why bubblewrap cannot build the sandbox on this machine (one line saying what to install or
    check), or None when it can: probed once with a throwaway sandbox running ``true``."""
    bwrap = shutil.which(BWRAP)
    if bwrap is None:
        return "bubblewrap is not installed: apt-get install bubblewrap"
    if _is_root() and shutil.which(SETPRIV) is None:
        return "setpriv is not installed: apt-get install util-linux"
    tree = _Tree()
    tree.system()
    # The child runs bwrap (and, as root, setpriv) again inside the sandbox: they must be where it
    # can see them (the system folders; its /tmp is its own), not only where the grader can.
    inner = [bwrap, *([shutil.which(SETPRIV)] if _is_root() else [])]
    for program in inner:
        try:
            probe = subprocess.run([bwrap, *_namespace_args(network=False), *tree.args, "--", program, "--version"],
                                   timeout=60, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        except (OSError, subprocess.SubprocessError) as e:
            return f"bubblewrap cannot start here ({e})"
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
            if "execvp" in last:
                return (f"{program} is not visible inside the sandbox, which sees only the system folders (its /tmp "
                        "is its own): install it with the system's packages (apt-get install bubblewrap util-linux)")
            return f"bubblewrap cannot build a sandbox here ({last})"
    return None


@cache
def cpu_cgroup_parent() -> Path | None:
    """The cgroup v2 directory the children's CPU cgroups are made in: ``ONENODE_CGROUP`` or the
    grader's own cgroup, if the cpu controller is enabled for its children and the grader may
    write there; None otherwise (then only the affinity pins a child)."""
    if CGROUP_ENV in os.environ:
        candidate = Path(os.environ[CGROUP_ENV])
    else:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
            own = next(line[3:] for line in lines if line.startswith("0::"))
        except (OSError, StopIteration):
            return None
        candidate = Path("/sys/fs/cgroup") / own.lstrip("/")
    try:
        enabled = (candidate / "cgroup.subtree_control").read_text().split()
    except OSError:
        return None
    return candidate if "cpu" in enabled and os.access(candidate, os.W_OK) else None


def _make_cpu_cgroup(cpus: tuple[int, ...]) -> Path | None:
    """A cgroup of one child's own under `cpu_cgroup_parent()`, capped at len(cpus) CPUs' time
    (and to those CPUs where cpuset is on); None where there is no such parent."""
    parent = cpu_cgroup_parent()
    if parent is None:
        return None
    group = Path(tempfile.mkdtemp(prefix="onenode-", dir=parent))
    (group / "cpu.max").write_text(f"{len(cpus) * CPU_PERIOD_US} {CPU_PERIOD_US}\n")
    if (group / "cpuset.cpus").exists():
        (group / "cpuset.cpus").write_text(",".join(map(str, cpus)) + "\n")
    return group


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is off or missing."""
    version = _libc().syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset(VERSION)
    return max(version, 0)


def rank_isolation() -> dict[str, bool]:
    """What each rank of a child of several (the A1 harness's) can shut itself off from the others
    with, here (grader/a1/confine.py): namespaces of its own where the sandbox's children may open
    a user namespace, Landlock's scopes where the kernel has them. Seccomp it always can."""
    return {"namespaces": _user_namespaces_openable(), "landlock": landlock_abi() >= LANDLOCK_SCOPES_ABI}


def _rank_isolation_gaps(isolation: dict[str, bool]) -> list[str]:
    """What the ranks of one child can share unseen where part of `rank_isolation()` is missing."""
    gaps = []
    if not isolation["namespaces"]:
        gaps.append("the sandbox's children cannot open a user namespace here, so the ranks of one A1 child share "
                    "/tmp, /dev/shm, the scratch folder and System V IPC, unseen by the traffic count; allow "
                    "unprivileged user namespaces (Ubuntu 24.04: "
                    "sysctl kernel.apparmor_restrict_unprivileged_userns=0)")
    if not isolation["landlock"]:
        gaps.append(f"the kernel offers Landlock ABI {landlock_abi()}, not {LANDLOCK_SCOPES_ABI}, so the ranks of one "
                    "A1 child may read each other's memory, signal each other and meet on abstract unix sockets, "
                    "unseen by the traffic count; grade on Linux 6.12 or later")
    return gaps


def isolated_ranks() -> dict[str, bool]:
    """`rank_isolation()`, for a child of several ranks about to start. A missing part is recorded
    (`capabilities()`, env.json) and warned of once; with ``ONENODE_REQUIRE_SANDBOX=1`` (CI) it is
    refused instead (SandboxError, one line saying what the machine needs)."""
    isolation = rank_isolation()
    gaps = _rank_isolation_gaps(isolation)
    if gaps and os.environ.get(REQUIRE_ENV) == "1":
        raise SandboxError(f"{REQUIRE_ENV}=1 and the ranks of a child cannot be isolated here: {'; '.join(gaps)}")
    return isolation


def capabilities() -> dict[str, object]:
    """Which guarantees hold on this machine (docs/SECURITY.md); the grader records it in env.json."""
    root, problem = _is_root(), _sandbox_problem()
    isolated = problem is None
    return {
        "sandbox_problem": problem,
        "unsafe_no_sandbox": not isolated and _unsafe_allowed(),
        "filesystem_isolated": isolated,
        "network_namespace": isolated,
        "pid_namespace": isolated,
        "user_namespaces_closed": isolated and (not root or _user_namespaces_closable()),
        "separate_uid": root,
        "uid_pool": f"{_uid_pool().start}-{_uid_pool().stop - 1}" if root else None,
        "private_dirs": isolated or root,
        "kill_escaped_daemons": isolated or root,
        "gpu_devices": sorted(glob.glob("/dev/nvidia*")) if isolated and _gpu_machine() else [],
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
        "cpu_quota": cpu_cgroup_parent() is not None,
        "landlock_abi": landlock_abi(),
        "rank_isolation": rank_isolation(),
    }


def _require_sandbox() -> bool:
    """True when bubblewrap isolates the child; False when the operator chose to run unsandboxed.
    Otherwise refuse: grading untrusted code without the sandbox is never the default."""
    problem = _sandbox_problem()
    if problem is None:
        return True
    if not _unsafe_allowed():
        raise SandboxError(f"{problem}; the grader does not run submission code without its sandbox "
                           f"(set {UNSAFE_ENV}=1 to do so anyway on a machine of your own, never for grading)")
    return False


@cache
def _warn_about_gaps() -> None:
    gaps = []
    problem = _sandbox_problem()
    if problem is not None:
        gaps.append(f"{UNSAFE_ENV}=1 and {problem}: submission code runs WITHOUT a sandbox: it reads every "
                     "file the sandbox user can (other submissions, the kit, solutions), reaches the network, "
                     "and what it writes in /tmp stays; never grade a cohort like this")
    if not _is_root():
        gaps.append(f"the grader runs as uid {os.getuid()}, not root: submission code runs as that user "
                    "(RLIMIT_NPROC counts its other processes too); run the grader as root for a uid of its own")
    if cpu_cgroup_parent() is None:
        gaps.append(f"no cgroup v2 with the cpu controller for the grader ({CGROUP_ENV}): a child is pinned to its "
                    "CPUs by affinity alone, which it may widen; its CPU time is not capped")
    gaps += _rank_isolation_gaps(rank_isolation())
    if gaps:
        warnings.warn("sandbox: " + "; ".join(gaps), RuntimeWarning, stacklevel=4)


# ----------------------------------------------------------------------------- the child's file system


def _namespace_args(network: bool, user_namespaces: bool = False) -> list[str]:
    """bwrap's namespaces. As root, bwrap keeps only what it needs to enter the scratch (owned by
    the leased uid, 0700) and setpriv needs to drop to that uid, after which none is left;
    otherwise bwrap runs in a user namespace of its own, and the child may not create another
    (there it could hide processes and traffic from the grader's counters) unless
    ``user_namespaces`` (`Limits.user_namespaces`)."""
    args = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
            "--new-session"]
    if not network:
        args.append("--unshare-net")
    if _is_root():
        args += ["--cap-drop", "ALL"]
        for cap in ("CAP_DAC_READ_SEARCH", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
            args += ["--cap-add", cap]
    else:
        args += ["--unshare-user", *([] if user_namespaces else ["--disable-userns"])]
    return args


class _Tree:
    """bwrap arguments that build the child's root, one mount at a time, in order.

    Host paths keep their place. The directories bwrap creates on the way to a mount point are
    made 0755 (bwrap's own are 0700, which the leased uid could not pass through).
    """

    def __init__(self) -> None:
        self.args: list[str] = []
        self._bound: list[str] = []  # host trees bound in: directories inside them exist already
        self._made: set[str] = {"/"}

    def _covered(self, path: str) -> bool:
        return any(path == top or path.startswith(top.rstrip("/") + "/") for top in self._bound)

    def _parents(self, dest: str) -> None:
        for parent in reversed(Path(dest).parents):
            name = str(parent)
            if name not in self._made and not self._covered(name):
                self.args += ["--perms", "0755", "--dir", name]
                self._made.add(name)

    def bind(self, option: str, path: str) -> None:
        """``option`` (--ro-bind, --bind, --dev-bind, their -try forms) of ``path`` onto itself."""
        if option.endswith("-try") and not os.path.exists(path):
            return
        self._parents(path)
        self.args += [option, path, path]
        self._bound.append(path)

    def special(self, option: str, dest: str, *, perms: str | None = None, size_mb: int | None = None) -> None:
        """A fresh mount bwrap makes itself: --proc, --dev or --tmpfs."""
        self._parents(dest)
        if perms:
            self.args += ["--perms", perms]
        if size_mb:
            self.args += ["--size", str(size_mb * MIB)]
        self.args += [option, dest]
        self._made.add(dest)

    def system(self) -> None:
        """Programs and libraries (read-only), as the host lays them out (merged /usr or not)."""
        for top in _SYSTEM_DIRS:
            if os.path.islink(top):
                self.args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                self.bind("--ro-bind", top)
        for name in _ETC:
            self.bind("--ro-bind-try", f"/etc/{name}")

    def devices_and_temp(self, fsize_mb: int | None) -> None:
        """Its own /proc (pid namespace), a minimal /dev, private /tmp and /dev/shm (tmpfs, capped
        at ``fsize_mb``), CPU topology for torch; on GPU machines the NVIDIA devices and /sys."""
        self.special("--proc", "/proc")
        self.special("--dev", "/dev")
        self.special("--tmpfs", "/dev/shm", perms="1777", size_mb=fsize_mb)
        self.special("--tmpfs", "/tmp", perms="1777", size_mb=fsize_mb)
        if _gpu_machine():  # untested on CPU-only machines: docs/SECURITY.md
            for device in sorted(glob.glob("/dev/nvidia*")):  # nvidia0.., nvidiactl, nvidia-uvm, nvidia-caps/
                self.bind("--dev-bind", device)
            self.bind("--ro-bind", "/sys")  # NVML walks the PCI tree; /proc/driver/nvidia comes with /proc
            self.bind("--ro-bind-try", "/run/nvidia-persistenced")
        else:
            self.bind("--ro-bind-try", "/sys/devices/system/cpu")
            self.bind("--ro-bind-try", "/sys/devices/system/node")

    def interpreter(self) -> None:
        """The Python the grader runs (a venv and the base install it points to) and the directories
        of LD_LIBRARY_PATH (the grader's CUDA libraries, which sandbox_env passes on), read-only.
        Only these prefixes: a venv inside the kit brings nothing else of the kit, and the source
        its editable installs point to stays out (PYTHONPATH points at the scratch copy)."""
        prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
        for prefix in sorted(prefixes):
            if not self._covered(prefix):
                self.bind("--ro-bind", prefix)
        for directory in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):  # the grader's CUDA libraries
            if os.path.isabs(directory) and not self._covered(os.path.realpath(directory)):
                self.bind("--ro-bind-try", os.path.realpath(directory))


def _bwrap_argv(*, scratch: Path, cwd: Path, readable: Sequence[Path], limits: Limits, status_fd: int) -> list[str]:
    """The bwrap command line (up to its ``--``) that starts a child in ``cwd`` in a new root:
    system, devices, Python, ``readable`` (read-only), then ``scratch`` (the one writable place)."""
    tree = _Tree()
    tree.system()
    tree.devices_and_temp(limits.fsize_mb)
    tree.interpreter()
    for path in readable:
        tree.bind("--ro-bind", str(path))
    tree.bind("--bind", str(scratch))
    namespaces = _namespace_args(limits.network, limits.user_namespaces)
    return [shutil.which(BWRAP), *namespaces, "--json-status-fd", str(status_fd), *tree.args,
            "--chdir", str(cwd), "--"]


def _as_uid(uid: int, sandboxed: bool, user_namespaces: bool = False) -> list[str]:
    """What root runs before the command (inside the sandbox, bwrap does): setpriv becomes ``uid``
    for good (no groups, no capabilities, not even in the bounding set); then in the sandbox, where
    the kernel lets users create user namespaces, a second bwrap as that uid enters one that may
    create no other, so the child cannot rearrange its mounts or hide processes and traffic in
    namespaces of its own (unless ``user_namespaces``: then the child closes them itself)."""
    args = [shutil.which(SETPRIV), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--pdeathsig=KILL", "--"]
    if sandboxed and not user_namespaces and _user_namespaces_closable():
        args += [shutil.which(BWRAP), "--unshare-user", "--disable-userns", "--dev-bind", "/", "/", "--"]
    return args


@cache
def _user_namespaces_closable() -> bool:
    """Whether an unprivileged uid may enter a user namespace with further ones disabled (where it
    may not, the kernel refuses the child any user namespace anyway)."""
    nobody = "65534"
    try:
        return subprocess.run([shutil.which(SETPRIV), f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups", "--",
                               shutil.which(BWRAP), "--unshare-user", "--disable-userns", "--dev-bind", "/", "/", "--",
                               "true"], timeout=60, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@cache
def _user_namespaces_openable() -> bool:
    """Whether a child with `Limits.user_namespaces` may open a user namespace and mount in it, as
    the sandbox starts it (as the leased uid, or in bwrap's user namespace): a sysctl or AppArmor
    may refuse unprivileged users that."""
    outer = ([SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
              "--"] if _is_root() else [BWRAP, "--unshare-user", "--dev-bind", "/", "/", "--"])
    try:
        return subprocess.run([*outer, "unshare", "--user", "--map-root-user", "--mount", "--ipc", "true"], timeout=60,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# ----------------------------------------------------------------------------- files and directories


def make_private(path: str | os.PathLike) -> Path:
    """Make a grader-only directory (solutions, hidden tests, results): 0700, root-owned when root.
    The sandbox does not see it anyway; this keeps it private when the sandbox is off (unsafe)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if _is_root():
        os.chown(path, 0, 0)
    path.chmod(0o700)
    return path


def make_scratch(parent: str | os.PathLike | None = None) -> Path:
    """A fresh, empty scratch directory for one run (every ancestor traversable by the sandbox uid).

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


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def sandbox_env(scratch: str | os.PathLike) -> dict[str, str]:
    """The child's whole environment, from an allow-list: caches, HOME and TMPDIR inside the scratch.

    PYTHONPATH points at ``<scratch>/starter_code`` when the scratch holds a starter copy, so the
    patched ``onenode`` shadows any installed one. (bwrap adds PWD, the child's working directory.)
    """
    scratch = Path(scratch).resolve()
    cache_dir = scratch / ".cache"
    env = {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        "LANG": "C.UTF-8",
        "HOME": str(scratch / "home"),
        # The leased uid has no passwd entry: getpass.getuser() (torch.compile's cache names)
        # reads these first, and fails without them.
        "USER": "onenode-sandbox",
        "LOGNAME": "onenode-sandbox",
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


# ----------------------------------------------------------------------------- processes, from /proc


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _live_pids(uid: int | None = None, pgid: int | None = None) -> list[int]:
    """Pids of the live (not zombie) processes of ``uid`` or of process group ``pgid``, from /proc."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if pgid is None and entry.stat().st_uid != uid:
                continue
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = _stat_fields(int(entry.name))
        if fields and fields[0] not in "ZX" and (pgid is None or int(fields[2]) == pgid):
            pids.append(int(entry.name))
    return pids


def _descendants(ancestor: int) -> dict[int, str]:
    """Live descendants of ``ancestor`` -> their state letter, from one pass over /proc. Orphans
    are reparented inside the sandbox's pid namespace (to its init), so none leaves this tree."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))):
            states[int(entry.name)] = fields[0]
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = {}, list(children.get(ancestor, []))
    while todo:
        pid = todo.pop()
        if states[pid] not in "ZX":
            found[pid] = states[pid]
        todo += children.get(pid, [])
    return found


def _is_descendant(pid: int, ancestor: int) -> bool:
    for _ in range(4096):  # deeper than any real tree; a loop in a racing read ends here
        fields = _stat_fields(pid)
        if fields is None or pid <= 1:
            return False
        pid = int(fields[1])
        if pid == ancestor:
            return True
    return False


FREEZE_SETTLE_S = 0.01  # after every process shows stopped, before its CPU time is read
FREEZE_SLACK_MS = 1.0  # CPU a frozen child's cgroup may count between pause and resume (the pause's own edges)


def _cpu_used(pid: int) -> tuple[int, float] | None:
    """CPU a process has used: (utime + stime + cutime + cstime of /proc/<pid>/stat in clock ticks:
    its whole thread group, ended threads and reaped children included; its live threads'
    se.sum_exec_runtime in ms from /proc/<pid>/task/*/sched, exact, 0 where the kernel has no
    such file), None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # fields 14-17 of stat(5), counted from the state
    runtime = 0.0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                text = Path(task.path, "sched").read_text()
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            line = next((ln for ln in text.splitlines() if ln.startswith("se.sum_exec_runtime")), None)
            runtime += float(line.split(":")[1]) if line else 0.0
    except (FileNotFoundError, ProcessLookupError):
        return None
    return ticks, runtime


def _cgroup_usage(cgroup: Path | None) -> int | None:
    """The CPU microseconds a cgroup's processes have used (`cpu.stat` usage_usec), ended ones too;
    None without one."""
    if cgroup is None:
        return None
    try:
        line = next(ln for ln in (cgroup / "cpu.stat").read_text().splitlines() if ln.startswith("usage_usec"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1])


def _ran_while_frozen(frozen: dict[int, tuple[int, float] | None], live: dict[int, str]) -> str | None:
    """What of a tree frozen with CPU times `frozen` ran before the tree read `live` (pid ->
    state), in one line, or None."""
    born = sorted(set(live) - set(frozen))
    if born:
        return f"process {born[0]} started while the sandbox was frozen"
    awake = next((pid for pid, state in live.items() if state not in "tT"), None)
    if awake is not None:
        return f"process {awake} was running (state {live[awake]}) while the sandbox was frozen"
    for pid, before in frozen.items():
        after = _cpu_used(pid)
        if before is None:
            continue
        if after is None:
            return f"process {pid} ended while the sandbox was frozen"
        ticks, runtime = after[0] - before[0], after[1] - before[1]
        if ticks > 0 or runtime > 0:
            used = f"{runtime:.1f} ms" if runtime > 0 else f"{ticks} clock ticks"
            return f"process {pid} used {used} of CPU while the sandbox was frozen"
    return None


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return 0


def _bytes_sent(net_dev: str) -> int:
    """Transmitted bytes summed over the interfaces of a /proc/<pid>/net/dev table."""
    return sum(int(line.split(":", 1)[1].split()[8]) for line in net_dev.splitlines()[2:] if ":" in line)


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


def _wait_gpu_released(pids: set[int], timeout_s: float = 15.0) -> None:
    """On CUDA machines: wait until none of ``pids`` holds a GPU context (memory freed)."""
    if not pids or not shutil.which("nvidia-smi"):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pids & set(gpu_memory_by_pid()):
            return
        time.sleep(0.5)
    warnings.warn(f"sandbox: GPU contexts of killed pids {sorted(pids)} still listed by nvidia-smi "
                  f"after {timeout_s:g} s; the next submission may see less GPU memory", RuntimeWarning,
                  stacklevel=2)


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
            _kill_uid(uid)  # whatever a crashed grader left behind
            return
        raise SandboxError(f"all sandbox uids {_uid_pool().start}-{_uid_pool().stop - 1} are busy; "
                           "run fewer submissions at once or widen ONENODE_SANDBOX_UIDS")

    def release(self) -> None:
        _kill_uid(self.uid)
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
    The wall limit runs from the start, whether or not anyone is waiting (and while paused).

    ``pid`` is bwrap's (the grader's direct child); ``pids()`` are the processes inside. The
    evidence methods read /proc from the grader's side, so nothing the child says enters them.
    """

    def __init__(self, argv: Sequence[str], *, cwd: Path, scratch: Path, env: dict[str, str],
                 limits: Limits, stdin_pipe: bool, capture_stdout: bool, readable: Sequence[Path] = ()) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._killed_reason: str | None = None
        self._reaped = False
        self._wait_timeout: float | None = None
        self._buf = b""
        self._result: SandboxResult | None = None
        self._status_fd: int | None = None
        self._sent: dict[str, int] = {}  # network namespace -> bytes sent, the most read so far
        self._memory: dict[int, ProcessMemory] = {}
        self._cgroup: Path | None = None
        self._frozen: dict[int, tuple[int, float] | None] | None = None  # pid -> CPU used, from `pause`
        self._frozen_usage: int | None = None  # the cgroup's usage_usec at `pause`
        self.filesystem_isolated = _require_sandbox()
        self.network_isolated = self.filesystem_isolated and not limits.network
        _warn_about_gaps()
        self._lease = _UidLease() if _is_root() else None
        status_w = None
        try:
            self._cgroup = None if limits.cpus is None else _make_cpu_cgroup(limits.cpus)
            command = list(argv)
            if self._lease:
                _chown_tree(scratch, self._lease.uid, self._lease.uid)
                scratch.chmod(0o700)
                command = _as_uid(self._lease.uid, self.filesystem_isolated, limits.user_namespaces) + command
            if self.filesystem_isolated:
                self._status_fd, status_w = os.pipe()
                command = _bwrap_argv(scratch=scratch, cwd=cwd, readable=readable, limits=limits,
                                      status_fd=status_w) + command
            self._start = time.monotonic()
            self._popen = subprocess.Popen(
                command, cwd=cwd, env=env, close_fds=True, pass_fds=() if status_w is None else (status_w,),
                start_new_session=True, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=self._child_setup_fn())
        except BaseException as e:
            self._release(scratch)
            if self._status_fd is not None:
                os.close(self._status_fd)
            if isinstance(e, subprocess.SubprocessError):  # the child's setup failed before exec
                raise SandboxError(f"cannot start a sandboxed process here ({e}); see "
                                   "grader.sandbox.capabilities() and docs/SECURITY.md") from e
            raise
        finally:
            if status_w is not None:
                os.close(status_w)
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
        if self.filesystem_isolated:
            self._await_sandbox()

    def _child_setup_fn(self):
        limits, root = self.limits, self._lease is not None
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
            base = 0 if root else sum(_thread_count(pid) for pid in _live_pids(os.getuid()))
            rlimits.append((resource.RLIMIT_NPROC, base + limits.nproc))
        libc, grader_pid, cpus = _libc(), os.getpid(), limits.cpus
        procs = None if self._cgroup is None else str(self._cgroup / "cgroup.procs")

        def setup() -> None:  # runs in the child between fork and exec: no imports, no locks
            for which, value in rlimits:
                resource.setrlimit(which, value if isinstance(value, tuple) else (value, value))
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if procs is not None:  # into its own cgroup before anything of the child runs
                fd = os.open(procs, os.O_WRONLY)
                try:
                    os.write(fd, b"0\n")
                finally:
                    os.close(fd)
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            # If the grader dies (even by SIGKILL), so does bwrap, and with it the sandbox. The
            # parent is the *thread* that spawned: see spawn_sandboxed.
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != grader_pid:  # the grader died before the line above
                os.kill(os.getpid(), signal.SIGKILL)
            os.umask(0o077)

        return setup

    def _await_sandbox(self) -> None:
        """Wait until bwrap reports the sandbox's init started (its status line); if bwrap gave
        up before that, clean up and raise with its last words."""
        line, deadline = b"", time.monotonic() + 60
        while b"\n" not in line and select.select([self._status_fd], [], [], max(deadline - time.monotonic(), 0))[0]:
            chunk = os.read(self._status_fd, 4096)
            if not chunk:
                break
            line += chunk
        try:
            if "child-pid" in json.loads(line.partition(b"\n")[0] or b"{}"):
                return
        except ValueError:
            pass
        result = self.wait(timeout=5)
        said = (result.stderr.decode(errors="replace").strip().splitlines() or [result.reason])[-1]
        raise SandboxError(f"bubblewrap could not start the sandbox: {said}")

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

    # -- evidence, read from outside the child

    def pids(self) -> list[int]:
        """Host pids of the live processes inside the sandbox (its init included), from /proc:
        every descendant of bwrap, or without the sandbox, of the leader (as root: every process
        of the leased uid). Empty once the run has ended."""
        with self._lock:
            return sorted(self._live())

    def _live(self) -> dict[int, str]:
        """pid -> state letter of the sandbox's live processes; call with the lock held."""
        if self._reaped:
            return {}
        if self.filesystem_isolated:
            found = _descendants(self.pid)
        elif self._lease:
            found = {pid: fields[0] for pid in _live_pids(self._lease.uid) if (fields := _stat_fields(pid))}
        else:
            found = _descendants(self.pid)
            if (fields := _stat_fields(self.pid)) and fields[0] not in "ZX":
                found[self.pid] = fields[0]
        self._pids.update(found)
        return found

    def _signal(self, pid: int, sig: int) -> None:
        """Signal ``pid`` only if it is still the sandbox's: the pidfd pins the process, then its
        membership is checked again, so a pid reused by another process is never signalled."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            if self._lease and not self.filesystem_isolated:
                member = os.stat(f"/proc/{pid}").st_uid == self._lease.uid
            else:
                member = pid == self.pid or _is_descendant(pid, self.pid)
            if member:
                signal.pidfd_send_signal(fd, sig)
        except (FileNotFoundError, ProcessLookupError):
            pass
        finally:
            os.close(fd)

    def network_bytes(self) -> int | None:
        """Bytes sent over the sandbox's network: the transmit counters of every network namespace
        its live processes are in (its loopback; a byte sent there is received once more, not
        counted twice), read from /proc/<pid>/net/dev. Counters only grow: the most read so far
        per namespace is kept, so the total stays after the processes of a namespace end; read
        it while the child runs (the counters go with the namespace). None where the child
        shares the machine's network (``Limits.network`` or no sandbox): those are the machine's."""
        if not self.network_isolated:
            return None
        with self._lock:
            self._read_network()
            return sum(self._sent.values())

    def _read_network(self) -> None:
        read: set[str] = set()
        for pid in self._live():
            try:
                namespace = os.readlink(f"/proc/{pid}/ns/net")
                if namespace in read:
                    continue
                sent = _bytes_sent(Path(f"/proc/{pid}/net/dev").read_text())
                if os.readlink(f"/proc/{pid}/ns/net") != namespace:  # the pid went and came back
                    continue
            except (FileNotFoundError, ProcessLookupError):
                continue
            read.add(namespace)
            self._sent[namespace] = max(self._sent.get(namespace, 0), sent)

    def peak_memory_bytes(self) -> dict[int, ProcessMemory]:
        """host pid -> the most memory seen for each sandboxed process: peak resident set (VmHWM
        of /proc/<pid>/status) and, where nvidia-smi exists, the most GPU memory it listed for the
        pid. Processes that ended keep their last reading; one that started and ended between two
        calls is not seen."""
        on_gpu = gpu_memory_by_pid() if shutil.which("nvidia-smi") else None  # slow: outside the lock
        with self._lock:
            self._read_memory(on_gpu)
            return dict(self._memory)

    def _read_memory(self, on_gpu: dict[int, int] | None) -> None:
        for pid in self._live():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
            seen = self._memory.get(pid, ProcessMemory(0, None))
            gpu = seen.gpu if on_gpu is None else max(seen.gpu or 0, on_gpu.get(pid, 0))
            self._memory[pid] = ProcessMemory(max(seen.rss, hwm), gpu)

    def pause(self, timeout_s: float = 5.0) -> None:
        """Freeze every process of the sandbox (SIGSTOP) so the grader can time another child
        alone. Passes over /proc until all are stopped at once: a process forked, or resumed by a
        sibling, while the first pass ran is caught by the next. SandboxError after ``timeout_s``.
        Then it reads each process's CPU time, which `resume` reads again: a stop is only a state
        that a signal undoes (a timer's SIGCONT, say), so that it held is checked, not assumed."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while running := [pid for pid, state in self._live().items() if state not in "tT"]:
                if time.monotonic() > deadline:
                    raise SandboxError(f"could not freeze the sandbox within {timeout_s:g} s: {running} still run")
                for pid in running:
                    self._signal(pid, signal.SIGSTOP)
                time.sleep(0.002)
            time.sleep(FREEZE_SETTLE_S)  # the last context switches out of the stopped tasks are accounted
            self._frozen = {pid: _cpu_used(pid) for pid in self._live()}
            self._frozen_usage = _cgroup_usage(self._cgroup)

    def resume(self) -> str | None:
        """Let every process of the sandbox run again (SIGCONT). Returns None if it stayed frozen
        since `pause`, else what ran meanwhile, in one line: a process that used CPU (`_cpu_used`
        grew), left the stopped state, was forked or ended (a stopped process cannot end: a burner
        woken by a timer that exits, reaped by the kernel, before `resume` looks), or, where the child
        has a cgroup, any CPU the cgroup counted (`cpu.stat`: the processes that came and went too)."""
        with self._lock:
            live, frozen, self._frozen = self._live(), self._frozen, None
            ran = None if frozen is None else _ran_while_frozen(frozen, live)
            usage = _cgroup_usage(self._cgroup)
            if ran is None and frozen is not None and None not in (usage, self._frozen_usage) \
                    and usage - self._frozen_usage > FREEZE_SLACK_MS * 1000:
                ran = f"its cgroup used {(usage - self._frozen_usage) / 1000:.1f} ms of CPU while it was frozen"
            for pid in live:
                self._signal(pid, signal.SIGCONT)
            return ran

    # -- the end

    def kill(self, reason: str = "grader") -> None:
        """Kill the whole tree now: the sandbox's pid namespace (its init), the session's process
        group, and as root every process of the uid."""
        with self._lock:
            if self._reaped:
                return
            if self._killed_reason is None and not self._leader_exited():
                self._killed_reason = reason
            self._kill_tree()

    def _leader_exited(self) -> bool:
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def _kill_tree(self) -> None:
        if self.network_isolated:  # the last counters, before the namespace goes
            self._read_network()
        self._read_memory(on_gpu=None)
        for _ in range(100):  # SIGKILL lands asynchronously: wait until the tree is really gone
            live = self._live()
            if not live:
                break
            for pid in live:  # inside bwrap, killing its init takes the whole pid namespace along
                self._signal(pid, signal.SIGKILL)
            time.sleep(0.01)
        try:
            os.killpg(self.pgid, signal.SIGKILL)  # the leader is not reaped yet: the pgid is still ours
        except ProcessLookupError:
            pass
        if self._lease:
            _kill_uid(self._lease.uid)

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
        with self._lock:  # grandchildren outlive the leader: kill them before reaping it
            self._watchdog.cancel()
            self._kill_tree()
            _, status, usage = os.wait4(self.pid, 0)
            self._reaped = True
        returncode = os.waitstatus_to_exitcode(status)
        if self.filesystem_isolated and returncode - 128 in _SIGNALS:  # bwrap reports death by signal N as 128+N
            returncode = 128 - returncode
        self._popen.returncode = returncode
        return self._finish(usage.ru_utime + usage.ru_stime)

    def _finish(self, cpu_used: float) -> SandboxResult:
        wall = time.monotonic() - self._start
        stderr = self._stderr.collect()
        stdout = self._stdout.collect() if self._stdout else b""
        os.close(self._pidfd)
        if self._status_fd is not None:
            os.close(self._status_fd)
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
            network_isolated=self.network_isolated, reason=reason, filesystem_isolated=self.filesystem_isolated)
        _wait_gpu_released(self._pids)
        return self._result

    def _release(self, scratch: Path) -> None:
        """Hand the scratch back to root (the uid may serve another submission next), free the uid,
        remove the child's cgroup (empty once its processes are gone)."""
        if self._cgroup is not None:
            try:
                self._cgroup.rmdir()
            except OSError as e:
                warnings.warn(f"sandbox: could not remove the child's cgroup {self._cgroup} ({e})", RuntimeWarning,
                              stacklevel=2)
            self._cgroup = None
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


def _open(argv, cwd, env, limits, scratch, readable, *, stdin_pipe: bool, capture_stdout: bool) -> SandboxedProcess:
    cwd = Path(cwd).resolve()
    scratch = Path(scratch).resolve() if scratch else cwd
    if not scratch.is_dir():
        raise SandboxError(f"scratch directory {scratch} does not exist; create it with make_scratch()")
    if not cwd.is_relative_to(scratch):
        raise SandboxError(f"cwd {cwd} is outside the scratch copy {scratch}: the child sees only the scratch")
    readable = [Path(os.path.realpath(p)) for p in readable]
    for path in readable:
        if not path.exists():
            raise SandboxError(f"readable path {path} does not exist")
    for sub in ("home", "tmp"):
        (scratch / sub).mkdir(exist_ok=True)
    return SandboxedProcess(argv, cwd=cwd, scratch=scratch, env={**sandbox_env(scratch), **(env or {})},
                            limits=limits, stdin_pipe=stdin_pipe, capture_stdout=capture_stdout, readable=readable)


def spawn_sandboxed(argv: Sequence[str], *, cwd: str | os.PathLike, env: Mapping[str, str] | None = None,
                    limits: Limits = Limits(), scratch: str | os.PathLike | None = None,
                    readable: Sequence[str | os.PathLike] = ()) -> SandboxedProcess:
    """Start ``argv`` sandboxed with stdin/stdout pipes (the interactive form for the harness).

    ``scratch`` (default: ``cwd``, which must lie inside it) is the only host directory the child
    sees writable; ``readable`` adds host paths it may read (bound read-only, e.g. a model cache:
    never the kit, solutions or submissions). ``env`` adds variables on top of
    ``sandbox_env(scratch)`` (never pass ``os.environ``). The child is killed when the thread that
    spawned it ends, so spawn from a thread that lives as long as the process.
    """
    return _open(argv, cwd, env, limits, scratch, readable, stdin_pipe=True, capture_stdout=False)


def run_sandboxed(argv: Sequence[str], *, cwd: str | os.PathLike, env: Mapping[str, str] | None = None,
                  limits: Limits = Limits(), stdin: bytes | None = None,
                  scratch: str | os.PathLike | None = None,
                  readable: Sequence[str | os.PathLike] = ()) -> SandboxResult:
    """Run ``argv`` sandboxed to completion (or its limits) and return capped output and the verdict."""
    with _open(argv, cwd, env, limits, scratch, readable, stdin_pipe=stdin is not None,
               capture_stdout=True) as proc:
        if stdin is not None:
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        return proc.wait()


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except (OSError, ValueError):
        pass  # the child stopped reading (or ended): its exit status tells the story
    _close_quietly(pipe)
