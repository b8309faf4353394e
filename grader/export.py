"""`onenode-grade export --course COURSE --results OUT --csv FILE`: one grade sheet per cohort.

The autograder's results (`OUT/<name>/results.json`, from `onenode-grade NAME`) hold the parts'
scores and the notebook's autograded points; the written answers are graded by TAs in nbgrader's
formgrader, in COURSE. This command first records in COURSE every executed notebook the
autograder left (`OUT/<name>/report_autograded.ipynb`; no code runs, see grader/notebook.py), so
the formgrader lists them, then runs `nbgrader export` (COURSE/grades.csv) and writes one row per
student: the parts from results.json, the notebook from the gradebook (autograded + written, as
graded so far), and the total. Run it again after manual grading: unchanged notebooks are not
re-imported, so manual grades stay. The results say which assignment they are of.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from .notebook import AUTOGRADED_NAME, COURSE_ID, NOTEBOOK_ID, db_url, import_executed, run_nbgrader, student_id
from .registry import ASSIGNMENTS

FIELDS = ("student", "parts_score", "parts_max", "notebook_score", "notebook_max", "needs_manual_grade",
          "total", "total_max", "profile", "seed")


def _imported(course: Path, assignment: str, student: str, executed: Path) -> bool:
    submitted = course / "submitted" / student / assignment / f"{NOTEBOOK_ID}.ipynb"
    return submitted.is_file() and submitted.read_bytes() == executed.read_bytes()


def import_results(course: Path, results: Path, assignment: str) -> dict[str, dict]:
    """student id -> results.json of every graded submission; new notebooks recorded in COURSE."""
    if not results.is_dir():
        raise FileNotFoundError(f"{results} is not a folder: pass the --out folder of `onenode-grade {assignment}`")
    from nbgrader.api import Gradebook

    graded = {}
    for folder in sorted(p for p in results.iterdir() if (p / "results.json").is_file()):
        student = student_id(folder.name)
        graded[student] = json.loads((folder / "results.json").read_text(encoding="utf-8"))
        executed = folder / AUTOGRADED_NAME
        if not executed.is_file():  # no gradable notebook: listed by `nbgrader export` with 0 points
            with Gradebook(db_url(course), COURSE_ID) as gb:
                gb.update_or_create_student(student)
        elif not _imported(course, assignment, student, executed):
            import_executed(course, assignment, student, executed)
    return graded


def _needs_manual_grade(course: Path, assignment: str) -> dict[str, bool]:
    from nbgrader.api import Gradebook

    with Gradebook(db_url(course), COURSE_ID) as gb:
        return {s.student.id: s.needs_manual_grade for s in gb.find_assignment(assignment).submissions}


def merge(graded: dict[str, dict], gradebook_rows: list[dict], manual: dict[str, bool]) -> list[dict]:
    """One row per student: the results' non-notebook tests plus the gradebook's notebook score."""
    notebook = {row["student_id"]: row for row in gradebook_rows}
    rows = []
    for student in sorted(set(graded) | set(notebook)):
        results, nb = graded.get(student), notebook.get(student)
        parts = [t for t in results["tests"] if "notebook" not in t["tags"]] if results else []
        parts_score, parts_max = sum(t["score"] for t in parts), sum(t["max_score"] for t in parts)
        nb_score, nb_max = (float(nb["score"]), float(nb["max_score"])) if nb else (0.0, 0.0)
        extra = results["extra_data"] if results else {}
        rows.append({
            "student": student, "parts_score": round(parts_score, 3), "parts_max": parts_max,
            "notebook_score": round(nb_score, 3), "notebook_max": nb_max, "needs_manual_grade": manual.get(student, ""),
            "total": round(parts_score + nb_score, 3), "total_max": parts_max + nb_max,
            "profile": extra.get("profile", ""), "seed": extra.get("seed", ""),
        })
    return rows


def results_assignment(results: Path) -> str:
    """The name of the assignment whose results fill the folder `results` (each results.json
    records its label)."""
    by_label = {a.label: a.name for a in ASSIGNMENTS.values()}
    labels = {json.loads(path.read_text(encoding="utf-8"))["extra_data"].get("assignment")
              for path in sorted(results.glob("*/results.json"))}
    if not labels:
        raise FileNotFoundError(f"no */results.json in {results}: pass the --out folder of `onenode-grade NAME`")
    if len(labels) > 1 or None in labels or not labels <= set(by_label):
        raise ValueError(f"the results in {results} do not name one known assignment ({sorted(map(str, labels))}): "
                         f"pass --assignment ({', '.join(ASSIGNMENTS)})")
    return by_label[labels.pop()]


def export(course: Path, results: Path, out_csv: Path, assignment: str | None = None) -> list[dict]:
    """Import, `nbgrader export`, merge; write `out_csv` and return its rows. `assignment`
    defaults to the one the results name."""
    if assignment is None:
        assignment = results_assignment(results)
    if not (course / "gradebook.db").is_file():
        raise FileNotFoundError(f"no gradebook.db in {course}: "
                                f"run `onenode-grade release {assignment} --course {course}` first")
    graded = import_results(course, results, assignment)
    run_nbgrader(course, "export", "--to", str((course / "grades.csv").resolve()))
    with open(course / "grades.csv", newline="", encoding="utf-8") as f:
        gradebook_rows = [row for row in csv.DictReader(f) if row["assignment"] == assignment]
    rows = merge(graded, gradebook_rows, _needs_manual_grade(course, assignment))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_csv.with_name(f".{out_csv.name}.tmp")
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    os.replace(tmp, out_csv)
    return rows
