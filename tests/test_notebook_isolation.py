"""The report notebook's isolation rule (grader/notebook.py): no test code or instructor file shares
a process or a file system with student code. The sandbox runs the student's notebook with each
test cell replaced by a stand-in that captures the values the test reads; the grader runs the test
cells, from the gradebook, in a Python of its own on those values.

The red team's two ways to the full autograded points without the work fail here: a cell that
finds the course's source notebook (solutions, hidden tests) next to its kernel, and a cell that
blanks every later test cell in its own kernel (an IPython input transformer). The honest answers
still get every point, and an answer that is not plain data fails its test in one clear line.
Fast tests run the trusted parts alone; the slow ones grade whole notebooks in the sandbox."""

import copy
import json
import os
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the course extra: pip install -e '.[course]'")
pytest.importorskip("nbgrader", reason="the course extra: pip install -e '.[course]'")

from grader import notebook  # noqa: E402
from grader.sandbox import capabilities  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "assignments" / "source" / "a1" / "report.ipynb"
REFERENCE = ROOT / "solutions" / "a1" / "report.ipynb"
ANSWERS = ("test_moe_flops", "test_attention_flops", "test_model_flops", "test_mfu")  # read mfu_answer's names
ALL_TESTS = (*ANSWERS, "test_record")


def _release():
    """The A1 notebook as students get it: solutions and hidden tests cleared."""
    from nbgrader.preprocessors import ClearHiddenTests, ClearSolutions

    nb = nbformat.read(SOURCE, as_version=4)
    nb, _ = ClearSolutions().preprocess(copy.deepcopy(nb), {"language": "python"})
    nb, _ = ClearHiddenTests().preprocess(nb, {})
    return nb


def _student(tmp_path: Path, name: str, **answers: str) -> Path:
    """A student's report.ipynb: the release with the answer cells (grade_id=source) replaced."""
    nb = _release()
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell.source = answers.pop(grade_id)
    assert not answers, f"no such cells: {sorted(answers)}"
    path = tmp_path / name / "report.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    return path


def _grade(path: Path) -> tuple[dict[str, dict], dict]:
    """grade_id -> its results.json entry, and the executed notebook the grader kept."""
    logs = path.parent / "out" / "logs"
    logs.mkdir(parents=True)
    entries = {t["name"].removeprefix("Report notebook: "): t for t in notebook.grade(path, logs, "a1")}
    executed = logs.parent / notebook.AUTOGRADED_NAME
    return entries, json.loads(executed.read_text()) if executed.is_file() else {}


def _outputs_of(executed: dict, grade_id: str) -> str:
    cell = next(c for c in executed["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)
    return json.dumps(cell.get("outputs", []))


@pytest.fixture(scope="module")
def sandbox():
    """The slow tests grade in the sandbox: bubblewrap must build it here (the probe of attack (a)
    would find the kit's own source notebook without it)."""
    if not capabilities()["filesystem_isolated"]:
        pytest.skip(f"no sandbox on this machine: {capabilities()['sandbox_problem']}")


# -- the trusted parts alone (fast) -----------------------------------------------------------------
def _tests() -> dict[str, notebook.GradedTest]:
    return notebook.graded_tests(notebook._template("a1"), "a1")


def _answers(**values) -> str:
    """Captured values as the sandbox's stand-in writes them; `opaque=` names hold a non-plain value."""
    opaque = values.pop("opaque", {})

    def enc(v):
        if isinstance(v, (list, tuple)):
            return {type(v).__name__: [enc(x) for x in v]}
        if isinstance(v, dict):
            return {"dict": {k: enc(x) for k, x in v.items()}}
        return v

    return json.dumps({"values": {**{k: enc(v) for k, v in values.items()},
                                  **{k: {"opaque": kind} for k, kind in opaque.items()}}, "missing": []})


def _kit_values() -> dict:
    """The reference notebook's answers, as its kernel holds them while autograding."""
    ns = {"__name__": "__main__"}
    before = os.environ.get("NBGRADER_EXECUTION")
    os.environ["NBGRADER_EXECUTION"] = "autograde"  # the answers must not need the measuring cells
    try:
        for cell in nbformat.read(REFERENCE, as_version=4).cells:
            if cell.cell_type == "code" and not cell.metadata.get("nbgrader", {}).get("grade"):
                exec(cell.source, ns)
    finally:
        if before is None:
            del os.environ["NBGRADER_EXECUTION"]
        else:
            os.environ["NBGRADER_EXECUTION"] = before
    return {k: ns[k] for k in ("moe_flops_per_token", "attention_flops_per_token", "model_flops_per_token", "mfu",
                               "MEASURED", "PROFILES", "speedup")}


def test_the_test_cells_come_from_the_gradebook_with_the_names_they_read():
    tests = _tests()
    assert sorted(tests) == sorted(ALL_TESTS)
    assert "### BEGIN HIDDEN TESTS" in tests["test_moe_flops"].source  # what the grader runs: hidden tests too
    assert tests["test_moe_flops"].reads == ("moe_flops_per_token",)  # not _expected (bound), not abs (builtin)
    assert set(tests["test_model_flops"].reads) == {"model_flops_per_token", "moe_flops_per_token",
                                                    "attention_flops_per_token"}
    assert set(tests["test_record"].reads) == {"MEASURED", "PROFILES", "speedup"}


def test_the_stand_in_holds_no_test_code():
    for test in _tests().values():
        stand_in = notebook._stand_in(test, Path("/scratch/runner/capture.py"), Path("/scratch/answers/0.json"))
        assert "assert" not in stand_in and "_expected" not in stand_in and "HIDDEN" not in stand_in
    assert "assert" not in notebook._CAPTURE and "assert" not in notebook._RUNNER


def _run(values: str | None, *grade_ids: str) -> dict[str, dict]:
    tests = _tests()
    results = notebook.run_tests([(i, tests[g], values) for i, g in enumerate(grade_ids)])
    return {g: results[i] for i, g in enumerate(grade_ids)}


def test_the_kit_answers_pass_every_test_outside_the_kernel():
    results = _run(_answers(**_kit_values()), *ALL_TESTS)
    assert {g: r.get("error") for g, r in results.items()} == dict.fromkeys(ALL_TESTS)
    # 5% too many FLOPs: the hidden part of 2c runs (and fails) in the grader's process
    wrong = _kit_values()
    wrong["model_flops_per_token"] *= 1.05
    assert _run(_answers(**wrong), "test_model_flops")["test_model_flops"]["error"] == [
        "AssertionError", "2c is more than 1% off the reference count"]


@pytest.mark.parametrize("kind", ["__main__.AlwaysRight", "numpy.ndarray", "function"])
def test_a_value_that_is_not_plain_data_fails_its_test_in_one_clear_line(kind):
    values = _kit_values()
    del values["mfu"]
    results = _run(_answers(**values, opaque={"mfu": kind, "moe_flops_per_token": kind}), *ALL_TESTS)
    for grade_id in ("test_moe_flops", "test_model_flops", "test_mfu"):
        name, message = results[grade_id]["error"]
        assert f"is a {kind}, not a plain value" in message and "\n" not in message, (grade_id, message)
    assert results["test_attention_flops"].get("error") is None  # its value was plain


def test_any_use_of_a_value_that_is_not_plain_data_fails():
    """The marker of a non-plain value fails every check a test could make of it, not only isinstance."""
    probes = ["x == 1", "x != 1", "x < 1", "abs(x - 1) <= 1", "bool(x)", "float(x)", "hash(x)", "len(x)", "x['a']",
              "x.real", "x in [1]", "1 in x", "-x", "round(x)", "list(x)", "x()", "1 + x", "2 ** x", "x + 1"]
    source = "\n".join(f"try:\n    {p}\nexcept TypeError:\n    pass\nelse:\n    raise RuntimeError({p!r})"
                       for p in probes)
    probe = notebook.GradedTest("probe", source, ("x",), ())
    results = notebook.run_tests([(0, probe, _answers(opaque={"x": "__main__.AlwaysRight"}))])
    assert results[0].get("error") is None, results[0]


def test_a_test_whose_values_were_never_captured_fails():
    results = _run(None, "test_mfu")
    assert results["test_mfu"]["error"][0] == "NotCaptured"
    assert _run("not json", "test_mfu")["test_mfu"]["error"] == ["ValueError",
                                                                 "the values this test reads could not be read back"]
    assert _run("over", "test_mfu")["test_mfu"]["error"][0] == "ValueError"


def test_a_test_that_never_ends_fails_and_the_others_stand(monkeypatch):
    monkeypatch.setattr(notebook, "TESTS_TIMEOUT_S", 3)
    fine = notebook.GradedTest("fine", "assert x == 1", ("x",), ())
    forever = notebook.GradedTest("forever", "while x: pass", ("x",), ())
    results = notebook.run_tests([(0, fine, _answers(x=1)), (1, forever, _answers(x=1))])
    assert results[0].get("error") is None and results[1]["error"][0] == "TimeoutError"


def test_the_built_notebook_scores_from_the_grader_s_results_only():
    """A failing trusted result is an error output (nbgrader gives 0), a passing one none (full)."""
    failed = notebook._test_outputs({"error": ["AssertionError", "mfu must be a float"]})
    assert [o.output_type for o in failed] == ["error"]
    assert failed[0].traceback == ["AssertionError: mfu must be a float"]
    assert notebook._test_outputs({"stdout": "", "stderr": ""}) == []


def test_the_probe_below_finds_a_course_where_there_is_one(tmp_path, monkeypatch, capsys):
    """The probe the sandbox test runs does find a source notebook and a gradebook next to it (so
    its finding nothing in the sandbox means something)."""
    course = tmp_path / "course"
    (course / "source" / "a1").mkdir(parents=True)
    (course / "source" / "a1" / "report.ipynb").write_text('{"cells": []}')
    (course / "gradebook.db").write_text("")
    work = course / "submitted" / "student" / "a1"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    exec(PROBE_SETUP + PROBE, {"__name__": "__main__"})
    found = json.loads(capsys.readouterr().out.split("FOUND ", 1)[1])
    assert sorted(Path(p).name for p in found) == ["gradebook.db", "report.ipynb"]


# -- whole notebooks through the sandbox (slow) --------------------------------------------------
# Walks the file system it sees (its own kernel's cwd upward, and from /) for the course's files:
# any report.ipynb or gradebook.db, any file holding hidden tests or solutions. If it found the
# source notebook it would run its solution cells, as the red team's cell did.
PROBE = r'''
import os, pathlib
_marks = ("### BEGIN " + "HIDDEN TESTS", "### BEGIN " + "SOLUTION")
_found = []
_skip = {"/proc", "/sys", "/dev", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc"}
_roots = [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]
for _root in _roots:
    for _dir, _dirs, _files in os.walk(_root):
        _dirs[:] = [d for d in _dirs if os.path.join(_dir, d) not in _skip and "site-packages" not in d]
        for _f in _files:
            _path = os.path.join(_dir, _f)
            if _f in ("report.ipynb", "gradebook.db") or (_f.endswith((".ipynb", ".py", ".json"))
                                                           and os.path.getsize(_path) < 1 << 22):
                try:
                    _text = open(_path, errors="replace").read()
                except OSError:
                    continue
                if _f in ("report.ipynb", "gradebook.db") or any(m in _text for m in _marks):
                    _found.append(_path)
    if _found:
        break
_found = sorted(set(_found))
print("FOUND", json.dumps(_found))
for _path in _found:
    if _path.endswith("report.ipynb") and "/source/" in _path:  # the instructor's, not a copy of this one
        for _cell in json.loads(open(_path).read())["cells"]:
            if _cell["metadata"].get("nbgrader", {}).get("grade_id") in ("mfu_answer", "record_answer"):
                exec("".join(_cell["source"]), globals())
'''
PROBE_SETUP = "import json\n"


@pytest.mark.slow
def test_the_sandbox_holds_no_course_file_and_no_test_code(sandbox, tmp_path):
    """Attack (a): the answer cell looks for the instructor's notebook and gradebook from its cwd up
    to / and runs the solution it finds. In the sandbox there is none (no course copy, no source/,
    no gradebook, no test cell source), so nothing is found and every test fails."""
    path = _student(tmp_path, "reader", mfu_answer=PROBE_SETUP + PROBE,
                    record_answer="MEASURED = {'profile': PROFILE, 'before': BEFORE, 'after': AFTER}\n"
                                  "speedup = AFTER['tokens_per_s'] / BEFORE['tokens_per_s']")
    entries, executed = _grade(path)
    printed = _outputs_of(executed, "mfu_answer")
    assert 'FOUND []' in printed, printed
    assert {g: entries[g]["score"] for g in ALL_TESTS} == dict.fromkeys(ALL_TESTS, 0.0)
    assert all("NameError" in entries[g]["output"] for g in ALL_TESTS), [entries[g]["output"] for g in ALL_TESTS]


@pytest.mark.slow
def test_a_kernel_that_blanks_the_test_cells_scores_nothing(sandbox, tmp_path):
    """Attack (b): an input transformer in the student's kernel empties every later cell that holds
    an `assert`; with every answer 0. The tests never reach that kernel, so they all fail."""
    blank = ('moe_flops_per_token = attention_flops_per_token = model_flops_per_token = mfu = 0  # no work\n'
             'get_ipython().input_transformers_cleanup.append(\n'
             '    lambda lines: [] if any("assert" in line for line in lines) else lines)\n')
    entries, executed = _grade(_student(tmp_path, "blanker", mfu_answer=blank, record_answer="MEASURED = None"))
    assert {g: entries[g]["score"] for g in ALL_TESTS} == dict.fromkeys(ALL_TESTS, 0.0), entries
    assert "count FLOPs per token" in entries["test_moe_flops"]["output"]
    assert "not subscriptable" in entries["test_record"]["output"]
    # and one that blanks every later cell, the stand-ins included: nothing captured, nothing passes
    everything = ('moe_flops_per_token = attention_flops_per_token = model_flops_per_token = mfu = 0\n'
                  'get_ipython().input_transformers_cleanup.append(lambda lines: [])\n')
    entries, _ = _grade(_student(tmp_path, "blanks-all", mfu_answer=everything))
    assert {g: entries[g]["score"] for g in ALL_TESTS} == dict.fromkeys(ALL_TESTS, 0.0), entries
    assert all("NotCaptured" in entries[g]["output"] for g in ALL_TESTS)


@pytest.mark.slow
def test_honest_answers_get_full_marks_and_odd_ones_fail_clearly(sandbox, tmp_path):
    """The reference answers: every autograded point; the same answers with numpy scalars: the same
    (they count as their numbers); an answer object that claims to equal anything (it would have
    passed every check in the kernel): its tests fail, saying it is not a plain value."""
    (tmp_path / "reference").mkdir()
    shutil.copy2(REFERENCE, tmp_path / "reference" / "report.ipynb")
    entries, _ = _grade(tmp_path / "reference" / "report.ipynb")
    assert {g: entries[g]["score"] for g in ALL_TESTS} == {g: entries[g]["max_score"] for g in ALL_TESTS}, entries

    reference = nbformat.read(REFERENCE, as_version=4)
    answer = next(c for c in reference.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "mfu_answer")
    as_numpy = answer.source + "\nimport numpy as np\nmfu = np.float64(mfu)\nmoe_flops_per_token = np.int64(" \
                               "moe_flops_per_token)\n"
    always = ("class AlwaysRight(float):\n"
              "    def __eq__(self, other): return True\n"
              "    __lt__ = __le__ = __gt__ = __ge__ = __eq__\n"
              "    def __sub__(self, other): return self\n"
              "    def __abs__(self): return self\n"
              "    __hash__ = float.__hash__\n"
              "moe_flops_per_token = attention_flops_per_token = model_flops_per_token = AlwaysRight(1e8)\n"
              "mfu = AlwaysRight(0.5)\n")
    for name, source in (("numpy", as_numpy), ("always", always)):
        nb = copy.deepcopy(reference)
        next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "mfu_answer").source = source
        (tmp_path / name).mkdir()
        nbformat.write(nb, tmp_path / name / "report.ipynb")
    entries, _ = _grade(tmp_path / "numpy" / "report.ipynb")
    assert {g: entries[g]["score"] for g in ALL_TESTS} == {g: entries[g]["max_score"] for g in ALL_TESTS}, entries
    entries, _ = _grade(tmp_path / "always" / "report.ipynb")
    assert {g: entries[g]["score"] for g in ANSWERS} == dict.fromkeys(ANSWERS, 0.0), entries
    assert entries["test_record"]["score"] == entries["test_record"]["max_score"]
    output = entries["test_moe_flops"]["output"]
    assert output.startswith("failed: AssertionError: moe_flops_per_token must be a number") and \
        "moe_flops_per_token is a __main__.AlwaysRight, not a plain value" in output and "\n" not in output, output
