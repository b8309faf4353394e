"""The report notebooks under nbgrader: the course folder, isolated autograding, the score hook.

The rule: no test code or instructor file shares a process or a file system with student code.
nbgrader's own `autograde` runs the hidden tests in the student's kernel, which the student's
cells control (an IPython input transformer can empty every later test cell), next to the course
folder (whose source notebook holds the solutions and hidden tests). So the grader splits it:

1. trusted, nothing runs (`sanitised`): nbgrader autogrades the submission without executing it
   in a private copy of the course: outputs cleared, locked and test cells restored from the
   gradebook (a deleted one added back), ids deduplicated, metadata checked;
2. untrusted, in `grader.sandbox` (`execute_sandboxed`): the scratch holds that notebook, each
   test cell replaced by a stand-in with no test code that saves, as plain data, the values of
   the names the test reads (found with `ast` in the test's gradebook source, hidden part
   included), and a small nbclient runner; no course, no source notebook, no gradebook. The
   kernel runs with NBGRADER_EXECUTION set (the measuring cells skip), a cell timeout of
   `CELL_TIMEOUT_S`, errors allowed;
3. trusted, in a fresh `python -I` of the grader's (`run_tests`): the test cells, from the
   gradebook, in order on one namespace, each after its captured values are set. A value that is
   not plain data (bool, int, float, str, None; lists, tuples and str-keyed dicts of them; a
   numpy/torch scalar counts as its number) arrives as a marker every use of which fails, and
   its test's error line says so. A test whose values were never captured (the kernel stopped
   first, a cell kept the stand-in from running) fails;
4. the executed notebook = the sanitised one with the sandbox's outputs, each test cell's
   outputs the grader's result (an error output `Name: message` on a failure); the grader imports
   it into a course of its own with `nbgrader autograde --no-execute` (`import_executed`: no code
   runs) and reads the scores and writes the feedback from there.

So a test passes only on the values the student's notebook computed, whatever its kernel did to
itself, and what the sandbox hands back (the captured values, its cells' outputs, untrusted) is
read as data, links out of the scratch never followed. Tests can only check plain values: a test
that calls a student's function or reads an object's attributes would fail on the marker.

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
import stat
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


# -- executing a submitted notebook: student code in the sandbox, test code outside it -----------
class NotebookRunError(RuntimeError):
    """The submitted notebook could not be autograded (the submission's problem); one line."""


CELL_TIMEOUT_S = 300  # c.Execute.timeout of NBGRADER_CONFIG: per cell of the student's kernel
TESTS_TIMEOUT_S = 120  # the trusted run of every test cell on the captured values, together
TESTS_MEMORY_MB = 4096  # RLIMIT_AS of that run
MAX_ANSWERS_BYTES = 2**20  # the values one test cell reads, as captured in the sandbox
PREPARED_NAME = "notebook.ipynb"  # the student's notebook as the sandbox runs it (test cells replaced)
_NOT_PLAIN = ("not a plain value (a bool, int, float, str or None, or a list, tuple or str-keyed dict of them; "
              "a numpy/torch scalar counts as its number)")


@dataclass(frozen=True)
class GradedTest:
    """An autograded test cell as the gradebook holds it (hidden tests included): never from the
    student's file. `reads`: the names it reads that it does not bind itself (nor are builtins),
    whose values the sandbox captures; `binds`: the names it binds."""

    grade_id: str
    source: str
    reads: tuple[str, ...]
    binds: tuple[str, ...]


def _bound_and_read(source: str) -> tuple[set[str], set[str]]:
    """(names the code binds anywhere, names it loads anywhere), by `ast`; both empty if it does not parse."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(), set()
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    return bound, read


def graded_tests(course: Path, assignment: str) -> dict[str, GradedTest]:
    """grade_id -> the notebook's autograded test cells (graded code cells that are not also answer
    cells), their source from the gradebook."""
    import builtins

    from nbgrader.api import Gradebook

    tests = {}
    with Gradebook(db_url(course), COURSE_ID) as gb:
        notebook = gb.find_notebook(NOTEBOOK_ID, assignment)
        answers = {cell.name for cell in notebook.solution_cells}
        for cell in notebook.grade_cells:
            if cell.cell_type == "code" and cell.name not in answers:
                source = gb.find_source_cell(cell.name, NOTEBOOK_ID, assignment).source
                bound, read = _bound_and_read(source)
                reads = sorted(read - bound - set(dir(builtins)))
                tests[cell.name] = GradedTest(cell.name, source, tuple(reads), tuple(sorted(bound)))
    return tests


def _nbgrader_reason(error: NotebookError) -> str:
    """nbgrader's own line of a NotebookError, without the grader's course path."""
    return str(error).split(": ", 1)[-1].split(" failed in ", 1)[-1].split(": ", 1)[-1]


def sanitised(template: Path, assignment: str, notebook: Path):
    """The submitted notebook as nbgrader restores it, without running anything (trusted, in a
    private copy of the course `template`): outputs cleared, locked and test cells (a deleted one
    added back) restored from the gradebook, ids deduplicated, metadata checked."""
    import nbformat

    private = make_private(tempfile.mkdtemp(prefix="onenode-sanitise-"))
    try:
        course = private / "course"
        shutil.copytree(template, course,
                        ignore=shutil.ignore_patterns(".jupyter", "autograded", "submitted", "feedback"))
        submitted = course / "submitted" / "student" / assignment
        submitted.mkdir(parents=True)
        shutil.copy2(notebook, submitted / f"{NOTEBOOK_ID}.ipynb")
        try:
            nbgrader_api(course, "autograde", assignment, "student", Execute={"enabled": False},
                         ClearOutput={"enabled": True}, OverwriteCells={"add_missing_cells": True})
        except NotebookError as e:
            raise NotebookRunError(f"report.ipynb could not be autograded (nbgrader could not read it: "
                                   f"{_nbgrader_reason(e)}): open it with `jupyter lab` and check that it is a "
                                   "valid notebook made from the released one, with all its answer cells") from None
        try:
            return nbformat.read(course / "autograded" / "student" / assignment / f"{NOTEBOOK_ID}.ipynb",
                                 as_version=4)
        except (OSError, ValueError) as e:
            raise NotebookRunError(f"report.ipynb could not be autograded (nbgrader left no readable notebook: {e}): "
                                   "resubmit a valid one") from None
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


# Written into the sandbox (runner/capture.py) and run by each test cell's stand-in there: the
# values of the names the test reads, as plain data, to answers/<n>.json. No test code.
_CAPTURE = '''\
import json

def plain(value, budget, depth=0):
    budget[0] -= 1
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if budget[0] > 0 and depth < 32 and kind in (list, tuple):
        return {kind.__name__: [plain(v, budget, depth + 1) for v in value]}
    if budget[0] > 0 and depth < 32 and kind is dict and all(type(k) is str for k in value):
        return {"dict": {k: plain(v, budget, depth + 1) for k, v in value.items()}}
    module = str(getattr(kind, "__module__", "") or "")
    if module.split(".")[0] in ("numpy", "torch") and getattr(value, "ndim", None) == 0:
        item = value.item()
        if type(item) in (bool, int, float):
            return item
    return {"opaque": kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"}

values, missing = {}, []
for name in NAMES:
    if name not in NAMESPACE:
        missing.append(name)
        continue
    try:
        encoded = plain(NAMESPACE[name], [100_000])
        if len(json.dumps(encoded)) > LIMIT:
            encoded = {"opaque": "value over the size limit"}
    except Exception as e:
        encoded = {"opaque": f"value that could not be read ({type(e).__name__})"}
    values[name] = encoded
with open(OUT, "w") as f:
    json.dump({"values": values, "missing": missing}, f)
'''

# Run in the sandbox: executes the prepared notebook with nbclient (the student's kernel), writes it.
_RUNNER = '''\
import sys
import nbclient
import nbformat

notebook, out, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])
nb = nbformat.read(notebook, as_version=4)
client = nbclient.NotebookClient(
    nb, timeout=timeout, kernel_name="python3", allow_errors=True, interrupt_on_timeout=True,
    error_on_timeout={"ename": "CellTimeoutError", "evalue": f"the cell ran over {timeout} s",
                      "traceback": [f"CellTimeoutError: the cell ran over {timeout} s"]},
    resources={"metadata": {"path": "."}})
try:
    client.execute()
except Exception as e:  # the kernel died or nbclient gave up: the cells that ran stand
    print(f"the notebook stopped: {type(e).__name__}: {e}", file=sys.stderr)
nbformat.write(nb, out)
'''


def _stand_in(test: GradedTest, capture: Path, out: Path) -> str:
    return (f"# OneNode: the test `{test.grade_id}` runs outside this kernel, on the values of the names it reads,\n"
            f"# saved here (grader/notebook.py).\n"
            f"__import__('runpy').run_path({str(capture)!r}, {{'NAMESPACE': globals(), "
            f"'NAMES': {list(test.reads)!r}, 'OUT': {str(out)!r}, 'LIMIT': {MAX_ANSWERS_BYTES}}})\n")


@dataclass
class SandboxRun:
    """What the sandbox gave back: the executed notebook (untrusted: only its outputs are used)
    and, per test cell index, its captured values (JSON text, untrusted) or None when not captured."""

    executed: dict | None
    answers: dict[int, str | None]


def _read_inside(scratch: Path, path: Path, limit: int) -> bytes | bool | None:
    """A regular file the sandbox left in its scratch: its bytes, False past `limit` bytes, None if
    absent or not a plain file inside the scratch (a link out of it is never followed)."""
    real = path.resolve()
    if not real.is_relative_to(scratch.resolve()):
        return None
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None
        data = f.read(limit + 1)
    return False if len(data) > limit else data


def execute_sandboxed(nb, tests: dict[str, GradedTest], log: Path) -> SandboxRun:
    """Run the sanitised notebook `nb` in the sandbox, each test cell replaced by a stand-in that
    captures the values the test reads. The scratch holds only that notebook and the runner: no
    course, no source notebook, no gradebook, no test code. The run's output goes to `log`."""
    import nbformat

    scratch = make_scratch()
    try:
        work, runner, answers, out = (scratch / sub for sub in ("notebook", "runner", "answers", "out"))
        for folder in (work, runner, answers, out):
            folder.mkdir()
        (runner / "capture.py").write_text(_CAPTURE)
        (runner / "run.py").write_text(_RUNNER)
        prepared = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                                     "display_name": "Python 3"}})
        stand_ins: dict[int, Path] = {}
        for index, cell in enumerate(nb.cells):
            test = tests.get(_grade_id(cell)) if cell.cell_type == "code" else None
            if test is not None:
                stand_ins[index] = answers / f"{index}.json"
                prepared.cells.append(nbformat.v4.new_code_cell(_stand_in(test, runner / "capture.py",
                                                                           stand_ins[index])))
            elif cell.cell_type == "code":
                prepared.cells.append(nbformat.v4.new_code_cell(cell.source))
            elif cell.cell_type == "markdown":
                prepared.cells.append(nbformat.v4.new_markdown_cell(cell.source))
            else:
                prepared.cells.append(nbformat.v4.new_raw_cell(cell.source))
        nbformat.write(prepared, work / PREPARED_NAME)
        jupyter = scratch / ".jupyter"
        jupyter.mkdir()
        env = {"NBGRADER_EXECUTION": "autograde", "JUPYTER_CONFIG_DIR": str(jupyter / "config"),
               "JUPYTER_DATA_DIR": str(jupyter / "data"), "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
               "IPYTHONDIR": str(jupyter / "ipython"), "JUPYTER_PLATFORM_DIRS": "1"}
        result = run_sandboxed([sys.executable, str(runner / "run.py"), PREPARED_NAME,
                                str(out / "executed.ipynb"), str(CELL_TIMEOUT_S)],
                               cwd=work, env=env, scratch=scratch, limits=SANDBOX_LIMITS)
        log.write_bytes(result.stdout + result.stderr)
        executed = _read_inside(scratch, out / "executed.ipynb", MAX_NOTEBOOK_BYTES)
        if not result.ok or executed is None:
            why = result.reason if result.killed_reason else _last_error(result.stderr.decode(errors="replace"))
            raise NotebookRunError(f"report.ipynb could not be autograded ({why}): open it with "
                                   f"`jupyter lab` and check that it is a valid notebook that runs top to bottom")
        if executed is False:
            raise NotebookRunError(f"the graded report.ipynb grew over {MAX_NOTEBOOK_BYTES >> 20} MiB of output")
        try:
            executed = json.loads(executed)
        except (ValueError, RecursionError):
            executed = None
        captured: dict[int, str | None] = {}
        for index, path in stand_ins.items():
            answer = _read_inside(scratch, path, MAX_ANSWERS_BYTES + 4096)
            captured[index] = "over" if answer is False else None if answer is None else answer.decode(
                errors="replace")
        return SandboxRun(executed if isinstance(executed, dict) else None, captured)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Run by the grader in a fresh Python (`python -I`), never in the sandbox, never with student code:
# the test cells in order, on one namespace, each after the values its stand-in captured are set.
_TESTS = '''\
import ast, builtins, contextlib, io, json, resource, sys

payload = json.load(sys.stdin)
resource.setrlimit(resource.RLIMIT_AS, (payload["memory"], payload["memory"]))
NOT_PLAIN = payload["not_plain"]


def _refuse(self, *args, **kwargs):
    raise TypeError(f"{object.__getattribute__(self, '_name')} is a {object.__getattribute__(self, '_kind')}, "
                    + NOT_PLAIN)


class NotAPlainValue:
    """What a captured name holds when its value was not plain data: every use of it fails."""

    __slots__ = ("_name", "_kind")

    def __init__(self, name, kind):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_kind", kind)

    def __repr__(self):
        return f"<{object.__getattribute__(self, '_kind')}, not a plain value>"

    __str__ = __repr__
    __hash__ = _refuse


for _op in ("bool eq ne lt le gt ge add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod "
            "pow rpow matmul rmatmul neg pos abs invert round trunc floor ceil float int index complex len iter "
            "contains getitem setitem delitem call getattr setattr delattr and rand or ror xor rxor lshift "
            "rlshift rshift rrshift divmod rdivmod enter exit").split():
    setattr(NotAPlainValue, f"__{_op}__", _refuse)


def decode(node, name):
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is dict and len(node) == 1:
        (tag, value), = node.items()
        if tag in ("list", "tuple") and type(value) is list:
            items = [decode(v, name) for v in value]
            return items if tag == "list" else tuple(items)
        if tag == "dict" and type(value) is dict:
            return {k: decode(v, name) for k, v in value.items()}
        if tag == "opaque" and type(value) is str:
            return NotAPlainValue(name, value[:120])
    return NotAPlainValue(name, "value that could not be read back")


def run(source, namespace, filename):
    """exec, and the value of a last bare expression as IPython would display it (nbgrader's
    partial credit)."""
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)


def one_line(e):
    try:
        message = " ".join(str(e).split())[:300]
    except Exception:
        message = ""
    return type(e).__name__, message


out = sys.stdout
namespace = {"__name__": "__main__", "__builtins__": builtins}
bound_by_tests = set()
for test in payload["tests"]:
    result = {"index": test["index"]}
    if test["answers"] is None:
        result["error"] = ["NotCaptured", "the notebook never got this far (an earlier cell stopped the kernel, "
                           "or a cell kept this one from running): see the cells above"]
    elif test["answers"] == "over":
        result["error"] = ["ValueError", f"the values this test reads are over {payload['limit']} bytes"]
    else:
        try:
            answers = json.loads(test["answers"])
            values = {name: decode(answers["values"][name], name) for name in test["reads"]
                      if name in answers["values"]}
            missing = [name for name in answers["missing"] if name in test["reads"]]
        except Exception:
            values, missing = None, None
            result["error"] = ["ValueError", "the values this test reads could not be read back"]
        if values is not None:
            namespace.update(values)
            for name in missing:
                if name not in bound_by_tests:
                    namespace.pop(name, None)
            stdout, stderr = io.StringIO(), io.StringIO()
            try:
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                    shown = run(test["source"], namespace, f"<{test['grade_id']}>")
                if shown is not None:
                    try:
                        result["shown"] = repr(shown)[:1000]
                    except Exception as e:
                        result["error"] = list(one_line(e))
            except BaseException as e:
                name, message = one_line(e)
                opaque = [n for n in test["reads"] if type(namespace.get(n)) is NotAPlainValue]
                if opaque and NOT_PLAIN not in message:
                    notes = "; ".join(f"{n} is a {object.__getattribute__(namespace[n], '_kind')}" for n in opaque)
                    message = f"{message} ({notes}, {NOT_PLAIN})".strip()
                result["error"] = [name, message]
            result["stdout"], result["stderr"] = stdout.getvalue()[:10_000], stderr.getvalue()[:10_000]
    bound_by_tests.update(test["binds"])
    print(json.dumps(result), file=out, flush=True)
'''


def run_tests(tests: list[tuple[int, GradedTest, str | None]]) -> dict[int, dict]:
    """The test cells (index in the notebook, the cell, its captured values' JSON text or None) run
    in order in a fresh Python with a timeout, never in the sandbox or a student's process; index
    -> {"error": [name, message]} on a failure, "stdout"/"stderr"/"shown" as the test printed."""
    payload = json.dumps({"memory": TESTS_MEMORY_MB * 2**20, "not_plain": _NOT_PLAIN, "limit": MAX_ANSWERS_BYTES,
                          "tests": [{"index": index, "grade_id": test.grade_id, "source": test.source,
                                     "reads": test.reads, "binds": test.binds, "answers": answers}
                                    for index, test, answers in tests]})
    private = make_private(tempfile.mkdtemp(prefix="onenode-tests-"))
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", _TESTS], input=payload.encode(), capture_output=True,
                              cwd=private, timeout=TESTS_TIMEOUT_S,
                              env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": str(private)})
        stdout = proc.stdout
        stopped = None if proc.returncode == 0 else _last_error(proc.stderr.decode(errors="replace"))
    except subprocess.TimeoutExpired as e:
        stdout, stopped = e.stdout or b"", f"the tests did not finish within {TESTS_TIMEOUT_S} s"
    finally:
        shutil.rmtree(private, ignore_errors=True)
    results = {}
    for line in (stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout).splitlines():
        try:
            result = json.loads(line)
            results[result["index"]] = result
        except (ValueError, KeyError, TypeError):
            continue
    for index, _, _ in tests:
        results.setdefault(index, {"error": ["TimeoutError" if "finish" in (stopped or "") else "GraderError",
                                             stopped or "the test did not run"]})
    return results


def _test_outputs(result: dict) -> list:
    """A test cell's outputs as nbgrader scores them: an error output on a failure (its traceback
    one line, `Name: message`), the streams the test wrote, the value of a last bare expression."""
    from nbformat.v4 import new_output

    outputs = [new_output("stream", name=name, text=result[name]) for name in ("stdout", "stderr") if result.get(name)]
    if "error" in result:
        name, message = result["error"]
        outputs.append(new_output("error", ename=name, evalue=message,
                                  traceback=[f"{name}: {message}" if message else name]))
    elif "shown" in result:
        outputs.append(new_output("execute_result", data={"text/plain": result["shown"]}, execution_count=None))
    return outputs


def _sandbox_outputs(executed: dict | None, nb) -> list[tuple[list, int | None]] | None:
    """Each cell's (outputs, execution count) from the sandbox's executed notebook, when it still
    has the cells it was given (it is untrusted: its sources are ignored, and any mismatch drops all
    its outputs)."""
    import nbformat

    cells = executed.get("cells") if executed else None
    if not isinstance(cells, list) or len(cells) != len(nb.cells):
        return None
    outputs = []
    for cell, ours in zip(cells, nb.cells):
        if not isinstance(cell, dict) or cell.get("cell_type") != ours.cell_type:
            return None
        count = cell.get("execution_count")
        outputs.append((cell.get("outputs", []) if ours.cell_type == "code" else [],
                        count if type(count) is int else None))
    try:
        return [([nbformat.from_dict(o) for o in cell], count) for cell, count in outputs]
    except (TypeError, AttributeError):
        return None


def execute(template: Path, assignment: str, notebook: Path, log: Path) -> bytes:
    """The executed notebook nbgrader then scores (bytes), made so that no test code or instructor
    file shares a process or a file system with student code: sanitised by nbgrader without
    running it (`sanitised`); run in the sandbox with each test cell replaced by a stand-in that
    captures the values the test reads (`execute_sandboxed`); the test cells, from the gradebook,
    run by the grader on those values (`run_tests`). The notebook is the sanitised one with the
    sandbox's outputs, each test cell's outputs being the grader's result."""
    import nbformat

    if notebook.stat().st_size > MAX_NOTEBOOK_BYTES:
        raise NotebookRunError(f"report.ipynb is over {MAX_NOTEBOOK_BYTES >> 20} MiB: clear large outputs and resubmit")
    tests = graded_tests(template, assignment)
    nb = sanitised(template, assignment, notebook)
    run = execute_sandboxed(nb, tests, log)
    at = {index: tests[_grade_id(cell)] for index, cell in enumerate(nb.cells)
          if cell.cell_type == "code" and _grade_id(cell) in tests}
    results = run_tests([(index, test, run.answers.get(index)) for index, test in sorted(at.items())])
    outputs = _sandbox_outputs(run.executed, nb)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = outputs[index] if outputs is not None else ([], None)
        if index in at:
            cell.source, cell.outputs = at[index].source, _test_outputs(results[index])
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and index not in at:
                cell.outputs = []
    executed = nbformat.writes(nb).encode("utf-8")
    if len(executed) > MAX_NOTEBOOK_BYTES:
        raise NotebookRunError(f"the graded report.ipynb grew over {MAX_NOTEBOOK_BYTES >> 20} MiB of output")
    return executed


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
        executed = without_hidden_tests(execute(template, assignment, notebook, logs / "notebook.log"))
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
