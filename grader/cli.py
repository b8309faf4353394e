"""`onenode-grade`: the TA's command line.

    onenode-grade a1 SUBMISSION --profile cpu-tiny --out DIR   # one folder or archive
    onenode-grade a1 --cohort DIR --profile h100x8 --out DIR   # every submission in DIR, resumable
    onenode-grade demo --out DIR                               # the example cohort on CPU
    onenode-grade release a1 --out DIR --course COURSE         # the student repository + nbgrader course
    onenode-grade export --course COURSE --results DIR --csv FILE   # grade sheet: parts + notebook
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .rubric import RUBRIC_PATH, load_rubric

STARTER_LOGS = ".starter-logs"


def _job(args):
    """The job: a private scratch folder, the starter's logs in OUT/.starter-logs."""
    from .a1.scoring import new_job
    from .sandbox import make_private

    rubric = load_rubric(args.rubric)
    workdir = make_private(tempfile.mkdtemp(prefix="onenode-grade-"))
    return new_job(rubric, args.profile, workdir, Path(args.out) / STARTER_LOGS, seed=args.seed,
                   notebooks=not args.no_notebook)


def _run_a1(args) -> int:
    from .cohort import grade_cohort, grade_one, table
    from .errors import GraderError

    if (args.submission is None) == (args.cohort is None):
        raise SystemExit("onenode-grade a1: pass either one SUBMISSION or --cohort DIR")
    job = _job(args)
    out = Path(args.out)
    start = time.monotonic()
    try:
        if args.cohort:
            results = grade_cohort(Path(args.cohort), job, out, force=args.force, progress=not args.quiet)
            print(table(results))
            print(f"{len(results)} submissions graded on {job.profile.name} (seed {job.seed}) in "
                  f"{time.monotonic() - start:.0f} s: {out / 'cohort.csv'}")
        else:
            results = grade_one(Path(args.submission), job, out)
            print(table([results]))
            print(f"graded on {job.profile.name} (seed {job.seed}) in {time.monotonic() - start:.0f} s: "
                  f"{out / results['extra_data']['submission']}")
    except GraderError as e:
        print(f"onenode-grade: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(job.workdir, ignore_errors=True)
    return 0


def _run_demo(args) -> int:
    from .a1.demo import build_cohort

    out = Path(args.out)
    build_cohort(out / "cohort")
    args.cohort, args.submission, args.out = str(out / "cohort"), None, str(out / "results")
    return _run_a1(args)


# -- release and export: grader/release.py, grader/export.py ----------------------------------
def _run_release(args) -> int:
    from .errors import GraderError
    from .release import release

    try:
        out = release(args.assignment, Path(args.out), Path(args.course), force=args.force)
    except GraderError as e:
        print(f"onenode-grade: {e}", file=sys.stderr)
        return 1
    print(f"{args.assignment} student repository: {out}\nnbgrader course (TAs only): {Path(args.course).resolve()}")
    return 0


def _run_export(args) -> int:
    from .errors import GraderError
    from .export import export

    try:
        rows = export(Path(args.course), Path(args.results), Path(args.csv), args.assignment)
    except GraderError as e:
        print(f"onenode-grade: {e}", file=sys.stderr)
        return 1
    pending = sum(1 for row in rows if row["needs_manual_grade"] is True)
    print(f"{len(rows)} students: {args.csv}" + (f" ({pending} with written answers still to grade)" if pending else ""))
    return 0


def _add_release_export(sub) -> None:
    release = sub.add_parser("release", help="build the student repository of an assignment and its nbgrader course")
    release.add_argument("assignment", choices=["a1", "a2"])
    release.add_argument("--out", required=True, help="the student repository to create")
    release.add_argument("--course", required=True,
                         help="nbgrader course working folder for TAs (gradebook.db, source/, release/); keep it private")
    release.add_argument("--force", action="store_true", help="replace a non-empty --out")
    release.set_defaults(func=_run_release)
    export = sub.add_parser("export", help="grade sheet: autograder results merged with the nbgrader gradebook")
    export.add_argument("--course", required=True, help="the course folder made by `release`")
    export.add_argument("--results", required=True, help="the --out folder of `onenode-grade a1`")
    export.add_argument("--csv", required=True, help="the merged grade sheet to write")
    export.add_argument("--assignment", default="a1", choices=["a1", "a2"])
    export.set_defaults(func=_run_export)


def _common(parser: argparse.ArgumentParser, profile: str | None) -> None:
    parser.add_argument("--out", required=True, help="output folder (one subfolder per submission)")
    parser.add_argument("--profile", default=profile, required=profile is None,
                        help="hardware profile of the rubric: cpu-tiny, h200x1, h200x2, h100x8")
    parser.add_argument("--seed", type=int, default=None, help="grading seed (default: random, recorded in results)")
    parser.add_argument("--force", action="store_true", help="re-grade submissions already graded in --out")
    parser.add_argument("--rubric", default=str(RUBRIC_PATH), help="rubric TOML (default: a1_infra/rubric.toml)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-notebook", action="store_true",
                        help="grade the code parts only (e.g. on a GPU node without nbgrader); grade notebooks elsewhere")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onenode-grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    a1 = sub.add_parser("a1", help="grade A1 submissions (a folder or archive, or a cohort)")
    a1.add_argument("submission", nargs="?", help="submission folder or .zip/.tar.gz archive")
    a1.add_argument("--cohort", help="folder with one submission (folder or archive) per entry")
    _common(a1, None)
    a1.set_defaults(func=_run_a1)
    demo = sub.add_parser("demo", help="build the example cohort from solutions/a1 and grade it on CPU")
    _common(demo, "cpu-tiny")
    demo.set_defaults(func=_run_demo)
    _add_release_export(sub)
    # A2 grading and the cohort leaderboard live in their own modules (grader/a2.py, grader/leaderboard.py).
    from . import a2, leaderboard

    a2.register(sub)
    leaderboard.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Tools installed beside this interpreter (nbgrader's alembic) must be found from an
    # unactivated venv too, as in `make demo`.
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (KeyError, FileNotFoundError, ValueError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"onenode-grade: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
