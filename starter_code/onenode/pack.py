"""`onenode pack`: the submission the grader takes, checked by the grader's own rules first.

    onenode pack a1                                   # from the repository root: writes submission.tar.gz
    onenode pack a2 runs/mine --out submission         # the run, its data folder and report.ipynb

A1 (the repository root must be a git repository whose first commit is the handout, as the
handout's set-up makes it): the patch of `starter_code/onenode/` against the handout's commit,
new files included (your git index is left alone), is checked by the rule the grader applies
(`onenode.handin`): applied to a clean copy of the handout's `starter_code/`, it may change only
.py files there. Then the public tests (`a1_infra/tests`) run against this tree, and the archive
is written whether they pass or not (each part is graded on its own): `submission/` holding
`submission.patch` and `report.ipynb`.

A2: the run folder must hold what `onenode train` wrote (`onenode.handin.A2_HAND_IN`, the
handout's table); the data folder its recipe trained on is found as the trainer found it (from
this folder, or --data), and the run, the data and the report are copied into OUT, which is then
checked as the grader's intake checks it. Hand OUT in as it is.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .handin import (
    A2_RUN,
    NOTEBOOK_NAME,
    PATCH_NAME,
    HandInError,
    a2_incomplete,
    a2_missing,
    apply_patch,
    check_patch,
    patch_text,
    trains_on_data,
)

A1_TESTS = "a1_infra/tests"
STARTER = "starter_code/onenode"
ARCHIVE_FOLDER = "submission"  # the one top-level folder of the A1 archive


def register(subparsers) -> None:
    parser = subparsers.add_parser("pack", help="check a submission as the grader does and pack it",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_subparsers(dest="assignment", metavar="ASSIGNMENT", required=True)
    a1 = which.add_parser("a1", help="submission.patch + report.ipynb, after the public tests")
    a1.add_argument("--out", default="submission.tar.gz", help="the archive to write (default: submission.tar.gz)")
    a1.add_argument("--report", default=NOTEBOOK_NAME, help=f"the report notebook (default: {NOTEBOOK_NAME})")
    a1.add_argument("--handout", default=None,
                    help="the commit of the unchanged handout (default: the repository's first commit)")
    a1.add_argument("--skip-tests", action="store_true", help="do not run the public tests first")
    a1.set_defaults(func=_run_a1)
    a2 = which.add_parser("a2", help="a run folder, its data folder and report.ipynb, as one folder")
    a2.add_argument("run", help="the run folder `onenode train --out` wrote")
    a2.add_argument("--out", required=True, help="the submission folder to write (new or empty)")
    a2.add_argument("--report", default=NOTEBOOK_NAME, help=f"the report notebook (default: {NOTEBOOK_NAME})")
    a2.add_argument("--data", default=None,
                    help="the data folder the run trained on (default: the one its recipe names, from here)")
    a2.set_defaults(func=_run_a2)


def _refused(args: argparse.Namespace, pack) -> int:
    try:
        print(pack())
    except HandInError as e:
        print(f"onenode pack {args.assignment}: {e}", file=sys.stderr)
        return 1
    return 0


def _run_a1(args: argparse.Namespace) -> int:
    return _refused(args, lambda: pack_a1(Path.cwd(), Path(args.out), Path(args.report), args.handout,
                                          run_tests=not args.skip_tests))


def _run_a2(args: argparse.Namespace) -> int:
    return _refused(args, lambda: pack_a2(Path(args.run), Path(args.out), Path(args.report),
                                          Path(args.data) if args.data else None))


# -- A1 ----------------------------------------------------------------------------------------
def _git(root: Path, *args: str, index: Path | None = None) -> bytes:
    """git's output in `root`, with `index` as its index; HandInError with git's last line on failure."""
    env = dict(os.environ, **({"GIT_INDEX_FILE": str(index)} if index else {}))
    done = subprocess.run(["git", *args], cwd=root, env=env, capture_output=True)
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines() or ["?"]
        raise HandInError(f"`git {args[0]}` failed in {root} ({said[-1]}): run it from the repository root "
                          "the handout set up (`git init -q && git add -A && git commit -qm handout`)")
    return done.stdout


def handout_commit(root: Path, given: str | None) -> str:
    """The commit of the unchanged handout: `given`, or the repository's only root commit."""
    top = Path(_git(root, "rev-parse", "--show-toplevel").decode().strip())
    if top.resolve() != root.resolve():
        raise HandInError(f"{root} is inside the repository {top}, not its root: run it from {top}")
    if given:
        return _git(root, "rev-parse", "--verify", f"{given}^{{commit}}").decode().strip()
    roots = _git(root, "rev-list", "--max-parents=0", "HEAD").decode().split()
    if len(roots) != 1:
        raise HandInError(f"the repository has {len(roots)} first commits: name the handout's with --handout REV")
    return roots[0]


def make_patch(root: Path, handout: str) -> bytes:
    """`git diff` of `starter_code/onenode/` from the handout's commit to the files as they are
    now (new files included, ignored ones not), through a scratch index: the repository's own
    index, its config's diff options and external diff tools play no part."""
    with tempfile.TemporaryDirectory(prefix="onenode-pack-") as scratch:
        index = Path(scratch) / "index"
        _git(root, "read-tree", handout, index=index)
        _git(root, "add", "-A", "--", STARTER, index=index)
        return _git(root, "diff", "--cached", "--no-renames", "--no-color", "--no-ext-diff", "--no-textconv",
                    "--no-relative", "--src-prefix=a/", "--dst-prefix=b/", handout, "--", STARTER, index=index)


def check_applies(root: Path, handout: str, text: str) -> None:
    """The grader's check: the patch applied to a clean copy of the handout's starter_code."""
    with tempfile.TemporaryDirectory(prefix="onenode-pack-") as scratch:
        clean = Path(scratch) / "clean"
        clean.mkdir()
        tar = _git(root, "archive", "--format=tar", handout, "starter_code")
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(clean, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        apply_patch(text, clean)


def check_notebook(path: Path) -> None:
    """HandInError unless `path` is a notebook file (JSON with cells)."""
    if not path.is_file():
        raise HandInError(f"{path} not found: run the report and save it, or pass --report PATH")
    try:
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        cells = None
    if not isinstance(cells, list):
        raise HandInError(f"{path} is not a Jupyter notebook: hand in the {NOTEBOOK_NAME} of the handout, run")


def run_public_tests(root: Path, tests: str = A1_TESTS) -> str:
    """Run the public tests against this tree's `starter_code` (their output goes to the
    terminal); one line saying how they went."""
    if not (root / tests).is_dir():
        return f"no {tests}/ here: the public tests were not run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root / "starter_code"),
                                                                    os.environ.get("PYTHONPATH")])))
    print(f"running the public tests: {sys.executable} -m pytest -q {tests}", flush=True)
    code = subprocess.run([sys.executable, "-m", "pytest", "-q", tests], cwd=root, env=env).returncode
    return {0: "the public tests pass",
            1: "some public tests fail (above): packed anyway, each part is graded on its own"}.get(
        code, f"the public tests did not run to the end (pytest exit {code}, above)")


def pack_a1(root: Path, out: Path, report: Path, handout: str | None = None, run_tests: bool = True) -> str:
    """Check the A1 submission of the repository at `root` as the grader would, run the public
    tests, write the archive at `out`; what was written, in a few lines."""
    root = root.resolve()
    report, out = root / report, root / out
    if not (root / STARTER).is_dir():
        raise HandInError(f"no {STARTER}/ in {root}: run it from the repository root")
    check_notebook(report)
    commit = handout_commit(root, handout)
    text = patch_text(make_patch(root, commit))
    changed = check_patch(text)
    if not changed:
        raise HandInError(f"{STARTER}/ is as the handout left it (commit {commit[:12]}): nothing to hand in "
                          "(or name the handout's commit with --handout REV)")
    check_applies(root, commit, text)
    tests = run_public_tests(root) if run_tests else "the public tests were skipped (--skip-tests)"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    with tarfile.open(partial, "w:gz") as archive:
        for name, data in ((PATCH_NAME, text.encode("utf-8")), (NOTEBOOK_NAME, report.read_bytes())):
            member = tarfile.TarInfo(f"{ARCHIVE_FOLDER}/{name}")
            member.size, member.mode, member.mtime = len(data), 0o644, int(time.time())
            archive.addfile(member, io.BytesIO(data))
    partial.replace(out)
    return "\n".join([tests, f"{PATCH_NAME} changes {len(changed)} files against the handout ({commit[:12]}), "
                             "and applies to a clean copy of it:", *(f"  {path}" for path in changed),
                      f"wrote {out} ({PATCH_NAME} and {NOTEBOOK_NAME}): hand it in"])


# -- A2 ----------------------------------------------------------------------------------------
def copy_a2(run: Path, out: Path, report: Path, data: Path | None) -> Path:
    """The submission folder at `out`: what `run` holds of a run (with a DiLoCo run's other replica
    groups, `replica_*/`), `report` and `data` (without its raw text, which nothing reads); no checks."""
    out.mkdir(parents=True, exist_ok=True)
    for item in A2_RUN:
        source = run / item.name.rstrip("/")
        if source.is_dir():
            shutil.copytree(source, out / item.name.rstrip("/"))
        elif source.is_file():
            shutil.copy2(source, out / item.name)
    for group in sorted(run.glob("replica_*")):  # the grader replays every group's chain
        if group.is_dir():
            shutil.copytree(group, out / group.name, ignore=shutil.ignore_patterns("tensorboard"))
    shutil.copy2(report, out / NOTEBOOK_NAME)
    if data is not None:
        shutil.copytree(data, out / "data", ignore=shutil.ignore_patterns("text"))
    return out


def trained_data(run: Path, given: Path | None) -> Path | None:
    """The data folder the run trained on: `given`, or the one its recipe names, found from
    here as the trainer found it; None for synthetic tokens."""
    from .eval.model import recipe_data_dir
    from .train.recipe import load_recipe

    if not trains_on_data(run / "recipe.yaml"):
        return None
    data = given or recipe_data_dir(load_recipe(run / "recipe.yaml"))
    if not (data / "manifest.json").is_file():
        raise HandInError(f"{data} has no manifest.json: pass the data folder the run trained on with --data DIR")
    return data


def pack_a2(run: Path, out: Path, report: Path, data: Path | None = None) -> str:
    """Check the run folder `run`, copy it with its data folder and `report` into `out`, and
    check `out` as the grader's intake does; what was written, in a few lines."""
    if not run.is_dir():
        raise HandInError(f"{run} is not a folder: pass the run folder `onenode train --out` wrote")
    missing = [item.found_by for item in A2_RUN if not item.found_in(run)]
    if missing:
        raise HandInError(f"{run} lacks {', '.join(missing)}: pass the whole run folder `onenode train` wrote")
    check_notebook(report)
    data = trained_data(run, data)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HandInError(f"{out} exists and is not an empty folder: name a new one with --out")
    copy_a2(run, out, report, data)
    missing = a2_missing(out)
    if missing:
        raise HandInError(a2_incomplete(missing))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    groups = sorted(path.name for path in out.glob("replica_*"))
    others = f" (with DiLoCo's other replica groups: {', '.join(groups)})" if groups else ""
    return (f"wrote {out}: the run of {run}{others}, "
            f"{'its data folder ' + str(data) if data else 'no data (synthetic tokens)'}"
            f" and {report.name}, {size / 2**30:.2f} GiB: hand it in as it is, as the course says")
