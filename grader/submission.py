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

The rule on the patch (its text, how it is applied, what the applied tree may change) is
`onenode.handin`'s, the kit's pristine copy: students run the same rule with `onenode pack a1`.
It is imported where it is used, as the rest of the kit's stack is: importing `onenode` imports
torch, which the grader's command line does not otherwise need.
"""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import SubmissionError
from .rubric import KIT_ROOT

PATCH_NAME = "submission.patch"
NOTEBOOK_NAME = "report.ipynb"
MAX_ARCHIVE_BYTES = 50 * 2**20
MAX_UNPACKED_BYTES = 50 * 2**20
MAX_MEMBERS = 1000
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")


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


# -- the patch: onenode.handin's rule ---------------------------------------------------------
@contextmanager
def _refused() -> Iterator[None]:
    """onenode.handin's refusals as this submission's SubmissionError."""
    from onenode.handin import HandInError

    try:
        yield
    except HandInError as e:
        raise SubmissionError(str(e)) from None


def check_patch(text: str) -> list[str]:
    """The files a patch changes; raises SubmissionError for anything but plain .py edits
    (`onenode.handin.check_patch`)."""
    from onenode import handin

    with _refused():
        return handin.check_patch(text)


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
    from onenode.handin import read_patch

    with _refused():
        text = read_patch(patch_path)
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


def patched_tree(submission: Submission, dest: Path, kit_root: Path = KIT_ROOT) -> Path:
    """A pristine copy of starter_code with the submission applied (`git apply --check` first),
    refused unless everything that then differs from the pristine copy passes the rule
    (`onenode.handin.apply_patch`)."""
    from onenode.handin import apply_patch

    pristine_tree(dest, kit_root)
    if not submission.changed_files:
        return dest
    with _refused():
        apply_patch(submission.patch, dest)
    return dest
