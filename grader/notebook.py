"""The report notebooks under nbgrader: the course folder, sandboxed autograding, the score hook.

nbgrader runs a notebook's kernel in its own process tree, so autograding executes student code.
Here that happens only inside `grader.sandbox`, in a throwaway copy of the course; the grader
then imports the executed notebook into a course of its own with `nbgrader autograde
--no-execute` (no code runs: the test cells are restored from the gradebook, the outputs are the
sandbox's) and reads the scores and writes the feedback from there. So the sandbox never holds
the gradebook the grader reads or the TA's course, and nothing a notebook does outside its own
outputs reaches a score. (Its outputs themselves are as trustworthy as nbgrader makes them: a
notebook that forges its test outputs is for the TA's review of the written cells to catch.)

A course folder is made per use from the kit's `assignments/nbgrader_config.py` and each
assignment's source notebook (`assignments/source/<assignment>/report.ipynb`, or the folder its
`Assignment.report_source` names); gradebook.db, release/, submitted/, autograded/ and feedback/
are created there.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import GraderError
from .report import test_entry
from .rubric import KIT_ROOT
from .sandbox import Limits, make_private, make_scratch, run_sandboxed

NBGRADER_CONFIG = KIT_ROOT / "assignments" / "nbgrader_config.py"
SOURCES = KIT_ROOT / "assignments" / "source"  # <assignment>/report.ipynb, unless the assignment names another
COURSE_ID = "onenode"  # c.CourseDirectory.course_id in NBGRADER_CONFIG
NOTEBOOK_ID = "report"  # every assignment has one notebook, report.ipynb
MAX_NOTEBOOK_BYTES = 20 * 2**20
SANDBOX_LIMITS = Limits(wall_s=600, cpu_s=600, memory_mb=8192, nproc=512, fsize_mb=256, output_kb=512)
AUTOGRADED_NAME = "report_autograded.ipynb"  # beside results.json: what `export` imports
FEEDBACK_NAME = "report_feedback.html"


class NotebookError(GraderError):
    """The course or nbgrader itself is broken (a grader problem, not a submission's): the job stops."""


def require_nbgrader() -> None:
    try:
        import nbgrader  # noqa: F401
    except ImportError:
        raise NotebookError("nbgrader is not installed: pip install -e '.[course]' (or pip install nbgrader)") from None


def student_id(name: str) -> str:
    """A submission name as an nbgrader student id (letters, digits, `_`, `-`, `.`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "student"


# -- nbgrader in a course folder (trusted: no student code runs in these) ------------------------
def path_with_scripts() -> str:
    """PATH with this Python's scripts first (once): nbgrader runs `alembic` from there to set up a
    gradebook, and an unactivated venv (`make demo`) does not put them on PATH."""
    scripts, path = os.path.dirname(sys.executable), os.environ.get("PATH", "")
    return path if path.split(os.pathsep)[0] == scripts else os.pathsep.join([scripts, path])


def _env(course: Path) -> dict[str, str]:
    """The grader's environment with every Jupyter/IPython folder inside the course, not $HOME,
    and this Python's scripts first on PATH (nbgrader runs `alembic` to set up its database)."""
    jupyter = course / ".jupyter"
    return {**os.environ, "PATH": path_with_scripts(), "JUPYTER_CONFIG_DIR": str(jupyter / "config"),
            "JUPYTER_DATA_DIR": str(jupyter / "data"), "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
            "IPYTHONDIR": str(jupyter / "ipython")}


_EXCEPTION_LINE = re.compile(r"^\s*[\w.]*(Error|Exception): .+")


def _last_error(log: str) -> str:
    """The line of an nbgrader log that says what went wrong: the last exception, else the last
    [ERROR] line, else the last line."""
    lines = log.splitlines()
    found = ([ln for ln in lines if _EXCEPTION_LINE.match(ln)] or [ln for ln in lines if "[ERROR]" in ln]
             or lines[-1:] or ["no output"])
    return found[-1].strip()[:300]


def run_nbgrader(course: Path, *args: str, timeout: float = 600) -> str:
    """`nbgrader ARGS` in `course`; its log on success, a one-line NotebookError otherwise."""
    require_nbgrader()
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=_env(course),
                          capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise NotebookError(f"nbgrader {' '.join(args)} failed in {course}: {_last_error(log)}")
    return log


def nbgrader_api(course: Path, step: str, *args: str, **config) -> str:
    """nbgrader's Python API (`NbGraderAPI.<step>(*args)`) on `course`, configured by its
    nbgrader_config.py plus `config` (traitlets sections) as the command line would be, in this
    process: for the trusted steps (generating, importing an executed notebook, feedback), so that
    each step does not pay nbgrader's imports again in a subprocess. Its log on success, a one-line
    NotebookError otherwise."""
    require_nbgrader()
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from sqlalchemy.exc import SAWarning
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    os.environ["PATH"] = path_with_scripts()  # a new gradebook is set up by running `alembic`
    settings = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    settings.merge(Config(config))
    with warnings.catch_warnings():  # nbgrader's own session bookkeeping warns on every import
        warnings.simplefilter("ignore", SAWarning)
        result = getattr(NbGraderAPI(coursedir=CourseDirectory(config=settings), config=settings), step)(*args)
    log = result.get("log") or ""
    if not result["success"]:
        raise NotebookError(f"nbgrader {step} {' '.join(args)} failed in {course}: "
                            f"{_last_error((result.get('error') or '') + chr(10) + log)}")
    return log


def assignment_source(assignment: str, source: Path | None = None) -> Path:
    """The nbgrader source folder of `assignment`'s report.ipynb: `source`, else the kit's."""
    source = source or SOURCES / assignment
    if not (source / f"{NOTEBOOK_ID}.ipynb").is_file():
        raise ValueError(f"{assignment} has no {NOTEBOOK_ID}.ipynb in {source}: restore it from git")
    return source


def make_course(course: Path, sources: dict[str, Path]) -> Path:
    """A course working folder: the kit's config, each assignment's source (name -> its folder,
    `assignment_source`) generated (`nbgrader generate_assignment`: gradebook entries and
    release/<assignment>/)."""
    course.mkdir(parents=True, exist_ok=True)
    shutil.copy2(NBGRADER_CONFIG, course / "nbgrader_config.py")
    for assignment, source in sources.items():
        shutil.rmtree(course / "source" / assignment, ignore_errors=True)
        shutil.copytree(source, course / "source" / assignment)
        nbgrader_api(course, "generate_assignment", assignment)
    return course


def db_url(course: Path) -> str:
    return f"sqlite:///{(course / 'gradebook.db').resolve()}"


def autograded_cells(course: Path, assignment: str) -> dict[str, float]:
    """grade_id -> points of the notebook's autograded (code) cells, from the gradebook."""
    from nbgrader.api import Gradebook

    with Gradebook(db_url(course), COURSE_ID) as gb:
        notebook = gb.find_notebook(NOTEBOOK_ID, assignment)
        return {cell.name: cell.max_score for cell in notebook.grade_cells if cell.cell_type == "code"}


def written_points(course: Path, assignment: str) -> float:
    from nbgrader.api import Gradebook

    with Gradebook(db_url(course), COURSE_ID) as gb:
        return gb.find_notebook(NOTEBOOK_ID, assignment).max_written_score


def import_executed(course: Path, assignment: str, student: str, executed: Path) -> None:
    """Record an already executed notebook in `course`'s gradebook without running it."""
    submitted = course / "submitted" / student / assignment
    submitted.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executed, submitted / f"{NOTEBOOK_ID}.ipynb")
    nbgrader_api(course, "autograde", assignment, student, Execute={"enabled": False},
                 ClearOutput={"enabled": False})  # `nbgrader autograde --no-execute`


def feedback(course: Path, assignment: str, student: str) -> Path:
    nbgrader_api(course, "generate_feedback", assignment, student)
    return course / "feedback" / student / assignment / f"{NOTEBOOK_ID}.html"


# -- executing a submitted notebook (untrusted: only in the sandbox) -----------------------------
class NotebookRunError(RuntimeError):
    """The submitted notebook could not be autograded (the submission's problem); one line."""


def execute_sandboxed(template: Path, assignment: str, notebook: Path, log: Path) -> bytes:
    """`nbgrader autograde` of `notebook` in the sandbox, in a throwaway copy of the course
    `template`; returns the executed notebook. The run's output goes to `log`."""
    if notebook.stat().st_size > MAX_NOTEBOOK_BYTES:
        raise NotebookRunError(f"report.ipynb is over {MAX_NOTEBOOK_BYTES >> 20} MiB: clear large outputs and resubmit")
    scratch = make_scratch()
    try:
        course = scratch / "course"
        shutil.copytree(template, course,
                        ignore=shutil.ignore_patterns(".jupyter", "autograded", "submitted", "feedback"))
        submitted = course / "submitted" / "student" / assignment
        submitted.mkdir(parents=True)
        shutil.copy2(notebook, submitted / f"{NOTEBOOK_ID}.ipynb")
        result = run_sandboxed([sys.executable, "-m", "nbgrader", "autograde", assignment, "--student", "student"],
                               cwd=course, scratch=scratch, limits=SANDBOX_LIMITS)
        log.write_bytes(result.stdout + result.stderr)
        executed = course / "autograded" / "student" / assignment / f"{NOTEBOOK_ID}.ipynb"
        if not result.ok or not executed.is_file():
            why = result.reason if result.killed_reason else _last_error(result.stderr.decode(errors="replace"))
            raise NotebookRunError(f"report.ipynb could not be autograded ({why}): open it with "
                                   f"`jupyter lab` and check that it is a valid notebook that runs top to bottom")
        if executed.stat().st_size > MAX_NOTEBOOK_BYTES:
            raise NotebookRunError(f"the graded report.ipynb grew over {MAX_NOTEBOOK_BYTES >> 20} MiB of output")
        return executed.read_bytes()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def without_hidden_tests(executed: bytes) -> bytes:
    """The executed notebook as students may see it: hidden tests' source removed, and the
    tracebacks of those cells cut to `Name: message` (IPython quotes the lines around the failing
    one). Importing it still grades with the hidden tests: autograde restores test cells from
    the gradebook, and a failure stays a failure."""
    import nbformat
    from nbgrader.preprocessors import ClearHiddenTests

    try:
        nb = nbformat.reads(executed.decode("utf-8"), as_version=4)
    except (UnicodeDecodeError, ValueError) as e:
        raise NotebookRunError(f"the graded report.ipynb is not a readable notebook ({e}): "
                               "resubmit a valid one") from None
    for cell in nb.cells:
        if cell.cell_type == "code" and ClearHiddenTests().begin_test_delimeter in cell.source:
            for output in cell.outputs:
                if output.output_type == "error":
                    output.traceback = [f"{output.ename}: {output.evalue}"]
    nb, _ = ClearHiddenTests().preprocess(nb, {})
    return nbformat.writes(nb).encode("utf-8")


# -- the score hook of the assignments' scoring -------------------------------------------------
@dataclass
class _Graded:
    tests: list[dict]
    executed: bytes | None
    feedback_html: bytes | None


_TEMPLATES: dict[str, Path] = {}
_GRADED: dict[tuple[str, str], _Graded] = {}  # (assignment, sha256 of the notebook) -> result


def _template(assignment: str, source: Path | None = None) -> Path:
    """A grader-private course with `assignment` generated, made once per process."""
    if assignment not in _TEMPLATES:
        root = make_private(tempfile.mkdtemp(prefix="onenode-course-"))
        atexit.register(shutil.rmtree, root, True)
        _TEMPLATES[assignment] = make_course(root / "course", {assignment: assignment_source(assignment, source)})
    return _TEMPLATES[assignment]


def _entry(name: str, score: float, max_score: float, output: str) -> dict:
    return test_entry(f"Report notebook: {name}", score, max_score, output, "notebook")


def _cell_errors(executed: dict) -> dict[str, str]:
    """grade_id -> the error a graded cell raised, as `Name: message`."""
    errors = {}
    for cell in executed.get("cells", []):
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error" and grade_id:
                errors[grade_id] = f"{output.get('ename', 'Error')}: {output.get('evalue', '')}".strip()[:300]
    return errors


def _grade(template: Path, assignment: str, notebook: Path, logs: Path) -> _Graded:
    cells = autograded_cells(template, assignment)
    written = written_points(template, assignment)
    written_note = _entry("written answers", 0, 0, f"{written:g} points of written answers are graded by a TA in "
                          "nbgrader's formgrader; `onenode-grade export` adds them to the gradebook CSV")
    try:
        executed = without_hidden_tests(execute_sandboxed(template, assignment, notebook, logs / "notebook.log"))
    except NotebookRunError as e:
        return _Graded([_entry(name, 0, points, str(e)) for name, points in cells.items()] + [written_note], None, None)
    private = make_private(tempfile.mkdtemp(prefix="onenode-notebook-"))
    try:
        course = private / "course"
        shutil.copytree(template, course, ignore=shutil.ignore_patterns(".jupyter"))
        (private / AUTOGRADED_NAME).write_bytes(executed)
        try:  # nbgrader worked on the template, so a failure here comes from the executed notebook
            import_executed(course, assignment, "student", private / AUTOGRADED_NAME)
        except NotebookError as e:
            reason = f"the graded report.ipynb could not be recorded ({e}); if every submission shows this, see logs/"
            zeros = [_entry(name, 0, points, reason) for name, points in cells.items()]
            return _Graded(zeros + [written_note], None, None)
        from nbgrader.api import Gradebook

        with Gradebook(db_url(course), COURSE_ID) as gb:
            grades = {g.name: g for g in gb.find_submission_notebook(NOTEBOOK_ID, assignment, "student").grades}
            scores = {name: float(grades[name].score) if name in grades else 0.0 for name in cells}
        errors = _cell_errors(json.loads(executed))
        tests = [_entry(name, scores[name], points, "passed" if scores[name] >= points else
                        f"failed: {errors.get(name, 'see report_feedback.html')}") for name, points in cells.items()]
        html = feedback(course, assignment, "student").read_bytes()
        return _Graded(tests + [written_note], executed, html)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def grade(notebook: Path | None, logs: Path, assignment: str, source: Path | None = None) -> list[dict]:
    """Autograded points of a submission's report.ipynb as results.json test entries (tag
    `notebook`), against `assignment`'s source (`source`, else the kit's); the executed notebook
    and nbgrader's feedback HTML go beside `logs/` (the submission's output folder) as
    report_autograded.ipynb and report_feedback.html. Identical notebooks are graded once per
    process (the demo cohort shares one)."""
    template = _template(assignment, source)
    if notebook is None:
        return [_entry(name, 0, points, "report.ipynb is missing from the submission: add it and resubmit")
                for name, points in autograded_cells(template, assignment).items()]
    key = (assignment, hashlib.sha256(notebook.read_bytes()).hexdigest())
    if key not in _GRADED:
        _GRADED[key] = _grade(template, assignment, notebook, logs)
    graded = _GRADED[key]
    out = logs.parent
    if graded.executed is not None:
        (out / AUTOGRADED_NAME).write_bytes(graded.executed)
        (out / FEEDBACK_NAME).write_bytes(graded.feedback_html)
    return [dict(t) for t in graded.tests]
