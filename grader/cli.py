"""`onenode-grade`: the TA's command line.

    onenode-grade a1 SUBMISSION --profile cpu-tiny --out DIR   # one folder or archive
    onenode-grade a1 --cohort DIR --profile h100x8 --out DIR   # every submission in DIR, resumable
    onenode-grade a2 --cohort DIR --profile cpu-tiny --out DIR # A2 run folders, against the baseline
    onenode-grade a2 RUN --profile h200x1 --out DIR --verify-only   # an A2 run's verification alone
    onenode-grade demo [NAME] --out DIR                        # an example cohort (the first: A1's) on CPU
    onenode-grade release a1 --out DIR --course COURSE         # the student repository + nbgrader course
    onenode-grade export --course COURSE --results DIR --csv FILE   # grade sheet: parts + notebook
    onenode-grade leaderboard --cohort DIR --cohort DIR --out SITE  # the cohorts as a static page
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from . import hints
from .assignment import Assignment
from .errors import GraderError
from .registry import ASSIGNMENTS
from .rubric import KIT_ROOT

EXIT_GRADED, EXIT_NOT_GRADED, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 3
EXIT_CODES = """Exit status of `onenode-grade a1`, `a2` and `demo` (a score of 0 is a grade):
    0  every submission graded
    1  a submission could not be graded: each one's reason is printed below the table, whole, and
       its results.json holds zeros with that reason (extra_data.not_graded, or grader_error)
    2  usage error: an unknown option or profile, a --cohort folder that does not exist
    3  grading stopped: the kit or this machine cannot grade (see the message); re-run once fixed,
       graded submissions are kept
"""


def _run_grading(assignment: Assignment, args) -> int:
    """`onenode-grade NAME`: one submission or a cohort, in a private scratch folder."""
    from .cohort import grade_cohort, grade_one, not_graded, not_graded_lines, table
    from .sandbox import make_private

    if (args.submission is None) == (args.cohort is None):
        raise ValueError(f"{assignment.name}: pass either one SUBMISSION or --cohort DIR")
    rubric = assignment.load_rubric(args.rubric)
    rubric.profile(args.profile)  # an unknown profile fails before anything is made
    workdir = make_private(tempfile.mkdtemp(prefix=f"onenode-grade-{assignment.name}-"))
    out = Path(args.out)
    start = time.monotonic()
    try:
        job = assignment.new_job(rubric, args.profile, workdir, args)
        if args.cohort:
            results = grade_cohort(assignment, Path(args.cohort), job, out, force=args.force, progress=not args.quiet)
            where = out / "cohort.csv"
        else:
            results = [grade_one(assignment, Path(args.submission), job, out)]
            where = out / results[0]["extra_data"]["submission"]
    except GraderError as e:
        print(f"onenode-grade: grading stopped: {e}", file=sys.stderr)
        return EXIT_STOPPED
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(assignment, results))
    graded = sum(not_graded(r) is None for r in results)
    if graded < len(results):
        print("Not graded (their zeros are not grades):\n" + "\n".join(not_graded_lines(results)))
    print(f"{graded} of {len(results)} submissions graded on {job.profile.name} (seed {job.seed}) in "
          f"{time.monotonic() - start:.0f} s: {where}")
    return EXIT_GRADED if graded == len(results) else EXIT_NOT_GRADED


def _run_demo(args) -> int:
    """`onenode-grade demo NAME`: build NAME's example cohort in OUT/cohort, grade it into OUT/results."""
    assignment = ASSIGNMENTS[args.assignment]
    out = Path(args.out)
    assignment.demo.build_cohort(out / "cohort")
    args.cohort, args.submission, args.out = str(out / "cohort"), None, str(out / "results")
    args.profile = args.profile or assignment.demo.profile
    args.rubric = args.rubric or str(assignment.rubric_path)
    return _run_grading(assignment, args)


def _grading_options(parser: argparse.ArgumentParser, assignment: Assignment, profile: str | None) -> None:
    """What every assignment's command takes, then the assignment's own options."""
    profiles = ", ".join(assignment.load_rubric(assignment.rubric_path).profiles)
    parser.add_argument("--out", required=True, help="output folder (one subfolder per submission)")
    parser.add_argument("--profile", default=profile, required=profile is None,
                        help=f"hardware profile of the rubric: {profiles}")
    parser.add_argument("--force", action="store_true", help="re-grade submissions already graded in --out")
    rubric = assignment.rubric_path
    shown = rubric.relative_to(KIT_ROOT) if rubric.is_relative_to(KIT_ROOT) else rubric
    parser.add_argument("--rubric", default=str(rubric), help=f"rubric TOML (default: {shown})")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-notebook", action="store_true",
                        help="grade everything but report.ipynb (e.g. on a GPU node without nbgrader); "
                             "grade notebooks elsewhere")
    assignment.add_options(parser)


def _add_grading(sub) -> None:
    for assignment in ASSIGNMENTS.values():
        parser = sub.add_parser(assignment.name, help=assignment.help, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("submission", nargs="?", help=assignment.submission_help)
        parser.add_argument("--cohort", help="folder with one submission per entry")
        _grading_options(parser, assignment, None)
        parser.set_defaults(func=partial(_run_grading, assignment))


def _add_demo(sub) -> None:
    """`onenode-grade demo [NAME]` for the assignments that have an example cohort, the first by
    default; --profile and --rubric default to the chosen one's."""
    demos = [a for a in ASSIGNMENTS.values() if a.demo is not None]
    if not demos:
        return
    demo = sub.add_parser("demo", help=f"build an example cohort and grade it (default: {demos[0].name})",
                          description="\n".join(f"{a.name}: {a.demo.help}" for a in demos),
                          epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
                          conflict_handler="resolve")  # two assignments may add the same option
    demo.add_argument("assignment", nargs="?", choices=[a.name for a in demos], default=demos[0].name,
                      help=f"whose example cohort (default: {demos[0].name}); --profile defaults to its own")
    for assignment in reversed(demos):  # the default's options and help come last and win
        _grading_options(demo, assignment, assignment.demo.profile)
    demo.set_defaults(func=_run_demo, profile=None, rubric=None)


# -- release and export: grader/release.py, grader/export.py ----------------------------------
def _run_release(args) -> int:
    from .release import release

    try:
        out = release(ASSIGNMENTS[args.assignment], Path(args.out), Path(args.course), force=args.force)
    except GraderError as e:
        print(f"onenode-grade: {e}", file=sys.stderr)
        return 1
    print(f"{args.assignment} student repository: {out}\nnbgrader course (TAs only): {Path(args.course).resolve()}")
    return 0


def _run_export(args) -> int:
    from .export import export

    try:
        rows = export(Path(args.course), Path(args.results), Path(args.csv), args.assignment)
    except GraderError as e:
        print(f"onenode-grade: {e}", file=sys.stderr)
        return 1
    pending = sum(1 for row in rows if row["needs_manual_grade"] is True)
    still = f" ({pending} with written answers still to grade)" if pending else ""
    print(f"{len(rows)} students: {args.csv}{still}")
    return 0


def _add_release_export(sub) -> None:
    release = sub.add_parser("release", help="build the student repository of an assignment and its nbgrader course")
    release.add_argument("assignment", choices=list(ASSIGNMENTS))
    release.add_argument("--out", required=True, help="the student repository to create")
    release.add_argument("--course", required=True,
                         help="nbgrader course working folder for TAs (gradebook.db, source/, release/); "
                              "keep it private")
    release.add_argument("--force", action="store_true", help="replace a non-empty --out")
    release.set_defaults(func=_run_release)
    export = sub.add_parser("export", help="grade sheet: autograder results merged with the nbgrader gradebook")
    export.add_argument("--course", required=True, help="the course folder made by `release`")
    export.add_argument("--results", required=True, help="the --out folder of `onenode-grade NAME`")
    export.add_argument("--csv", required=True, help="the merged grade sheet to write")
    export.add_argument("--assignment", default=None, choices=list(ASSIGNMENTS),
                        help="the assignment graded (default: the one the results name)")
    export.set_defaults(func=_run_export)


# -- the leaderboard: grader/leaderboard.py ---------------------------------------------------
def _run_leaderboard(args) -> int:
    from .leaderboard import build_site

    page = build_site([Path(c) for c in args.cohort], Path(args.out), list(ASSIGNMENTS.values()))
    print(f"leaderboard: {page} (open it in a browser; no server needed)")
    return 0


def _add_leaderboard(sub) -> None:
    parser = sub.add_parser("leaderboard", help="the cohort's results as a static site (HTML + PNG + Markdown)")
    parser.add_argument("--cohort", action="append", required=True,
                        help="a results folder of `onenode-grade NAME` (repeatable)")
    parser.add_argument("--out", required=True, help="site folder to write (index.html, leaderboard.md, *.png)")
    parser.set_defaults(func=_run_leaderboard)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onenode-grade", description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_grading(sub)
    _add_demo(sub)
    _add_release_export(sub)
    _add_leaderboard(sub)
    hints.register(sub, ASSIGNMENTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except (KeyError, FileNotFoundError, ValueError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"onenode-grade: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
