"""The report notebooks as files: nbgrader metadata, the one PROFILE switch, the hidden tests
against the kit's FLOP model, the reference answers against every test (fast: no nbgrader run);
and the reference notebook run top to bottom on CPU with the tiny preset (slow)."""

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the course extra: pip install -e '.[course]'")

from onenode.flops import layer_flops, mfu, model_flops  # noqa: E402
from onenode.model.config import NemotronHConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {a: ROOT / "assignments" / "source" / a / "report.ipynb" for a in ("a1", "a2")}
REFERENCE = ROOT / "solutions" / "a1" / "report.ipynb"
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)


def nbgrader_meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def by_grade_id(nb) -> dict:
    return {nbgrader_meta(c)["grade_id"]: c for c in nb.cells if nbgrader_meta(c)}


@pytest.mark.parametrize("assignment", sorted(SOURCES))
def test_source_notebook_metadata(assignment):
    nb = nbformat.read(SOURCES[assignment], as_version=4)
    nbformat.validate(nb)
    ids = [nbgrader_meta(c)["grade_id"] for c in nb.cells if nbgrader_meta(c)]
    assert len(ids) == len(set(ids)), "grade_ids must be unique"
    tests = [c for c in nb.cells if nbgrader_meta(c).get("grade") and c.cell_type == "code"]
    written = [c for c in nb.cells if nbgrader_meta(c).get("grade") and c.cell_type == "markdown"]
    assert tests and written, "autograded tests and TA-graded written cells"
    assert all(HIDDEN.search(c.source) for c in tests if nbgrader_meta(c)["grade_id"] != "test_record")
    answers = [c for c in nb.cells if nbgrader_meta(c).get("solution") and c.cell_type == "code"]
    assert answers and all("### BEGIN SOLUTION" in c.source for c in answers)
    # One switch at the top: the first code cell sets PROFILE, no other cell assigns it.
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert re.search(r'^PROFILE = "cpu-tiny"$', code[0].source, re.M)
    assert not any(re.search(r"^PROFILE\s*=", c.source, re.M) for c in code[1:])
    # Anything that runs a command is skipped while nbgrader autogrades.
    for c in code[1:]:
        if re.search(r"\bbench\(|subprocess\.run", c.source):
            assert "if not AUTOGRADING" in c.source, c.source


def _a1_config() -> tuple[dict, float]:
    nb = nbformat.read(SOURCES["a1"], as_version=4)
    namespace: dict = {}
    exec(by_grade_id(nb)["mfu_config"].source, namespace)
    return namespace["CONFIG"], namespace["MEASURED_TOKENS_PER_S"]


def _kit_answers(scale: float = 1.0) -> dict:
    """The A1 questions answered with the kit's FLOP model (`onenode.flops`)."""
    raw, tokens_per_s = _a1_config()
    seq_len = raw.pop("seq_len")
    config = NemotronHConfig(name="report", n_group=1, topk_group=1, intermediate_size=4 * raw["hidden_size"], **raw)
    per_token = {kind: 3 * layer_flops(config, kind, seq_len).matmul_total / seq_len for kind in ("moe", "attention")}
    total = model_flops(config, seq_len).matmul_flops_per_token * scale
    return {"moe_flops_per_token": per_token["moe"], "attention_flops_per_token": per_token["attention"],
            "model_flops_per_token": total, "mfu": mfu(tokens_per_s, total)}


def _run_tests(namespace: dict, hidden: bool) -> list[str]:
    """Run every A1 test cell (with or without its hidden part) in `namespace`; failing ids."""
    nb = nbformat.read(SOURCES["a1"], as_version=4)
    failed = []
    for grade_id in ("test_moe_flops", "test_attention_flops", "test_model_flops", "test_mfu"):
        source = by_grade_id(nb)[grade_id].source
        if not hidden:
            source = HIDDEN.sub("", source)
        try:
            exec(source, dict(namespace))
        except AssertionError:
            failed.append(grade_id)
    return failed


def test_hidden_tests_agree_with_the_kit_flop_model():
    assert _run_tests(_kit_answers(), hidden=True) == []
    # 5% too many FLOPs passes the visible sanity checks and fails the hidden ones.
    assert _run_tests(_kit_answers(scale=1.05), hidden=False) == []
    assert _run_tests(_kit_answers(scale=1.05), hidden=True) == ["test_model_flops", "test_mfu"]


def test_reference_notebook_is_the_source_answered():
    source, reference = (nbformat.read(p, as_version=4) for p in (SOURCES["a1"], REFERENCE))
    text = REFERENCE.read_text()
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    assert sorted(by_grade_id(source)) == sorted(by_grade_id(reference))
    for grade_id, cell in by_grade_id(reference).items():
        if nbgrader_meta(cell)["locked"]:  # what nbgrader restores must match the source's release
            assert cell.source.strip() == HIDDEN.sub("", by_grade_id(source)[grade_id].source).strip(), grade_id


def test_reference_answers_pass_every_test(monkeypatch):
    reference = nbformat.read(REFERENCE, as_version=4)
    namespace = {"__name__": "__main__"}
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")  # the answers must not need the measuring cells
    for cell in reference.cells:
        if cell.cell_type == "code" and not nbgrader_meta(cell).get("grade"):
            exec(cell.source, namespace)
    assert _run_tests(namespace, hidden=True) == []
    exec(by_grade_id(reference)["test_record"].source, namespace)


@pytest.mark.slow
def test_reference_notebook_runs_on_cpu_with_the_tiny_preset(tmp_path, monkeypatch):
    """Top to bottom as a student runs it (benchmarks and profile included), PROFILE = cpu-tiny."""
    nbclient = pytest.importorskip("nbclient", reason="the course extra: pip install -e '.[course]'")

    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    nb = nbformat.read(REFERENCE, as_version=4)
    resources = {"metadata": {"path": str(tmp_path)}}
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources=resources).execute()
    runs = tmp_path / "report_runs" / "cpu-tiny"
    assert (runs / "before.json").is_file() and (runs / "after.json").is_file()
    assert any((runs / "profile").iterdir()), "the profile cell wrote no trace"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []


def test_a2_answers_pass_every_test_and_the_points_are_the_rubrics(monkeypatch):
    """The A2 source notebook's own answers pass its tests, hidden parts included, and its graded
    cells add up to the report's points in a2_pretrain/rubric.toml (which the handout's table shows)."""
    from grader.rubric import read_toml

    nb = nbformat.read(SOURCES["a2"], as_version=4)
    graded = [c for c in nb.cells if nbgrader_meta(c).get("grade")]
    assert sum(nbgrader_meta(c)["points"] for c in graded) == read_toml(ROOT / "a2_pretrain/rubric.toml")["points"][
        "notebook"]
    assert "decontamination_statement" in by_grade_id(nb)  # the statement the handout's rule 2 asks for
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")  # as nbgrader runs it: no commands
    namespace = {"__name__": "__main__"}
    for cell in nb.cells:
        if cell.cell_type == "code" and not nbgrader_meta(cell).get("grade"):
            exec(cell.source, namespace)
    for cell in graded:
        if cell.cell_type == "code":
            exec(cell.source, dict(namespace))


def test_a_failed_nbgrader_step_is_one_line_that_names_it():
    """In-process nbgrader steps fail as a NotebookError of one line, not nbgrader's traceback."""
    pytest.importorskip("nbgrader")
    from grader import notebook

    with pytest.raises(notebook.NotebookError) as failed:
        notebook.nbgrader_api(notebook._template("a1"), "autograde", "a1", "nobody")
    message = str(failed.value)
    assert "\n" not in message and message.startswith("nbgrader autograde a1 nobody failed in "), message


RECORDS = ROOT / "benchmarks" / "results"


def _record_value(path: str, key: str) -> float:
    import json

    value = json.loads((ROOT / path).read_text())
    for part in key.split("."):
        value = value[part]
    return float(value)


def test_the_notebooks_figures_are_their_records():
    """Each measured figure a report notebook gives students names the record it comes from, and is
    that record's value: the A1 starter's tokens/s (the one the A1 handout quotes), the A2 per-GPU rate
    (the one-H200 deterministic rate that `replay_tokens_per_s` of the A2 rubric is eight times)."""
    from grader.rubric import read_toml

    a1 = nbformat.read(SOURCES["a1"], as_version=4)
    config = by_grade_id(a1)["mfu_config"].source
    source, key = "benchmarks/results/2026-12-01-h200-fast-stack/starter.json", "results.tokens_per_s"
    assert f"{source}\n# \"{key}\"" in config, "the A1 notebook's MEASURED_TOKENS_PER_S must name its record"
    _, tokens_per_s = _a1_config()
    assert tokens_per_s == round(_record_value(source, key)), f"MEASURED_TOKENS_PER_S is not {source}'s {key}"
    assert f"[{tokens_per_s:,}](../benchmarks/results/2026-12-01-h200-fast-stack/starter.json \"{key}\")" in (
        ROOT / "a1_infra/README.md").read_text(), "the A1 handout quotes another starter figure than the notebook"

    a2 = nbformat.read(SOURCES["a2"], as_version=4)
    question = by_grade_id(a2)["budget_intro"].source
    source, key = "benchmarks/results/2026-12-02-h200-a2-verification/honest.json", \
        "cost.deterministic.throughput.tokens_per_s"
    per_gpu = round(_record_value(source, key))
    assert f"{per_gpu:,} tokens/s per GPU" in question and f"`{source}`" in question and f"`{key}`" in question
    h100x8 = read_toml(ROOT / "a2_pretrain/rubric.toml")["profiles"]["h100x8"]
    assert f"{h100x8['replay_minutes']} minutes at {h100x8['replay_tokens_per_s']:,} tokens/s" in " ".join(
        question.split()), "the A2 notebook's replay figures are not the h100x8 profile's"
    assert round(8 * _record_value(source, key)) == h100x8["replay_tokens_per_s"]
    hidden = by_grade_id(a2)["test_budget"].source
    assert f"{per_gpu:_}" in hidden, "the A2 hidden test checks another per-GPU rate than the question gives"
