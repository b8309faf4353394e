"""Adversarial A1 submissions, each a small generator over the kit's own files (never a copy).

A case builds its submission (folder or archive) under a destination folder and says what the
grader must make of it:

- ``rejected``: refused at intake, every part 0, the one-line reason matching ``reason``;
- ``zero``: graded, the part ``part`` scores 0 and its feedback matches ``reason``.

``runs`` marks the cases that execute submission code (they need the harness and a reference run).
"""

from __future__ import annotations

import difflib
import io
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STARTER = "starter_code/onenode"


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path, Path], Path]  # (kit root, destination folder) -> submission path
    expect: str  # "rejected" or "zero"
    reason: str  # regex over the reason (rejected) or the part's feedback (zero)
    part: str | None = None
    runs: bool = False


# --------------------------------------------------------------------------- patch text


def diff(kit: Path, path: str, new_text: str | None) -> str:
    """A `git diff`-style patch turning kit/``path`` into ``new_text`` (None deletes the file)."""
    old = (kit / path).read_text().splitlines(keepends=True)
    new = (new_text or "").splitlines(keepends=True)
    head = [f"diff --git a/{path} b/{path}\n"]
    if new_text is None:
        head.append("deleted file mode 100644\n")
    body = difflib.unified_diff(old, new, f"a/{path}", "/dev/null" if new_text is None else f"b/{path}")
    return "".join(head) + "".join(body)


def append_to(kit: Path, path: str, code: str) -> str:
    """A patch that appends ``code`` to a kit file: how each cheat and payload below gets in."""
    return diff(kit, path, (kit / path).read_text() + "\n" + code.strip() + "\n")


# What the patches below would plant in the kit's own files if the grader let them through.
PAYLOADS = {"grader/a1/scoring.py": "STEPS.clear()", "a1_infra/rubric.toml": "[parts.bonus]",
            "tests/conftest.py": "collect_ignore = ['.']", "grader/a1/rubric.py": "RUBRIC_PATH = None"}


def plant(kit: Path, path: str) -> str:
    return append_to(kit, path, PAYLOADS[path])


def folder(dest: Path, name: str, patch: str | bytes) -> Path:
    """A submission folder with the patch alone (no case here attacks the report notebook)."""
    sub = dest / name
    sub.mkdir(parents=True)
    (sub / "submission.patch").write_bytes(patch.encode() if isinstance(patch, str) else patch)
    return sub


def _patch_case(name: str, make: Callable[[Path], str | bytes], reason: str) -> Case:
    return Case(name, lambda kit, dest: folder(dest, name, make(kit)), "rejected", reason)


# --------------------------------------------------------------------------- archives


def _tar(dest: Path, name: str, members: list[tarfile.TarInfo | tuple[str, bytes]]) -> Path:
    path = dest / f"{name}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tf.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tf.addfile(info, io.BytesIO(member[1]))
    return path


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def traversal_tar(kit: Path, dest: Path) -> Path:
    return _tar(dest, "traversal", [("submission.patch", b""), ("../escaped.py", b"print('out of the box')\n")])


def absolute_member_tar(kit: Path, dest: Path) -> Path:
    return _tar(dest, "absolute-member", [("submission.patch", b""), (str(dest / "planted.py"), b"x = 1\n")])


def symlink_tar(kit: Path, dest: Path) -> Path:
    """submission.patch as a link to the reference solution: the grader would read it for us."""
    return _tar(dest, "symlink-member", [_symlink("submission.patch", str(kit / "solutions/a1/submission.patch"))])


def symlink_zip(kit: Path, dest: Path) -> Path:
    path = dest / "symlink-zip.zip"
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo("report.ipynb")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/etc/shadow")
        zf.writestr("submission.patch", "")
    return path


def zip_bomb(kit: Path, dest: Path) -> Path:
    """A few hundred KiB that inflate past the grader's unpack limit (zeros compress ~1000x)."""
    from grader.submission import MAX_UNPACKED_BYTES

    path = dest / "zip-bomb.zip"
    zero_mib = bytes(1 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("submission.patch", "")
        with zf.open("report.ipynb", "w", force_zip64=True) as member:
            for _ in range((MAX_UNPACKED_BYTES >> 20) + 8):
                member.write(zero_mib)
    return path


def huge_archive(kit: Path, dest: Path) -> Path:
    """An archive over the size limit (sparse: costs no disk)."""
    from grader.submission import MAX_ARCHIVE_BYTES

    path = dest / "huge.tar.gz"
    with open(path, "wb") as f:
        f.truncate(MAX_ARCHIVE_BYTES + 1)
    return path


def too_many_members(kit: Path, dest: Path) -> Path:
    from grader.submission import MAX_MEMBERS

    path = dest / "many-members.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for i in range(MAX_MEMBERS + 1):
            zf.writestr(f"f{i}.txt", "")
    return path


def corrupt_archive(kit: Path, dest: Path) -> Path:
    path = dest / "corrupt.zip"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    return path


# --------------------------------------------------------------------------- cheats that run

TIMER_CHEAT = """
import time as _time
_real_perf_counter, _real_time, _real_monotonic = _time.perf_counter, _time.time, _time.monotonic
_time.perf_counter = lambda: _real_perf_counter() / 1000  # every step "takes" a thousandth
_time.time = lambda: _real_time() / 1000
_time.monotonic = lambda: _real_monotonic() / 1000
"""

# Slower than the starter for real, so only a patched clock could make it look fast: the outcome
# does not hang on timing noise between two equally fast trees.
SLOW_MOE = """
import time as _time
_honest_forward, _real_sleep = MoE.forward, _time.sleep


def _slow(self, x):
    _real_sleep(0.05)
    return _honest_forward(self, x)


MoE.forward = _slow
"""

# Finds the kit through the interpreter it runs on (the venv inside the checkout) and reads the
# reference fix; only if it can, it crashes loudly. Slow for real, like SLOW_MOE, otherwise.
READ_SOLUTION = """
import sys as _sys
from pathlib import Path as _Path

for _kit in {_Path(_sys.prefix).parent, _Path(_sys.executable).resolve().parents[2]}:
    try:
        (_kit / "solutions" / "a1" / "submission.patch").read_bytes()
    except OSError:
        continue
    raise RuntimeError(f"LEAKED the reference solution from {_kit}")
"""

# The red team's submission of issue 17: at import, it walks the file system from its own module
# upward and from the usual roots, reads every file that looks like course material (a
# submission, a notebook, a solution, a hidden test) outside its own scratch copy and the Python
# install, and echoes it into the log the grader keeps. Only if it read one, it crashes loudly (so
# the feedback says so); otherwise it is slow for real, like SLOW_MOE. It runs in every process that
# imports onenode: the harness's ranks.
READ_COHORT = """
import os as _os
import sys as _sys
import time as _time


def _looks_like_course_material(path):
    name = _os.path.basename(path)
    return (name == "submission.patch" or name.endswith(".ipynb") or "/solutions/" in path
            or "/assignments/source/" in path)


def _walk_the_cohort(budget_s=60.0):
    own = _os.path.realpath(_os.path.join(_os.path.dirname(__file__), "..", ".."))  # the scratch copy
    allowed = tuple(_os.path.realpath(p).rstrip("/") + "/" for p in {own, _sys.prefix, _sys.base_prefix})
    upward = [_os.path.dirname(own)]
    while upward[-1] != "/":
        upward.append(_os.path.dirname(upward[-1]))
    seen, leaked, deadline = {"/proc", "/sys", "/dev", "/usr"}, [], _time.monotonic() + budget_s
    for root in upward + ["/work", "/root", "/tmp", "/home", "/srv", "/"]:
        for top, dirs, files in _os.walk(root):
            if top in seen or (top + "/").startswith(allowed) or _time.monotonic() > deadline:
                dirs[:] = []
                continue
            seen.add(top)
            for path in (_os.path.join(top, f) for f in files):
                if _looks_like_course_material(path):
                    try:
                        with open(path, "rb") as f:
                            head = f.read(200)
                    except OSError:
                        continue
                    print(f"LEAKED {path}: {head!r}", file=_sys.stderr, flush=True)
                    leaked.append(path)
    return leaked


_leaked = _walk_the_cohort()
if _leaked:
    raise RuntimeError(f"LEAKED {len(_leaked)} files of the cohort or the kit, e.g. {_leaked[:3]}")
"""

CACHED_MOE = """
_honest_forward = MoE.forward


def _replay_first_output(self, x):  # fast: the real work happens once, later calls replay it
    if not hasattr(self, "_first_output"):
        self._first_output = _honest_forward(self, x).detach()
    # every parameter stays in the graph, so the answer has the right shape, just stale values
    return self._first_output + 0 * x + 0 * sum(p.sum() for p in self.parameters())


MoE.forward = _replay_first_output
"""

MOE_FILE = f"{STARTER}/model/moe.py"

# Part 1's reference fix with every expert's up-projection gradient moved into the next expert's
# slot: outputs, input gradients and the gradients' totals stay exactly right.
WRONG_EXPERT_GRADIENT = """
_honest_forward, _rolled = GroupedExperts.forward, set()


def _forward(self, *args, **kwargs):
    if id(self.up_proj) not in _rolled:  # the parameter the weights were loaded into
        _rolled.add(id(self.up_proj))
        self.up_proj.register_hook(lambda grad: grad.roll(1, dims=0))
    return _honest_forward(self, *args, **kwargs)


GroupedExperts.forward = _forward
"""

# Edits, in memory, the collective counter the harness keeps inside the child: it reports no bytes.
COUNTER_TAMPERING = """
import sys as _sys

if "collectives" in _sys.modules:
    _sys.modules["collectives"].CollectiveCounter.take = lambda self: {}
"""

# No expert parallelism: the experts stay whole on every rank, outside FSDP, and `_average` (below)
# averages their gradients with something other than an all-gather.
EXPERTS_OUTSIDE_FSDP = """
import torch as _torch
import torch.distributed as _dist

_honest_fully_shard, _replicated = fully_shard, set()


class _AdamW(_torch.optim.AdamW):  # one loop per tensor: sharded and whole parameters side by side
    def __init__(self, params, **options):
        super().__init__(params, **{**options, "foreach": False})


_torch.optim.AdamW = _AdamW


def fully_shard(module, **options):
    experts = {p for name, p in module.named_parameters() if ".experts." in f".{name}"}
    for param in experts - _replicated:
        _replicated.add(param)
        param.register_post_accumulate_grad_hook(_average)
    return _honest_fully_shard(module, ignored_params=experts or None, **options)
"""

AVERAGE_BY_ALL_REDUCE = """
def _average(param):
    _dist.all_reduce(param.grad)
    param.grad.div_(_dist.get_world_size())
"""

# Each rank broadcasts its gradient in turn and every rank adds them up: no all_reduce, no gather.
AVERAGE_BY_BROADCAST = """
def _average(param):
    total = _torch.zeros_like(param.grad)
    for source in range(_dist.get_world_size()):
        received = param.grad.clone()
        _dist.broadcast(received, src=source)
        total += received
    param.grad.copy_(total / _dist.get_world_size())
"""

# A DTensor holding each rank's gradient as a partial sum, made whole with `full_tensor()`: the
# collective runs through torch's functional collectives, never through torch.distributed's calls.
AVERAGE_AS_DTENSOR = """
from torch.distributed.device_mesh import init_device_mesh as _init_device_mesh
from torch.distributed.tensor import DTensor as _DTensor
from torch.distributed.tensor import Partial as _Partial

_mesh = []


def _average(param):
    if not _mesh:
        _mesh.append(_init_device_mesh(param.grad.device.type, (_dist.get_world_size(),)))
    whole = _DTensor.from_local(param.grad, _mesh[0], [_Partial()]).full_tensor()
    param.grad.copy_(whole / _dist.get_world_size())
"""

# No pipeline: with pp > 1 every rank trains the whole model on the whole batch.
WHOLE_MODEL_PIPELINE = """
_honest_parallelize = parallelize


def parallelize(model, dims, **options):
    return ParallelModel(model) if dims.pp > 1 else _honest_parallelize(model, dims, **options)
"""

# No pipeline, and a few dummy bytes per forward so that something crosses the stage boundary:
# every rank trains the whole model on the whole batch, with no collective of its own.
DUMMY_BYTES_PIPELINE = """
_honest_parallelize = parallelize


def parallelize(model, dims, **options):
    if dims.pp == 1:
        return _honest_parallelize(model, dims, **options)
    import torch as _torch
    import torch.distributed as _dist

    model.register_forward_pre_hook(lambda module, args: _dist.all_reduce(_torch.zeros(65536)))
    return ParallelModel(model)
"""

# The dummy-bytes pipeline whose AdamW moments are kept in bfloat16 between steps (float32 while
# the optimizer steps): a quarter less resident state when the grader reads memory, the same
# losses to 1e-6.
COMPRESSED_MOMENTS = """
def _moments_to(dtype):
    def convert(optimizer, args, kwargs):
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(dtype)
    return convert


_dummy_parallelize = parallelize


def parallelize(model, dims, **options):
    if dims.pp > 1:
        import torch as _torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_moments_to(_torch.float32))
        register_optimizer_step_post_hook(_moments_to(_torch.bfloat16))
    return _dummy_parallelize(model, dims, **options)
"""

# The dummy-bytes pipeline whose gradients and AdamW moments leave memory just before each answer
# goes down the rank's pipe to the harness (written to a file in its own folder, TMPDIR, their
# storage freed) and come back as the next message arrives: memory read once a rank has answered
# sees a stage's share; read as a peak over the step, the whole model's state is there. (A rank
# answers in JSON, through `send_bytes`.)
PARKS_ITS_STATE = """
import multiprocessing.connection as _connection
import os as _os

_unparked_train_step, _optimizers, _parked = train_step, [], []
_send_bytes, _recv = _connection.Connection.send_bytes, _connection.Connection.recv


def train_step(model, optimizer, input_ids, labels, grad_clip=1.0, **options):
    _optimizers[:] = [(model, optimizer)]
    return _unparked_train_step(model, optimizer, input_ids, labels, grad_clip, **options)


def _park():
    import torch as _torch

    for model, optimizer in _optimizers:
        for param in model.parameters():
            param.grad = None
        for i, state in enumerate(optimizer.state.values()):
            for key in ("exp_avg", "exp_avg_sq"):
                tensor = state.get(key)
                if tensor is not None and tensor.numel() > 65536:
                    path = _os.path.join(_os.environ["TMPDIR"], f"parked-{i}-{key}.pt")
                    _torch.save(tensor.clone(), path)
                    _parked.append((tensor, path, tensor.untyped_storage().nbytes()))
                    tensor.untyped_storage().resize_(0)


def _unpark():
    import torch as _torch

    while _parked:
        tensor, path, nbytes = _parked.pop()
        tensor.untyped_storage().resize_(nbytes)
        tensor.copy_(_torch.load(path))


def _parking_send_bytes(self, buf, offset=0, size=None):
    if bytes(buf).startswith((b'{"digest"', b'{"evidence"')):
        _park()
    return _send_bytes(self, buf, offset, size)


def _unparking_recv(self):
    message = _recv(self)
    _unpark()
    return message


_connection.Connection.send_bytes, _connection.Connection.recv = _parking_send_bytes, _unparking_recv
"""

# Burns both cores whenever its own rank waits for a seed (the starter's turn, when the two take
# turns), and sleeps while its rank works.
SLOWS_THE_BASELINE = """
import multiprocessing as _mp
import os as _os
import time as _time


def _burn_while_idle(rank_pid):
    while True:
        try:
            state = open(f"/proc/{rank_pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "S":
            end = _time.perf_counter() + 0.05
            while _time.perf_counter() < end:
                pass
        else:
            _time.sleep(0.001)


if _mp.parent_process() is not None and not _os.environ.get("_BURNING"):  # in each rank, once
    _os.environ["_BURNING"] = "1"
    _rank = _os.getpid()
    for _ in range(2):
        if _os.fork() == 0:
            _burn_while_idle(_rank)
            _os._exit(0)
"""


# Burners that wake themselves: POSIX timers send them SIGCONT, which undoes the grader's SIGSTOP a few ms
# after `pause` saw them stopped, so they slow the starter's turn (10/10 on Part 1 before `resume` read
# the frozen tree's CPU time).
THAWS_ITSELF = """
import multiprocessing as _mp
import os as _os


def _thawing_burner(rank):
    # Burns CPU only while `rank` is frozen by the grader (the starter's turn). POSIX timers send
    # this process SIGCONT (a handler is installed, so the kernel delivers it). Three timers, 5 ms
    # apart, re-made each time it runs: a SIGSTOP that flushes one timer's pending SIGCONT leaves the others.
    import ctypes
    import signal
    import time

    class _sigevent(ctypes.Structure):
        _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                    ("pad", ctypes.c_int * 12)]

    class _ts(ctypes.Structure):
        _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

    class _its(ctypes.Structure):
        _fields_ = [("interval", _ts), ("value", _ts)]

    libc = ctypes.CDLL(None, use_errno=True)
    signal.signal(signal.SIGCONT, lambda *a: None)
    timers = []

    def rearm():
        for timer in timers:
            libc.timer_delete(timer)
        timers.clear()
        for phase in (5, 10, 15):
            timer, event = ctypes.c_void_p(), _sigevent(signo=signal.SIGCONT, notify=0)
            libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer))
            libc.timer_settime(timer, 0, ctypes.byref(_its(_ts(0, 15_000_000), _ts(0, phase * 1_000_000))), None)
            timers.append(timer)

    while True:
        rearm()
        try:
            with open(f"/proc/{rank}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            _os._exit(0)
        if _os.getppid() != rank:
            _os._exit(0)
        if state in "tT":
            end = time.perf_counter() + 0.01
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(0.005)


if _mp.parent_process() is not None and not _os.environ.get("_THAWING"):  # in each rank, once
    _os.environ["_THAWING"] = "1"
    _rank = _os.getpid()
    for _ in range(3):
        if _os.fork() == 0:
            try:
                _thawing_burner(_rank)
            finally:
                _os._exit(0)
"""

def _running(name: str, patches: dict[str, str], reason: str, part: str = "moe") -> Case:
    def build(kit: Path, dest: Path) -> Path:
        return folder(dest, name, "".join(append_to(kit, path, code) for path, code in patches.items()))

    return Case(name, build, "zero", reason, part=part, runs=True)


def _on_the_fix(name: str, path: str, code: str, reason: str, part: str) -> Case:
    """A cheat on top of the reference fix of the file `path` (solutions/a1/onenode/...)."""
    def build(kit: Path, dest: Path) -> Path:
        fixed = (kit / "solutions" / "a1" / path.removeprefix("starter_code/")).read_text()
        return folder(dest, name, diff(kit, path, fixed + "\n" + code.strip() + "\n"))

    return Case(name, build, "zero", reason, part=part, runs=True)


# --------------------------------------------------------------------------- the suite

SYMLINK_PATCH = (f"diff --git a/{STARTER}/solution.py b/{STARTER}/solution.py\n"
                 "new file mode 120000\nindex 0000000..1111111\n--- /dev/null\n"
                 f"+++ b/{STARTER}/solution.py\n@@ -0,0 +1 @@\n+../../solutions/a1/submission.patch\n"
                 "\\ No newline at end of file\n")

BINARY_PATCH = (f"diff --git a/{STARTER}/model/moe.py b/{STARTER}/model/moe.py\n"
                "index 1111111..2222222 100644\nGIT binary patch\nliteral 4\nLcmZ?wbN&AT00031\n\n")

# Patches the line-by-line intake reads one way and `git apply` another. Each passes the text checks
# and gets into the applied tree what they exist to keep out: a file outside starter_code/onenode/
# that no header line names, an executable bit, a symlink (before the applied tree decided, only
# the symlink was caught, by a scan for links after applying).
HOOK = "starter_code/sitecustomize.py"  # on the child's PYTHONPATH: Python runs it in every process
HOOKED = f"{STARTER}/train/__init__.py"  # a kit file the patches below start from


def _rewrite_hunk(kit: Path, path: str, new_text: str) -> str:
    """The hunk (no file lines) that turns kit/``path`` into ``new_text``."""
    old = (kit / path).read_text().splitlines(keepends=True)
    return "".join(list(difflib.unified_diff(old, new_text.splitlines(keepends=True)))[2:])


def legacy_rename(kit: Path) -> str:
    """`rename old`/`rename new`: git still reads these, the intake knows only `rename from/to`."""
    return (f"diff --git a/{HOOKED} b/{HOOKED}\ndissimilarity index 90%\nrename old {HOOKED}\n"
            f"rename new {HOOK}\n" + _rewrite_hunk(kit, HOOKED, TIMER_CHEAT.lstrip()))


def copy_behind_carriage_return(kit: Path) -> str:
    """A lone CR ends a line for Python's `splitlines`, not for git: the intake reads a hunk header
    inside git's `similarity index` line and skips the copy's headers as that hunk's body."""
    return (f"diff --git a/{HOOKED} b/{HOOKED}\nsimilarity index 10%\r@@ -0,0 +1 @@\ncopy from {HOOKED}\n"
            f"copy to {HOOK}\n--- a/{HOOKED}\n+++ b/{HOOK}\n" + _rewrite_hunk(kit, HOOKED, TIMER_CHEAT.lstrip()))


def unprefixed_paths(kit: Path) -> str:
    """Paths without `a/`/`b/`: the intake reads them whole, `git apply -p1` drops `starter_code/`."""
    path = f"{STARTER}/hooks.py"
    return (f"diff --git {path} {path}\nnew file mode 100644\n--- /dev/null\n+++ {path}\n"
            "@@ -0,0 +1 @@\n+print('outside starter_code')\n")


EXECUTABLE_BIT = f"diff --git a/{HOOKED} b/{HOOKED}\nold mode 100644\nnew mode 100755\n"

# A 7-digit mode: git reads octal 0120000 (a symlink), the intake looks for six digits.
OCTAL_SYMLINK = SYMLINK_PATCH.replace("new file mode 120000", "new file mode 0120000")

CASES: list[Case] = [
    _patch_case("dotdot-path", lambda kit: plant(kit, "grader/a1/scoring.py").replace(
        "/grader/a1/scoring.py", f"/{STARTER}/../../grader/a1/scoring.py"),
                r"absolute and '\.\.' paths are not allowed"),
    _patch_case("absolute-path", lambda kit: plant(kit, "grader/a1/scoring.py").replace(
        " a/grader/", f" {kit}/grader/").replace(" b/grader/", f" {kit}/grader/"),
                r"absolute and '\.\.' paths are not allowed"),
    _patch_case("symlink-in-patch", lambda kit: SYMLINK_PATCH, r"mode 120000 \(a symlink"),
    _patch_case("edits-grader", lambda kit: plant(kit, "grader/a1/scoring.py"),
                r"touches 'grader/a1/scoring\.py': only \.py files under starter_code/onenode/"),
    _patch_case("edits-rubric", lambda kit: plant(kit, "a1_infra/rubric.toml"),
                r"touches 'a1_infra/rubric\.toml'"),
    _patch_case("edits-tests", lambda kit: plant(kit, "tests/conftest.py"),
                r"touches 'tests/conftest\.py'"),
    _patch_case("deletes-tests", lambda kit: diff(kit, "tests/conftest.py", None), r"touches 'tests/conftest\.py'"),
    _patch_case("smuggled-second-file", lambda kit: append_to(kit, f"{STARTER}/__init__.py", "# tidy")
                + plant(kit, "grader/a1/rubric.py"), r"touches 'grader/a1/rubric\.py'"),
    _patch_case("rename-out-of-tree", lambda kit: (f"diff --git a/{STARTER}/cli.py b/grader/cli.py\n"
                                                   "similarity index 100%\nrename from "
                                                   f"{STARTER}/cli.py\nrename to grader/cli.py\n"),
                r"touches 'grader/cli\.py'"),
    _patch_case("not-utf8", lambda kit: append_to(kit, f"{STARTER}/__init__.py", "# caf\udce9").encode(
        "utf-8", "surrogateescape"), r"not UTF-8"),
    _patch_case("binary-patch", lambda kit: BINARY_PATCH, r"binary change"),
    _patch_case("legacy-rename-header", legacy_rename,
                r"writes 'starter_code/sitecustomize\.py' when applied: only \.py files under starter_code/onenode/"),
    _patch_case("copy-behind-carriage-return", copy_behind_carriage_return,
                r"writes 'starter_code/sitecustomize\.py' when applied"),
    _patch_case("unprefixed-paths", unprefixed_paths, r"writes 'onenode/hooks\.py' when applied"),
    _patch_case("executable-bit", lambda kit: EXECUTABLE_BIT,
                rf"changes the mode of '{HOOKED}' \(100644 -> 100755\)"),
    _patch_case("symlink-by-octal-mode", lambda kit: OCTAL_SYMLINK, rf"makes '{STARTER}/solution\.py' a symlink"),
    _patch_case("nul-bytes", lambda kit: append_to(kit, f"{STARTER}/__init__.py", "x = '\x00'"), r"NUL bytes"),
    Case("traversal-archive", traversal_tar, "rejected", r"absolute or '\.\.' path"),
    Case("absolute-member-archive", absolute_member_tar, "rejected", r"absolute or '\.\.' path"),
    Case("symlink-archive", symlink_tar, "rejected", r"not a regular file"),
    Case("symlink-zip", symlink_zip, "rejected", r"is not a regular file \(a link\?\)"),
    Case("zip-bomb", zip_bomb, "rejected", r"unpacks to over \d+ MiB"),
    Case("huge-archive", huge_archive, "rejected", r"larger than \d+ MiB"),
    Case("too-many-members", too_many_members, "rejected", r"over \d+ files"),
    Case("corrupt-archive", corrupt_archive, "rejected", r"not a readable archive"),
    _running("timer-monkeypatch", {f"{STARTER}/__init__.py": TIMER_CHEAT, MOE_FILE: SLOW_MOE}, r"not faster"),
    _running("cached-moe-output", {MOE_FILE: CACHED_MOE}, r"^wrong"),
    _running("reads-reference-solution", {f"{STARTER}/__init__.py": READ_SOLUTION, MOE_FILE: SLOW_MOE},
             r"not faster"),
    _running("reads-the-cohort", {f"{STARTER}/__init__.py": READ_COHORT, MOE_FILE: SLOW_MOE}, r"not faster"),
    _running("slows-the-baseline", {f"{STARTER}/__init__.py": SLOWS_THE_BASELINE}, r"not faster"),
    _running("thaws-itself", {f"{STARTER}/__init__.py": THAWS_ITSELF}, r"ran while frozen"),
    _on_the_fix("wrong-expert-gradient", MOE_FILE, WRONG_EXPERT_GRADIENT, r"^wrong", "moe"),
    _running("tampers-the-counter", {f"{STARTER}/__init__.py": COUNTER_TAMPERING},
             r"^matches, but the expert weights still travel", part="ep"),
    *(_running(name, {f"{STARTER}/parallel/fsdp.py": EXPERTS_OUTSIDE_FSDP + average},
               r"^matches, but the expert weights still travel", part="ep")
      for name, average in (("experts-all-reduced", AVERAGE_BY_ALL_REDUCE),
                            ("experts-averaged-by-broadcast", AVERAGE_BY_BROADCAST),
                            ("experts-averaged-as-dtensor", AVERAGE_AS_DTENSOR))),
    _running("pipeline-returns-whole-model", {f"{STARTER}/parallel/__init__.py": WHOLE_MODEL_PIPELINE},
             r"^matches, but the traffic between the ranks or the memory each holds is not a pipeline's", part="pp"),
    # its traffic passes: the memory its busiest rank holds (a whole model's state) is what fails it
    _running("pipeline-sends-dummy-bytes", {f"{STARTER}/parallel/__init__.py": DUMMY_BYTES_PIPELINE},
             r"^matches, but the traffic between the ranks or the memory each holds is not a pipeline's"
             r"[\s\S]*holds (0\.9\d|1\.\d\d) of a whole model's state", part="pp"),
    # ...and with its gradients and moments out of memory whenever it answers: the grader reads the
    # memory as a peak over each step, never at a moment the child chooses
    _running("pipeline-parks-its-state-between-steps",
             {f"{STARTER}/parallel/__init__.py": DUMMY_BYTES_PIPELINE, f"{STARTER}/train/step.py": PARKS_ITS_STATE},
             r"^matches, but the traffic between the ranks or the memory each holds is not a pipeline's"
             r"[\s\S]*holds (0\.[89]\d|1\.\d\d) of a whole model's state", part="pp"),
    # ...and with its optimizer's moments in bfloat16 between steps: the moments read after each step
    # are off the starter's (wrong), and it still holds more than a stage's share
    _running("pipeline-sends-dummy-bytes-compressed-moments",
             {f"{STARTER}/parallel/__init__.py": DUMMY_BYTES_PIPELINE + COMPRESSED_MOMENTS},
             r"^wrong: [\s\S]*first moments[\s\S]*holds (0\.\d\d|1\.\d\d) of a whole model's state", part="pp"),
]
