"""The grader's intake of an A2 submission: the kit's run folder loader (`onenode.verify.intake`,
which `onenode verify` and `onenode pack a2` use too), its refusal the submission's zero.

The grader reads a run's files several times (the audit, the replay harness, the copy of final/
it evaluates), so the bytes it verifies are the bytes it scores only if nobody else can change
them meanwhile: every file and folder of the submission must be the grader's own (its user,
root or the user `sudo` ran it for) and writable by nobody else, and so must every folder above it
(or have the sticky bit, as /tmp does). A folder a student can still write to is refused in one
line that says to copy it in (red team: final/ swapped for an over-budget run between the replay's
copy and the evaluation's scored the swapped model).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from onenode.verify import intake

from ..errors import SubmissionError


def load_submission(path: str | Path, notebook: bool = True) -> intake.A2Submission:
    """`onenode.verify.intake.load_submission`, refused in one line as a `SubmissionError`, as is a
    folder that someone other than the grader could change while it is graded (`changeable_by_others`)."""
    problem = changeable_by_others(Path(path))
    if problem:
        raise SubmissionError(f"{problem}: copy the submission into a folder of the grader's own "
                              "(`cp -r`, as the collecting step does) and grade that copy")
    try:
        return intake.load_submission(path, notebook)
    except intake.RunFolderError as e:
        raise SubmissionError(str(e)) from None


def _trusted_users() -> set[int]:
    users = {os.geteuid(), 0}
    if os.environ.get("SUDO_UID", "").isdigit():
        users.add(int(os.environ["SUDO_UID"]))
    return users


def changeable_by_others(root: Path) -> str | None:
    """Why a user other than the grader's could change the submission at `root` while it is
    graded, in one line, or None: a file or folder in it (or a folder above it) owned by another
    user, or writable by others or by a group that is not the grader's."""
    if not root.exists():
        return None  # the loader says what is missing
    users, group = _trusted_users(), os.getegid()

    def problem(path: Path, info: os.stat_result, above: bool) -> str | None:
        if above and info.st_mode & stat.S_ISVTX:
            return None  # a sticky folder (/tmp): only an entry's owner may rename or remove it
        where = f"{path}" if above else f"{path.relative_to(root.parent)}"
        if info.st_uid not in users:
            return f"{where} belongs to user {info.st_uid}, not to the grader's"
        if info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_gid != group):
            return f"{where} is writable by other users"
        return None

    resolved = root.resolve()
    for folder in resolved.parents:
        found = problem(folder, folder.stat(), above=True)
        if found:
            return found
    for path in [resolved, *resolved.rglob("*")]:
        try:
            found = problem(root.parent / path.relative_to(resolved.parent), path.lstat(), above=False)
        except FileNotFoundError:
            continue
        if found:
            return found
    return None
