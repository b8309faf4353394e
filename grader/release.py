"""`onenode-grade release NAME --out DIR --course COURSE`: the repository students get.

The student repository (DIR), the same layout as the kit so `git diff` there gives the paths the
grader applies (`a/starter_code/onenode/...`):

    README.md            install, `onenode bench`, the public tests, the report, how to submit
    pyproject.toml       the kit's, without the grader: package and CLI `onenode` only
    requirements.lock    the kit's lock: the versions CI tests, the README's install takes them as constraints
    starter_code/onenode the stack the assignment starts from (its `Handout.starter`)
    tests/conftest.py    what the public tests import from the kit's tests/ (cache folders,
    tests/dist_utils.py  the gloo process runner), nothing else of it
    a1_infra/ | ...      the handout folder: what of it `Handout.parts` names
    benchmarks/results/  the records the handout links to, at the paths they have in the kit
    report.ipynb         nbgrader's release version: no solutions, no hidden tests

COURSE is the TAs' nbgrader working folder (gradebook.db, source/, release/), never part of DIR.
Before DIR appears, the bundle is checked: no solution or hidden-test region, no line of the hint
ladders or of the assignment's own secrets (`Handout.secret_lines`; for A1 the reference patch),
and every relative link of its Markdown files resolves to a file inside the bundle.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from . import hints
from .assignment import Assignment, Handout
from .notebook import NOTEBOOK_ID, assignment_source, make_course
from .rubric import KIT_ROOT, tomllib

RECORDS = KIT_ROOT / "benchmarks" / "results"
TEST_SUPPORT = ("tests/conftest.py", "tests/dist_utils.py")
LOCK = "requirements.lock"  # the kit's lock (`make lock`); the release ships it whole, at the same path
FORBIDDEN_MARKERS = ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS", "BEGIN SOLUTION", "END SOLUTION")
MIN_LEAK_CHARS = 30
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache")
# A Markdown link's target: `[text](target)`, `[text](target "title")`, `[text](target#anchor)`.
_LINK = re.compile(r"\]\((?P<target>[^\s)#]*)(?:#[^\s)]*)?(?:\s+\"[^\"]*\")?\)")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
RECORDS_README = """# Records

The measurements the handout quotes, copied from the course kit's `benchmarks/results/` when this
repository was released. Each JSON file is a record as `onenode bench`, `onenode train` or the
grader wrote it: the command, the commit, the versions, the hardware and every figure. The kit
holds the other records and the notes that go with them.
"""


class ReleaseError(ValueError):
    """The release cannot be built or would leak; one line saying what to fix."""


def student_pyproject(text: str, testpaths: list[str]) -> str:
    """The kit's pyproject.toml without the grader package and CLI, testing only `testpaths`."""
    edits = [
        (r'^onenode-grade = .*\n', ""),
        (r'^where = .*$', 'where = ["starter_code"]'),
        (r'^include = .*$', 'include = ["onenode", "onenode.*"]'),
        (r'^testpaths = .*$', "testpaths = [" + ", ".join(f'"{p}"' for p in testpaths) + "]"),
    ]
    for pattern, replacement in edits:
        text, n = re.subn(pattern, replacement, text, count=1, flags=re.M)
        if n != 1:
            raise ReleaseError(f"the kit's pyproject.toml has no line matching {pattern!r}: update grader/release.py")
    project = tomllib.loads(text)
    if "grader" in str(project["tool"]["setuptools"]) or "onenode-grade" in project["project"].get("scripts", {}):
        raise ReleaseError("the student pyproject.toml still names the grader: update grader/release.py")
    return text


def student_readme(handout: Handout, has_handout: bool, has_tests: bool) -> str:
    folder = handout.folder.name
    lines = [f"# OneNode {handout.title}", "",
             f"The handout is [`{folder}/README.md`]({folder}/README.md)." if has_handout else
             f"The handout is on the course page; this repository holds the code, the report and `{folder}/`.",
             "", "## Set up", "", "```bash",
             "python -m venv .venv",
             f".venv/bin/pip install -c {LOCK} torch   # the version CI tests; PyPI's wheel is a CUDA build:",
             "#   without a GPU, add --extra-index-url https://download.pytorch.org/whl/cpu for the CPU wheel",
             f'.venv/bin/pip install -c {LOCK} -e ".[{handout.extras}]"   # every package at the version CI tests',
             "git init -q && git add -A && git commit -qm handout   # so `git diff` shows your changes",
             "```", "", "## Run", "", "```bash",
             ".venv/bin/onenode bench --preset tiny                  # seconds on a CPU"]
    if has_tests:
        lines.append(".venv/bin/python -m pytest -q                         "
                     "# the public tests (the starter fails them)")
    lines += [*handout.run,
              ".venv/bin/jupyter lab report.ipynb                     # the report: set PROFILE in its first cell",
              "```", "", "## Submit", "", *(handout.submit() if callable(handout.submit) else handout.submit)]
    return "\n".join(lines) + "\n"


def _copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dest, ignore=_SKIP)
    else:
        shutil.copy2(src, dest)


def text_files(root: Path):
    """(path, text) of every file under `root` that decodes as UTF-8."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        try:
            yield path, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def reference_lines(patch: str, starter: Path) -> set[str]:
    """Lines the reference patch adds (stripped, over MIN_LEAK_CHARS) found nowhere in the starter."""
    starter_text = "\n".join(text for _, text in text_files(starter))
    added = {line[1:].strip() for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")}
    return {line for line in added if len(line) > MIN_LEAK_CHARS and line not in starter_text}


def withheld_lines(assignment: Assignment, starter: Path) -> set[str]:
    """The lines no release of `assignment` may hold: its hint ladders', and its own secrets
    given the starter the release carries (`starter`, its starter_code)."""
    return hints.secret_lines(assignment) | assignment.handout.secret_lines(starter)


def leaks(bundle: Path, secret_lines: set[str]) -> list[str]:
    """`file: what` for every nbgrader marker or secret line found anywhere in a bundle file
    (inside a longer line or a notebook's JSON string too)."""
    found = []
    for path, text in text_files(bundle):
        where = path.relative_to(bundle)
        found += [f"{where}: {marker!r}" for marker in FORBIDDEN_MARKERS if marker in text]
        found += [f"{where}: secret line {line[:60]!r}" for line in sorted(secret_lines) if line in text]
    return found


def relative_links(markdown: str) -> list[str]:
    """The targets of the Markdown links in `markdown` that point at a file by a relative path
    (not a URL, not an anchor of the same page), anchors and titles dropped."""
    return [m.group("target") for m in _LINK.finditer(markdown)
            if m.group("target") and not _URL.match(m.group("target")) and not m.group("target").startswith("/")]


def dead_links(bundle: Path) -> list[str]:
    """`file: target` for every relative link of a Markdown file in `bundle` that does not
    resolve to a file inside `bundle` (a link out of it is dead where students read it)."""
    bundle = bundle.resolve()
    dead = []
    for path, text in text_files(bundle):
        if path.suffix == ".md":
            for target in relative_links(text):
                resolved = (path.parent / target).resolve()
                if bundle not in resolved.parents or not resolved.is_file():
                    dead.append(f"{path.relative_to(bundle)}: {target}")
    return dead


def copy_linked_records(stage: Path) -> list[Path]:
    """Copy into `stage` every file of the kit's `benchmarks/results/` that a Markdown file in
    `stage` links to, at the path it has in the kit, so that the handout's links to its records
    resolve in the release; the records it copied, relative to `stage`."""
    copied = []
    for path, text in text_files(stage):
        if path.suffix != ".md":
            continue
        in_kit = KIT_ROOT / path.relative_to(stage)
        for target in relative_links(text):
            record = (in_kit.parent / target).resolve()
            if RECORDS in record.parents and record.is_file():
                rel = record.relative_to(KIT_ROOT)
                if not (stage / rel).is_file():
                    _copy(record, stage / rel)
                    copied.append(rel)
    if copied:
        (stage / RECORDS.relative_to(KIT_ROOT) / "README.md").write_text(RECORDS_README)
    return sorted(copied)


def build(assignment: Assignment, stage: Path, course: Path) -> None:
    """The student repository of `assignment` in the empty folder `stage`."""
    handout = assignment.handout
    work = Path(tempfile.mkdtemp(prefix="release-", dir=stage.parent))
    try:
        handout.starter(work / "tree")
        shutil.move(str(work / "tree" / "starter_code"), str(stage / "starter_code"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for rel in TEST_SUPPORT:
        _copy(KIT_ROOT / rel, stage / rel)
    folder = handout.folder.name
    for part in handout.parts:
        if (handout.folder / part).exists():
            _copy(handout.folder / part, stage / folder / part)
    copy_linked_records(stage)
    has_tests = (stage / folder / "tests").is_dir()
    testpaths = [f"{folder}/tests"] if has_tests else []
    (stage / "pyproject.toml").write_text(student_pyproject((KIT_ROOT / "pyproject.toml").read_text(), testpaths))
    has_handout = (stage / folder / "README.md").is_file()
    (stage / "README.md").write_text(student_readme(handout, has_handout, has_tests))
    shutil.copy2(KIT_ROOT / ".gitignore", stage / ".gitignore")
    shutil.copy2(KIT_ROOT / "LICENSE", stage / "LICENSE")  # pyproject.toml names it
    shutil.copy2(KIT_ROOT / LOCK, stage / LOCK)  # the README's install names it
    source = assignment_source(assignment.name, assignment.report_source)
    make_course(course, {assignment.name: source})
    for path in (course / "release" / assignment.name).iterdir():
        _copy(path, stage / path.name)
    if not (stage / f"{NOTEBOOK_ID}.ipynb").is_file():
        raise ReleaseError(f"nbgrader released no {NOTEBOOK_ID}.ipynb for {assignment.name}: check {source}")


def release(assignment: Assignment, out: Path, course: Path, force: bool = False) -> Path:
    """Build the student repository of `assignment` at `out` (atomically) and the nbgrader course
    at `course`; refuse to publish a bundle that leaks."""
    out, course = out.resolve(), course.resolve()
    if course == out or out in course.parents or course in out.parents:
        raise ReleaseError(f"--course {course} and --out {out} must not contain each other: "
                           "the course holds the solutions")
    if out.exists() and any(out.iterdir()) and not force:
        raise ReleaseError(f"{out} is not empty: pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(assignment, stage, course)
        found = leaks(stage, withheld_lines(assignment, stage / "starter_code"))
        if found:
            raise ReleaseError(f"the {assignment.name} release would leak ({len(found)} hits, first: {found[0]}): "
                               "fix the source")
        dead = dead_links(stage)
        if dead:
            raise ReleaseError(f"the {assignment.name} release has {len(dead)} links to nothing inside it (first: "
                               f"{dead[0]}): link a file the release carries, or a URL")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out
