"""Grade one submission or a whole cohort, resumably.

Each submission is graded into a hidden folder beside its final place and moved there in one
`os.replace`, so `OUT/<name>/` either holds a complete result or does not exist: a re-run skips
what is done (unless `force`), re-grades whatever was interrupted, and nothing is graded twice.
A submission that crashes, hangs or runs out of memory gets its zero and its reason; the
cohort goes on.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

from .a1.scoring import Job, grade, zero_tests
from .errors import GraderError, SubmissionError
from .report import environment, results_json, write_submission_results
from .submission import ARCHIVE_SUFFIXES, load_submission, patched_tree, submission_name

CSV_NUMBERS = ("moe_speedup", "ep_tokens_per_s", "ep_step_speedup", "expert_allgather_ratio", "pp_tokens_per_s")
_PARTIAL = ".partial-"


def find_submissions(cohort: Path) -> list[Path]:
    """Every submission folder or archive directly inside `cohort` (hidden entries skipped)."""
    if not cohort.is_dir():
        raise FileNotFoundError(f"{cohort} is not a folder: pass the folder that holds one entry per submission")
    found = sorted(p for p in cohort.iterdir() if not p.name.startswith(".")
                   and (p.is_dir() or p.name.endswith(ARCHIVE_SUFFIXES)))
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


def grade_one(path: Path, job: Job, out: Path) -> dict:
    """Grade one submission into `out/<name>/` (atomically) and return its results."""
    start = time.monotonic()
    name = submission_name(path)
    work = job.workdir / "submissions" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{_PARTIAL}{name}-", dir=out))
    logs = staging / "logs"
    logs.mkdir()
    extra = {"profile": job.profile.name, "seed": job.seed}
    failures: dict[str, str] = {}
    try:
        submission = load_submission(path, work)
        tree = patched_tree(submission, work / "tree")
        ctx = grade(job, submission, tree, logs)
        tests, leaderboard, failures, output = ctx.tests, ctx.leaderboard, ctx.failures, ""
        extra.update(numbers=_finite(ctx.numbers), changed_files=submission.changed_files)
    except SubmissionError as e:
        tests, leaderboard, output = zero_tests(job.rubric, f"not graded: {e}"), [], f"Not graded: {e}"
    except GraderError:
        raise
    except Exception as e:  # a grader bug must not cost the cohort: record it, re-grade on resume
        (logs / "grader-error.txt").write_text(traceback.format_exc())
        tests, leaderboard = zero_tests(job.rubric, "grader error (not your fault): a TA will re-grade"), []
        output = f"Grader error (not your fault): {type(e).__name__}: {e}"
        extra["grader_error"] = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = results_json(name, tests, leaderboard, time.monotonic() - start, output, extra)
    write_submission_results(staging, results, failures, environment(job.profile, job.seed))
    _publish(staging, out / name)
    return results


def _publish(staging: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(f"{_PARTIAL}{final.name}-old-{os.getpid()}")
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)


def grade_cohort(cohort: Path, job: Job, out: Path, force: bool = False, progress: bool = True) -> list[dict]:
    """Grade every submission in `cohort` not yet done in `out`; write `out/cohort.csv`."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{_PARTIAL}*"):  # left by an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    submissions = find_submissions(cohort)
    pending = [p for p in submissions if force or not is_done(out, submission_name(p))]
    bar = tqdm(pending, desc="grading", unit="submission", disable=not progress)
    for path in bar:
        bar.set_postfix_str(submission_name(path))
        grade_one(path, job, out)
    rows = [json.loads((out / submission_name(p) / "results.json").read_text()) for p in submissions]
    write_cohort_csv(out / "cohort.csv", rows)
    return rows


def part_scores(results: dict) -> dict[str, float]:
    scores: dict[str, float] = {}
    for t in results["tests"]:
        for tag in t["tags"]:
            scores[tag] = scores.get(tag, 0) + t["score"]
    return scores


def cohort_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        extra = r["extra_data"]
        numbers = extra.get("numbers", {})
        row = {"name": extra["submission"], "score": r["score"], "max_score": extra["max_score"]}
        row.update({f"{part}_score": s for part, s in part_scores(r).items() if part != "notebook"})
        row.update({k: (round(numbers[k], 3) if numbers.get(k) is not None else "") for k in CSV_NUMBERS})
        row.update(profile=extra["profile"], seed=extra["seed"], note=r["output"].splitlines()[0] if r["output"] else "")
        rows.append(row)
    return rows


def write_cohort_csv(path: Path, results: list[dict]) -> None:
    rows = cohort_rows(results)
    buffer = io.StringIO()
    if rows:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(buffer, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    os.replace(tmp, path)


def table(results: list[dict]) -> str:
    """A plain-text table of a cohort for the terminal."""
    header = ["submission", "score", "part1", "part2", "part3", "moe x", "ep tok/s", "note"]
    lines = []
    for row in cohort_rows(results):
        lines.append([row["name"], f"{row['score']:g}/{row['max_score']:g}",
                      *(f"{row.get(f'{p}_score', 0):g}" for p in ("moe", "ep", "pp")),
                      f"{row['moe_speedup']}" if row["moe_speedup"] != "" else "-",
                      f"{row['ep_tokens_per_s']:.0f}" if row["ep_tokens_per_s"] != "" else "-",
                      row["note"][:60]])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*line) for line in [header, *lines])
