"""What a submission holds and what it may change: the rules `onenode pack` checks before a group
hands in, and the grader applies on intake (`grader/submission.py`, `grader/a2/intake.py` import
them from here, so the two cannot drift apart).

A1: `submission.patch`, a `git diff` of `starter_code/onenode/` against the handout, and
`report.ipynb`. The patch may change only `.py` files under `starter_code/onenode/`: its text is
checked first (`check_patch`: paths, no binary hunks, no symlinks, no renames or copies out of the
tree), for clear reasons on the common mistakes; what decides is the tree it gives when applied
to a clean starter (`apply_patch`, then `check_applied`): every path that then differs must be a
regular, non-executable .py text file under `starter_code/onenode/`.

A2: the run folder `onenode train` wrote, the data folder it trained on and the report, as
listed once in `A2_HAND_IN`: the handout's table and the release README are made from it, and
`a2_missing` is what the pack command and the grader's intake refuse an incomplete folder by.

Each refusal is a `HandInError` whose message is one line saying what to do. Nothing here imports
torch or the rest of the stack (only `a2_missing` reads the recipe).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PATCH_NAME = "submission.patch"
NOTEBOOK_NAME = "report.ipynb"
MAX_PATCH_BYTES = 2 * 2**20
ALLOWED_ROOT = "starter_code/onenode/"
_REGULAR_MODES = {"100644", "100755"}
_GIT_HEADER_PATHS = re.compile(r"^(rename|copy) (from|to) (.+)$")
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_MODE_LINE = re.compile(r"^(new file mode|deleted file mode|old mode|new mode|index \S+) ?(\d{6})?$")
_REMAKE = f"make it with `git diff -- starter_code/onenode > {PATCH_NAME}`"


class HandInError(ValueError):
    """A submission that the grader would refuse, with a one-line reason that says what to do."""


# -- A1: the patch -----------------------------------------------------------------------------
def read_patch(path: Path) -> str:
    """The text of the patch file at `path` (`patch_text`), its size checked before it is read."""
    if path.stat().st_size > MAX_PATCH_BYTES:
        raise _too_large()
    return patch_text(path.read_bytes())


def _too_large() -> HandInError:
    return HandInError(f"{PATCH_NAME} is larger than {MAX_PATCH_BYTES >> 20} MiB: submit source changes only")


def patch_text(raw: bytes) -> str:
    """The patch's text; HandInError unless it is UTF-8 text without NUL bytes, within the size."""
    if len(raw) > MAX_PATCH_BYTES:
        raise _too_large()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HandInError(f"{PATCH_NAME} is not UTF-8 text (byte {e.start}): "
                          f"save it as UTF-8 (`git diff > {PATCH_NAME}` in a UTF-8 shell)") from None
    if "\x00" in text:
        raise HandInError(f"{PATCH_NAME} contains NUL bytes: it must be a text diff")
    return text


def _check_path(path: str) -> str | None:
    """The path relative to the kit (None for /dev/null), or HandInError if it may not change."""
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path:
        raise HandInError(f"{PATCH_NAME} touches {path!r}: absolute and '..' paths are not allowed")
    if not path.startswith(ALLOWED_ROOT) or not path.endswith(".py"):
        raise HandInError(
            f"{PATCH_NAME} touches {path!r}: only .py files under {ALLOWED_ROOT} may change "
            f"(make it with `git diff -- starter_code/onenode > {PATCH_NAME}`)"
        )
    return path


def check_patch(text: str) -> list[str]:
    """The files a patch changes; raises HandInError for anything but plain .py edits.

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
                raise HandInError(f"{PATCH_NAME} has a path with spaces ({line!r}): rename the file")
            changed.update(dict.fromkeys(filter(None, map(_check_path, parts))))
        elif line.startswith(("--- ", "+++ ")):
            changed.update(dict.fromkeys(filter(None, [_check_path(line[4:].split("\t")[0])])))
        elif line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
            raise HandInError(f"{PATCH_NAME} has a binary change: only text .py files may change")
        elif m := _GIT_HEADER_PATHS.match(line):
            changed[_check_path(m.group(3))] = None
        elif (m := _MODE_LINE.match(line)) and m.group(2) and m.group(2) not in _REGULAR_MODES:
            raise HandInError(f"{PATCH_NAME} sets file mode {m.group(2)} (a symlink or submodule): "
                              "only regular files may change")
    if text.strip() and not changed:
        raise HandInError(f"{PATCH_NAME} holds no diff: make it with `git diff > {PATCH_NAME}`")
    return list(changed)


def _git_apply(tree: Path, patch_file: Path, *extra: str) -> subprocess.CompletedProcess:
    # A ceiling stops git from finding an enclosing repository, where `git apply` would silently
    # skip the paths outside the current folder.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent.resolve()))
    return subprocess.run(
        ["git", "apply", "--whitespace=nowarn", *extra, str(patch_file.resolve())],
        cwd=tree, env=env, capture_output=True, text=True, timeout=60,
    )


def apply_patch(text: str, tree: Path) -> None:
    """Apply a patch to `tree`, a folder holding a clean `starter_code/` (`git apply --check`
    first); HandInError unless it applies and everything that then differs passes `check_applied`.
    The patch is written beside `tree`, as `<tree>.patch`."""
    patch_file = tree.parent / f"{tree.name}.patch"
    patch_file.write_text(text, encoding="utf-8")
    pristine = snapshot(tree)
    for extra in (("--check",), ()):
        result = _git_apply(tree, patch_file, *extra)
        if result.returncode != 0:
            lines = ([ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
                     or result.stderr.splitlines() or ["?"])
            reason = lines[0].removeprefix("error: ")
            raise HandInError(
                f"{PATCH_NAME} does not apply to this kit's starter_code ({reason}): "
                f"regenerate it with `git diff` against the current kit"
            )
    check_applied(pristine, snapshot(tree))


Entry = tuple[str, int, bytes]  # (kind, permission bits, a file's content or a link's target)


def snapshot(root: Path) -> dict[str, Entry]:
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
    """HandInError for the first path the applied patch changed that a submission may not:
    anything outside `starter_code/onenode/` or not a .py file there (written or deleted), a link
    or special file, an executable bit, or content that is not UTF-8 text without NUL bytes."""
    for path in sorted(pristine.keys() | applied.keys()):
        before, after = pristine.get(path), applied.get(path)
        if before == after:
            continue
        if not (path.startswith(ALLOWED_ROOT) and path.endswith(".py")):
            raise HandInError(f"{PATCH_NAME} {'deletes' if after is None else 'writes'} {path!r} when applied: "
                              f"only .py files under {ALLOWED_ROOT} may change ({_REMAKE})")
        if after is None:
            continue  # a .py file of the student's package removed
        kind, bits, data = after
        if kind != "regular file":
            raise HandInError(f"{PATCH_NAME} makes {path!r} a {kind} when applied: "
                              f"only regular files may change ({_REMAKE})")
        was = _git_mode(before[1]) if before else "100644"
        if _git_mode(bits) != was:
            raise HandInError(f"{PATCH_NAME} changes the mode of {path!r} ({was} -> {_git_mode(bits)}) when "
                              "applied: only contents may change (`chmod -x` it and make the patch again)")
        if not _is_text(data):
            raise HandInError(f"{PATCH_NAME} makes {path!r} binary when applied: "
                              "only UTF-8 Python source may change")


# -- A2: the run folder ------------------------------------------------------------------------
@dataclass(frozen=True)
class HandIn:
    """One entry of an A2 submission: its name in the handout's table, what it is (Markdown),
    and the path (a glob) whose presence says it is there."""

    name: str
    what: str
    found_by: str

    def found_in(self, folder: Path) -> bool:
        return any(path.is_file() and not path.is_symlink() for path in folder.glob(self.found_by))


A2_HAND_IN = (
    HandIn("final/", "the model in the transformers layout (`config.json`, safetensors), `run_manifest.json`, "
                     "and its tokenizer (`tokenizer.json` or `onenode_tokenizer.json`)", "final/config.json"),
    HandIn("checkpoints/", "every checkpoint of the run, from `step_00000000`: the chain the grader replays",
           "checkpoints/step_*/meta.json"),
    HandIn("recipe.yaml", "the recipe as the run resolved it", "recipe.yaml"),
    HandIn("run_manifest.json", "tokens seen, steps, parameters, model config, data-order digest", "run_manifest.json"),
    HandIn("metrics.jsonl", "the training log", "metrics.jsonl"),
    HandIn(NOTEBOOK_NAME, "the report, run", NOTEBOOK_NAME),
    HandIn("data/", "the data folder the run trained on: `manifest.json`, its tokenizer and every "
                    "`<source>/train.bin` with its index (none for synthetic tokens)", "data/manifest.json"),
)
A2_RUN = tuple(item for item in A2_HAND_IN if item.name not in (NOTEBOOK_NAME, "data/"))  # what `onenode train` wrote


def hand_in_table(items: tuple[HandIn, ...] = A2_HAND_IN) -> list[str]:
    """The Markdown table of `items`, as the handout and the release README show it."""
    return ["| file | what |", "| --- | --- |", *(f"| `{item.name}` | {item.what} |" for item in items)]


def trains_on_data(recipe: Path) -> bool:
    """Whether the recipe at `recipe` trains on a data folder (not synthetic tokens); False for
    one that does not load, which the grader's audit reports on its own."""
    from .train.recipe import RecipeError, load_recipe

    try:
        return load_recipe(recipe).data.source != "synthetic"
    except (RecipeError, OSError):
        return False


def a2_missing(folder: Path, notebook: bool = True) -> list[str]:
    """The entries of `A2_HAND_IN` that `folder` lacks, each by the path that was not found:
    data/ only where the run's recipe trains on a data folder, report.ipynb only with `notebook`."""
    missing = []
    for item in A2_HAND_IN:
        if (item.name == NOTEBOOK_NAME and not notebook) or (
                item.name == "data/" and not trains_on_data(folder / "recipe.yaml")):
            continue
        if not item.found_in(folder):
            missing.append(item.found_by)
    return missing


def a2_incomplete(missing: list[str]) -> str:
    """The one line that refuses a folder lacking `missing`."""
    return (f"the A2 submission lacks {', '.join(missing)}: hand in the run folder `onenode train` wrote, the data "
            f"folder it trained on as data/ and {NOTEBOOK_NAME} (`onenode pack a2 RUN --out DIR` checks and copies "
            "them)")
