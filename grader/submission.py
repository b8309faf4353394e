"""An A1 submission from intake to a patched scratch tree.

A submission is a folder or an archive (.zip, .tar.gz, .tgz, .tar) holding `submission.patch`
(a `git diff` against the kit, paths `a/starter_code/onenode/...`) and `report.ipynb`, at its
top or inside one top-level folder. Everything here is checked before anything runs: size, text,
paths (only `.py` files under `starter_code/onenode/`), no binary hunks, no symlinks, no renames
or copies out of the tree, and `git apply --check` against a pristine copy of the kit's
`starter_code/`. Those text checks give the common mistakes a clear reason; what decides is the
applied tree itself (`patched_tree`): git reads a patch in ways a line-by-line reader does not, so
every path that differs from the pristine copy after `git apply` must be a regular, non-executable
.py text file under `starter_code/onenode/`. Each problem is a `SubmissionError` whose message is
one line saying what to do.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import SubmissionError
from .rubric import KIT_ROOT

PATCH_NAME = "submission.patch"
NOTEBOOK_NAME = "report.ipynb"
MAX_ARCHIVE_BYTES = 50 * 2**20
MAX_UNPACKED_BYTES = 50 * 2**20
MAX_MEMBERS = 1000
MAX_PATCH_BYTES = 2 * 2**20
ALLOWED_ROOT = "starter_code/onenode/"
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
_REGULAR_MODES = {"100644", "100755"}
_GIT_HEADER_PATHS = re.compile(r"^(rename|copy) (from|to) (.+)$")
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_MODE_LINE = re.compile(r"^(new file mode|deleted file mode|old mode|new mode|index \S+) ?(\d{6})?$")


@dataclass
class Submission:
    name: str
    patch: str  # the text of submission.patch ("" for an unchanged starter)
    notebook: Path | None
    changed_files: list[str]


def submission_name(path: Path) -> str:
    name = path.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# -- unpacking ---------------------------------------------------------------------------------
def _safe_member(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise SubmissionError(f"archive member {name!r} has an absolute or '..' path: archive the folder itself")
    return path


def _members(archive: Path):
    """(name, kind, size, open) for each member of a zip or tar archive; kind is "dir",
    "file" or "other" (links, devices)."""
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                link = (info.external_attr >> 16) & 0o170000 == 0o120000
                kind = "dir" if info.is_dir() else "other" if link else "file"
                yield info.filename, kind, info.file_size, lambda info=info: zf.open(info)
    else:
        with tarfile.open(archive) as tf:
            for info in tf.getmembers():
                kind = "dir" if info.isdir() else "file" if info.isfile() else "other"
                yield info.name, kind, info.size, lambda info=info: tf.extractfile(info)


def _unpack(archive: Path, dest: Path) -> None:
    """Extract regular files only, refusing links, traversal and archive bombs."""
    if archive.stat().st_size > MAX_ARCHIVE_BYTES:
        raise SubmissionError(f"{archive.name} is larger than {MAX_ARCHIVE_BYTES >> 20} MiB: "
                              "submit the patch and notebook only")
    total = 0
    try:
        for count, (name, kind, size, open_member) in enumerate(_members(archive), 1):
            path = _safe_member(name)
            if count > MAX_MEMBERS:
                raise SubmissionError(f"{archive.name} has over {MAX_MEMBERS} files: "
                                      "submit the patch and notebook only")
            if kind == "dir":
                continue
            if kind != "file":
                raise SubmissionError(f"archive member {name!r} is not a regular file (a link?): submit plain files")
            total += size
            if total > MAX_UNPACKED_BYTES:
                raise SubmissionError(f"{archive.name} unpacks to over {MAX_UNPACKED_BYTES >> 20} MiB")
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            with open_member() as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
        raise SubmissionError(f"{archive.name} is not a readable archive ({e}): re-create it with zip or tar") from None


def _find(folder: Path, name: str) -> Path | None:
    """`name` at the top of `folder` or inside its single top-level folder."""
    if (folder / name).is_file() and not (folder / name).is_symlink():
        return folder / name
    subdirs = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("__MACOSX", "."))]
    if len(subdirs) == 1:
        return _find(subdirs[0], name)
    return None


# -- the patch ---------------------------------------------------------------------------------
def _check_path(path: str) -> str | None:
    """The path relative to the kit (None for /dev/null), or SubmissionError if it may not change."""
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path:
        raise SubmissionError(f"submission.patch touches {path!r}: absolute and '..' paths are not allowed")
    if not path.startswith(ALLOWED_ROOT) or not path.endswith(".py"):
        raise SubmissionError(
            f"submission.patch touches {path!r}: only .py files under {ALLOWED_ROOT} may change "
            f"(make it with `git diff -- starter_code/onenode > submission.patch`)"
        )
    return path


def check_patch(text: str) -> list[str]:
    """The files a patch changes; raises SubmissionError for anything but plain .py edits.

    Header lines are checked; hunk bodies are skipped by their line counts, so a removed line
    that happens to start with `-- ` is never read as a header.
    """
    changed: dict[str, None] = {}  # ordered set
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if m := _HUNK.match(line):
            old, new = int(m.group(1) or 1), int(m.group(2) or 1)
            while (old > 0 or new > 0) and i < len(lines):
                tag = lines[i][:1]
                old -= tag in (" ", "-", "")
                new -= tag in (" ", "+", "")
                i += 1
        elif line.startswith("diff --git "):
            parts = line[len("diff --git "):].split(" ")
            if len(parts) != 2:
                raise SubmissionError(f"submission.patch has a path with spaces ({line!r}): rename the file")
            changed.update(dict.fromkeys(filter(None, map(_check_path, parts))))
        elif line.startswith(("--- ", "+++ ")):
            changed.update(dict.fromkeys(filter(None, [_check_path(line[4:].split("\t")[0])])))
        elif line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
            raise SubmissionError("submission.patch has a binary change: only text .py files may change")
        elif m := _GIT_HEADER_PATHS.match(line):
            changed[_check_path(m.group(3))] = None
        elif (m := _MODE_LINE.match(line)) and m.group(2) and m.group(2) not in _REGULAR_MODES:
            raise SubmissionError(f"submission.patch sets file mode {m.group(2)} (a symlink or submodule): "
                                  "only regular files may change")
    if text.strip() and not changed:
        raise SubmissionError("submission.patch holds no diff: make it with `git diff > submission.patch`")
    return list(changed)


def load_submission(path: str | Path, workdir: Path) -> Submission:
    """Read and check a submission; archives are unpacked under `workdir`."""
    path = Path(path)
    if not path.exists():
        raise SubmissionError(f"{path} does not exist: pass a submission folder or archive")
    if path.is_dir():
        folder = path
    elif path.name.endswith(ARCHIVE_SUFFIXES):
        folder = workdir / "unpacked"
        folder.mkdir(parents=True)
        _unpack(path, folder)
        if not any(folder.iterdir()):
            raise SubmissionError(f"{path.name} is empty: it must hold {PATCH_NAME} and {NOTEBOOK_NAME}")
    else:
        raise SubmissionError(f"{path.name} is neither a folder nor a {'/'.join(ARCHIVE_SUFFIXES)} archive")
    patch_path = _find(folder, PATCH_NAME)
    if patch_path is None:
        raise SubmissionError(f"no {PATCH_NAME} in {path.name}: "
                              f"run `git diff -- starter_code/onenode > {PATCH_NAME}` in the kit")
    if patch_path.stat().st_size > MAX_PATCH_BYTES:
        raise SubmissionError(f"{PATCH_NAME} is larger than {MAX_PATCH_BYTES >> 20} MiB: submit source changes only")
    raw = patch_path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SubmissionError(f"{PATCH_NAME} is not UTF-8 text (byte {e.start}): "
                              f"save it as UTF-8 (`git diff > {PATCH_NAME}` in a UTF-8 shell)") from None
    if "\x00" in text:
        raise SubmissionError(f"{PATCH_NAME} contains NUL bytes: it must be a text diff")
    changed = check_patch(text)
    notebook = _find(folder, NOTEBOOK_NAME)
    return Submission(submission_name(path), text, notebook, changed)


# -- scratch trees -----------------------------------------------------------------------------
def pristine_tree(dest: Path, kit_root: Path = KIT_ROOT) -> Path:
    """A copy of the kit's `starter_code/` at `dest/starter_code` (sources only)."""
    src = kit_root / "starter_code"
    if not (src / "onenode" / "__init__.py").is_file():
        raise FileNotFoundError(f"no starter_code/onenode in {kit_root}: run onenode-grade from a kit checkout")
    shutil.copytree(src, dest / "starter_code", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dest


def _git_apply(tree: Path, patch_file: Path, *extra: str) -> subprocess.CompletedProcess:
    # A ceiling stops git from finding an enclosing repository, where `git apply` would silently
    # skip the paths outside the current folder.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent.resolve()))
    return subprocess.run(
        ["git", "apply", "--whitespace=nowarn", *extra, str(patch_file.resolve())],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60,
    )


def patched_tree(submission: Submission, dest: Path, kit_root: Path = KIT_ROOT) -> Path:
    """A pristine copy of starter_code with the submission applied (`git apply --check` first),
    refused unless everything that then differs from the pristine copy passes `check_applied`."""
    pristine_tree(dest, kit_root)
    if not submission.changed_files:
        return dest
    patch_file = dest.parent / f"{dest.name}.patch"
    patch_file.write_text(submission.patch, encoding="utf-8")
    pristine = _snapshot(dest)
    for extra in (("--check",), ()):
        result = _git_apply(dest, patch_file, *extra)
        if result.returncode != 0:
            lines = ([ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
                     or result.stderr.splitlines() or ["?"])
            reason = lines[0].removeprefix("error: ")
            raise SubmissionError(
                f"{PATCH_NAME} does not apply to this kit's starter_code ({reason}): "
                f"regenerate it with `git diff` against the current kit"
            )
    check_applied(pristine, _snapshot(dest))
    return dest


# -- the applied tree --------------------------------------------------------------------------
_REMAKE = f"make it with `git diff -- starter_code/onenode > {PATCH_NAME}`"
Entry = tuple[str, int, bytes]  # (kind, permission bits, a file's content or a link's target)


def _snapshot(root: Path) -> dict[str, Entry]:
    """Everything under `root` but directories, by its path relative to `root`; links are read,
    never followed."""
    entries = {}
    for top, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            path = os.path.join(top, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                kind, data = "symlink", os.fsencode(os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                kind, data = "regular file", Path(path).read_bytes()
            else:
                kind, data = "special file", b""
            entries[os.path.relpath(path, root)] = (kind, stat.S_IMODE(info.st_mode), data)
    return entries


def _is_text(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in data


def _git_mode(bits: int) -> str:
    """A file's mode as git records it: only the executable bit counts."""
    return "100755" if bits & 0o111 else "100644"


def check_applied(pristine: dict[str, Entry], applied: dict[str, Entry]) -> None:
    """SubmissionError for the first path the applied patch changed that a submission may not:
    anything outside `starter_code/onenode/` or not a .py file there (written or deleted), a link
    or special file, an executable bit, or content that is not UTF-8 text without NUL bytes."""
    for path in sorted(pristine.keys() | applied.keys()):
        before, after = pristine.get(path), applied.get(path)
        if before == after:
            continue
        if not (path.startswith(ALLOWED_ROOT) and path.endswith(".py")):
            raise SubmissionError(f"{PATCH_NAME} {'deletes' if after is None else 'writes'} {path!r} when applied: "
                                  f"only .py files under {ALLOWED_ROOT} may change ({_REMAKE})")
        if after is None:
            continue  # a .py file of the student's package removed
        kind, bits, data = after
        if kind != "regular file":
            raise SubmissionError(f"{PATCH_NAME} makes {path!r} a {kind} when applied: "
                                  f"only regular files may change ({_REMAKE})")
        was = _git_mode(before[1]) if before else "100644"
        if _git_mode(bits) != was:
            raise SubmissionError(f"{PATCH_NAME} changes the mode of {path!r} ({was} -> {_git_mode(bits)}) when "
                                  "applied: only contents may change (`chmod -x` it and make the patch again)")
        if not _is_text(data):
            raise SubmissionError(f"{PATCH_NAME} makes {path!r} binary when applied: "
                                  "only UTF-8 Python source may change")
