"""Confine one rank of the harness before the submission's code runs in it (inside the sandbox).

The ranks of a child share its sandbox: one /tmp, /dev/shm, scratch folder, IPC namespace, uid
and network namespace. The grader counts the traffic of that network namespace, so whatever else
two ranks both reach would let them exchange data unseen. Each rank shuts itself off from the
others, for good (nothing the submission does later can lift it), before it imports the
submission (`confine_rank`):

- namespaces of its own (user, mount, IPC): every mount of the sandbox is read-only to it but its
  own folder (HOME, TMPDIR and the caches point there) and a private /dev/shm; the ranks' folder
  shows only its own; System V objects and POSIX queues are its own. Then it may create no user
  namespace (the sandbox closes them for every other child; a rank closes its own here) and drops
  every capability, so it cannot undo a mount.
- Landlock (ABI 6, Linux 6.12): it reads no other process's /proc entries, traces or reads the
  memory (/proc/<pid>/mem) of no process outside its own domain (the other ranks', the
  harness's), connects to no abstract unix socket and signals no process outside it.
- seccomp: no kernel key (the session keyring is shared), no System V or POSIX IPC object, no
  netlink socket but NETLINK_ROUTE's (NETLINK_USERSOCK passes messages within a network namespace).

Where the machine lacks a part (the sandbox's children may open no user namespace; Landlock below
ABI 6), the grader records it in env.json and warns (`grader.sandbox.rank_isolation`), and each
rank applies the others; with ONENODE_REQUIRE_SANDBOX=1 the grader refuses such a child instead.
A child of one rank has no other to shut it off from: it applies none.

Left to the ranks: the network namespace (TCP and UDP on its loopback, which the grader counts)
and their pipes to the harness (which reads JSON only and passes nothing from one rank to
another). On GPUs, NCCL would share /dev/shm (its SHM transport) and pass CUDA memory handles
over abstract unix sockets (cuMem): `NCCL_ENV` turns both off, so ranks use P2P (NVLink, counted)
with CUDA IPC handles sent through the bootstrap's TCP.

Self-contained (copied beside the harness): imports nothing from `grader`.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

NCCL_ENV = {"NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}

_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
_ST_RELATIME = 4096  # statvfs reports relatime here, mount(2) takes _MS_RELATIME
_KEPT_FLAGS = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME  # a remount must keep them
_PSEUDO = {"proc", "sysfs"}  # per-process or read-only already: left as they are
_CAPSET = {"x86_64": 126, "aarch64": 91}
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on every architecture
_CREATE_RULESET_VERSION, _RULE_PATH_BENEATH = 1, 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_READ = _READ_FILE | _READ_DIR

# seccomp: (AUDIT_ARCH, socket(2), system calls refused with EPERM); other architectures' calls are refused.
_SECCOMP = {
    "x86_64": (0xC000003E, 41, {"shmget": 29, "semget": 64, "msgget": 68, "mq_open": 240, "add_key": 248,
                                "request_key": 249, "keyctl": 250}),
    "aarch64": (0xC00000B7, 198, {"mq_open": 180, "msgget": 186, "semget": 190, "shmget": 194, "add_key": 217,
                                  "request_key": 218, "keyctl": 219}),
}
_AF_NETLINK, _NETLINK_ROUTE = 16, 0  # NETLINK_USERSOCK lets any two processes of a network namespace talk
_X32_BIT = 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_EPERM = 1


class ConfineError(RuntimeError):
    """The kernel refused a step of the confinement: the rank must not run the submission."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        raise ConfineError(f"{what}: {os.strerror(ctypes.get_errno())}")
    return result


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is off or missing."""
    version = _libc().syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(version, 0)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _kept(point: str) -> int:
    """The flags a remount of `point` must keep (nosuid, nodev, noexec, atime: locked in a user namespace)."""
    flags = os.statvfs(point).f_flag
    return (flags & _KEPT_FLAGS) | (_MS_RELATIME if flags & _ST_RELATIME else 0)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount this process sees, parents first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \\040 for a space, and so on
            found.append((point, fields[fields.index("-") + 1]))
    return found


def _namespaces(own: str, ranks_dir: str, shm_mb: int | None) -> None:
    """User, mount and IPC namespaces of this process's own: every mount read-only but `own` and a
    private /dev/shm, `ranks_dir` showing `own` alone; then no further user namespace and no
    capability left."""
    libc, uid, gid = _libc(), os.getuid(), os.getgid()
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWIPC), "unshare (a user namespace of its own)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")

    def mount(source, target, fstype, flags, data=None):
        encoded = [x and x.encode() for x in (source, target, fstype)]
        _check(libc.mount(*encoded, ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")

    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    own_fd = os.open(own, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # a bind's source: of this namespace
    for point, fstype in _mounts():
        if fstype in _PSEUDO or not os.path.isdir(point):
            continue
        if not os.statvfs(point).f_flag & _MS_RDONLY:
            mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _kept(point))
    size = f",size={shm_mb}m" if shm_mb else ""
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777{size}")
    mount("tmpfs", ranks_dir, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    os.mkdir(own)
    mount(f"/proc/self/fd/{own_fd}", own, None, _MS_BIND)
    os.close(own_fd)
    mount(None, own, None, _MS_REMOUNT | _MS_BIND | _kept(own))  # a bind keeps its source's read-only flag
    _write("/proc/sys/user/max_user_namespaces", "0")
    machine = platform.machine()
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(libc.syscall(_CAPSET[machine], header, bytes(24)), "capset (dropping every capability)")
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")


def _landlock() -> None:
    """A Landlock domain of this process's own: it reads only its own and no other process's /proc
    entries; no ptrace, abstract unix socket or signal reaches outside it."""
    abi = landlock_abi()
    if abi < 6:
        raise ConfineError(f"this kernel offers Landlock ABI {abi}; the ranks' isolation needs ABI 6 (Linux 6.12)")
    libc = _libc()
    attr = struct.pack("=QQQ", _READ, 0, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
    ruleset = _check(libc.syscall(_SYS_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
                     "landlock_create_ruleset")
    readable = [os.path.join("/", name) for name in os.listdir("/") if name != "proc"]
    readable += [os.path.join("/proc", name) for name in os.listdir("/proc")
                 if not name.isdigit() or name == str(os.getpid())]
    try:
        for path in readable:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since it was listed, or a dangling link: nothing to read there
            try:
                rights = _READ if os.path.isdir(f"/proc/self/fd/{fd}") else _READ_FILE
                _check(libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, struct.pack("=Qi", rights, fd), 0),
                       f"landlock rule for {path}")
            finally:
                os.close(fd)
        _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def _seccomp() -> None:
    """A BPF filter refusing (EPERM) `_SECCOMP`'s system calls, netlink sockets but NETLINK_ROUTE's
    (interface addresses, for gloo), and every call of a foreign ABI."""
    machine = platform.machine()
    arch, socket_call, calls = _SECCOMP[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    nr, arch_at, arg0, arg2 = 0, 4, 16, 32  # offsets in struct seccomp_data (the low half of an argument)
    # (code, jump if true, jump if false, k): a jump names its target ("allow", "deny") or goes to the next
    program = [(ld, None, None, arch_at), (jeq, None, "deny", arch), (ld, None, None, nr)]
    if machine == "x86_64":
        program.append((jge, "deny", None, _X32_BIT))  # x32 calls
    program += [(jeq, "deny", None, number) for number in sorted(calls.values())]
    program += [(jeq, None, "allow", socket_call), (ld, None, None, arg0), (jeq, None, "allow", _AF_NETLINK),
                (ld, None, None, arg2), (jeq, "allow", "deny", _NETLINK_ROUTE)]
    targets = {"allow": len(program), "deny": len(program) + 1}
    code = [struct.pack("=HBBI", op, targets.get(jt, i + 1) - i - 1, targets.get(jf, i + 1) - i - 1, k)
            for i, (op, jt, jf, k) in enumerate(program)]
    code += [struct.pack("=HBBI", ret, 0, 0, 0x7FFF0000),  # allow: SECCOMP_RET_ALLOW
             struct.pack("=HBBI", ret, 0, 0, 0x00050000 | _EPERM)]  # deny: SECCOMP_RET_ERRNO
    filters = ctypes.create_string_buffer(b"".join(code))
    fprog = struct.pack("@HP", len(code), ctypes.addressof(filters))  # struct sock_fprog
    libc = _libc()
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")


def confine_rank(rank: int, ranks_dir: str, cuda: bool, namespaces: bool = True, landlock: bool = True,
                 shm_mb: int | None = None) -> str:
    """Give this process (rank `rank`, single-threaded, before it imports the submission) a folder
    of its own under `ranks_dir`, point HOME, TMPDIR and the caches there, and shut it off from the
    other ranks and the harness for good: by its namespaces and Landlock where the grader found
    the machine has them (`grader.sandbox.rank_isolation`, which records and warns of a missing
    one), and seccomp always. Returns the folder. Raises ConfineError where the kernel refuses a
    part (the rank must then not run the submission)."""
    if platform.machine() not in _SECCOMP:
        raise ConfineError(f"the ranks' isolation knows x86_64 and aarch64, not {platform.machine()}")
    own = os.path.join(ranks_dir, str(rank))
    os.makedirs(own, mode=0o700, exist_ok=True)
    scratch = os.path.dirname(os.path.realpath(ranks_dir))
    for name, value in list(os.environ.items()):
        if name != "PYTHONPATH" and value.startswith(scratch + os.sep):
            os.environ[name] = os.path.join(own, os.path.relpath(value, scratch))
            if os.path.isdir(value):
                os.makedirs(os.environ[name], exist_ok=True)
    os.environ["TMPDIR"] = os.path.join(own, "tmp")
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    os.environ.update(NCCL_ENV if cuda else {})
    if namespaces:
        try:
            _namespaces(own, ranks_dir, shm_mb)
        except OSError as e:
            raise ConfineError(f"{e}") from e
    if landlock:
        _landlock()
    _seccomp()
    return own
