"""Grade one submission or a whole cohort of any assignment, resumably; cohort.csv and the table.

Each submission is graded into a hidden folder beside its final place and moved there in one
`os.replace`, so `OUT/<name>/` either holds a complete result or does not exist: a re-run skips
what is done (unless `force`), re-grades whatever was interrupted, and nothing is graded twice.
A submission that crashes, hangs or runs out of memory gets its zero and its reason; the
cohort goes on. Only a `GraderError` (the kit or the machine is broken) stops it.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

from .assignment import Assignment, Job
from .errors import GraderError, SubmissionError
from .report import environment, one_traceback, results_json, student_paths, write_submission_results
from .submission import ARCHIVE_SUFFIXES, submission_name

PARTIAL = ".partial-"


def find_submissions(cohort: Path, archives: bool = True) -> list[Path]:
    """Every submission folder (or archive, if `archives`) directly inside `cohort`, hidden entries skipped."""
    if not cohort.is_dir():
        raise FileNotFoundError(f"{cohort} is not a folder: pass the folder that holds one entry per submission")
    found = sorted(p for p in cohort.iterdir() if not p.name.startswith(".")
                   and (p.is_dir() or archives and p.name.endswith(ARCHIVE_SUFFIXES)))
    names = [submission_name(p) for p in found]
    clashes = {n for n in names if names.count(n) > 1}
    if clashes:
        raise ValueError(f"two submissions share the name {sorted(clashes)[0]!r} (a folder and an archive?): keep one")
    return found


def is_done(out: Path, name: str) -> bool:
    try:
        results = json.loads((out / name / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return not results.get("extra_data", {}).get("grader_error")


def _finite(numbers: dict) -> dict:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in numbers.items()}


def grade_one(assignment: Assignment, path: Path, job: Job, out: Path) -> dict:
    """Grade one submission into `out/<name>/` (atomically) and return its results."""
    start = time.monotonic()
    name = submission_name(path)
    work = job.workdir / "submissions" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{name}-", dir=out))
    logs = staging / "logs"
    logs.mkdir()
    extra = {"assignment": assignment.label, "profile": job.profile.name, "seed": job.seed}
    failures: dict[str, str] = {}
    try:
        graded = assignment.grade(job, path, work, logs)
        tests, leaderboard, failures, output = graded.tests, graded.leaderboard, graded.failures, graded.output
        extra.update(numbers=_finite(graded.measurements), **graded.extra_data)
    except SubmissionError as e:
        tests, leaderboard, output = job.rubric.zero_tests(f"not graded: {e}"), [], f"Not graded: {e}"
        extra["not_graded"] = str(e)
    except GraderError:
        raise
    except Exception as e:  # a grader bug must not cost the cohort: record it, re-grade on resume
        (logs / "grader-error.txt").write_text(traceback.format_exc())
        tests, leaderboard = job.rubric.zero_tests("grader error (not your fault): a TA will re-grade"), []
        output = f"Grader error (not your fault): {type(e).__name__}: {e}"
        extra["grader_error"] = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tests = [dict(t, output=student_paths(t["output"])) for t in tests]
    failures = {run: student_paths(one_traceback(text)) for run, text in failures.items()}
    results = results_json(name, tests, leaderboard, time.monotonic() - start, student_paths(output), extra)
    write_submission_results(staging, results, failures, environment(job.profile, job.seed))
    publish(staging, out / name)
    return results


def publish(staging: Path, final: Path) -> None:
    """Put a finished folder in its place in one step, replacing an older one."""
    if final.exists():
        old = final.with_name(f"{PARTIAL}{final.name}-old-{os.getpid()}")
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)


def grade_cohort(assignment: Assignment, cohort: Path, job: Job, out: Path, force: bool = False,
                 progress: bool = True) -> list[dict]:
    """Grade every submission in `cohort` not yet done in `out`; write `out/cohort.csv`."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{PARTIAL}*"):  # left by an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    submissions = find_submissions(cohort, assignment.archives)
    pending = [p for p in submissions if force or not is_done(out, submission_name(p))]
    bar = tqdm(pending, desc="grading", unit="submission", disable=not progress)
    for path in bar:
        bar.set_postfix_str(submission_name(path))
        grade_one(assignment, path, job, out)
    results = [json.loads((out / submission_name(p) / "results.json").read_text()) for p in submissions]
    write_cohort_csv(assignment, out / "cohort.csv", results)
    return results


def not_graded(results: dict) -> str | None:
    """Why a submission has no grade, in one line (None: it was graded, whatever it scored): its
    intake refused it (`SubmissionError`), or the grader failed on it (a TA re-grades it)."""
    extra = results["extra_data"]
    if extra.get("grader_error"):
        return results["output"]
    return extra.get("not_graded")


def cohort_rows(assignment: Assignment, results: list[dict]) -> list[dict]:
    """One cohort.csv row per results.json: who, whether it was graded, the score, the
    assignment's columns, a note."""
    rows = []
    for r in results:
        extra = r["extra_data"]
        rows.append({"name": extra["submission"], "graded": not_graded(r) is None, "score": r["score"],
                     "max_score": extra["max_score"], **assignment.csv_columns(r),
                     "note": r["output"].splitlines()[0] if r["output"] else ""})
    return rows


def write_cohort_csv(assignment: Assignment, path: Path, results: list[dict]) -> None:
    """cohort.csv, written whole or not at all."""
    rows = cohort_rows(assignment, results)
    buffer = io.StringIO()
    if rows:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(buffer, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    os.replace(tmp, path)


def table(assignment: Assignment, results: list[dict]) -> str:
    """A plain-text table of a cohort for the terminal, columns padded to their widest cell."""
    lines = assignment.table(cohort_rows(assignment, results))
    widths = [max(len(cell) for cell in column) for column in zip(*lines)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def short_note(note: str, width: int = 60) -> str:
    """A table cell's note: whole, or cut at a word with "…" (the whole one is in results.json)."""
    return textwrap.shorten(note, width, placeholder=" …")


def not_graded_lines(results: list[dict], width: int | None = None) -> list[str]:
    """Each submission that has no grade and why, its reason whole, wrapped at words (a path or a
    command stays on one line) to `width` (the terminal's)."""
    width = width or shutil.get_terminal_size().columns
    lines = []
    for r in results:
        if (reason := not_graded(r)) is not None:
            lines += textwrap.wrap(f"{r['extra_data']['submission']}: {reason}", max(width, 40), initial_indent="  ",
                                   subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
    return lines
