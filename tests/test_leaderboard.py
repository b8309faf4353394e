"""`onenode-grade leaderboard`: one static page with a table and plots per assignment and
grading profile, the same tables in Markdown, every link local; it renders in headless Chromium."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from grader.a1 import A1, scoring, tables
from grader.a1.rubric import load_rubric
from grader.cli import main
from grader.cohort import write_cohort_csv
from grader.leaderboard import Entry
from grader.report import results_json, write_json
from grader.runner import SessionResult

CHROMIUM = Path("/usr/bin/chromium")


def _test(name, score, max_score, tag):
    return {"name": name, "score": score, "max_score": max_score,
            "status": "passed" if score >= max_score else "failed",
            "output": "", "visibility": "visible", "tags": [tag]}


def _write(folder: Path, results: dict, metrics: list[dict] | None = None) -> None:
    (folder / "logs").mkdir(parents=True)
    write_json(folder / "results.json", results)
    if metrics:
        (folder / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))


def _a1_cpu(name: str, moe: float, ep: float, speed: float) -> dict:
    """cpu-tiny grades all three parts and the notebook (10 points each here); slow-team's ep step was wrong."""
    tests = [_test("Part 1", moe, 10, "moe"), _test("Part 2", ep, 10, "ep"), _test("Part 3", 0, 10, "pp"),
             _test("Notebook", 5, 10, "notebook")]
    numbers = {"moe_speedup": speed, "reference_tokens_per_s": 3000.0 * speed, "reference_step_speedup": speed}
    if ep:
        numbers.update(ep_tokens_per_s=400.0 * speed, ep_step_speedup=speed)
    return results_json(name, tests, [], 1.0, "", {"profile": "cpu-tiny", "seed": 1, "numbers": numbers})


def _a1_gpu(name: str, moe: float, speed: float) -> dict:
    """h200x1 grades Part 1 alone (10 points; Parts 2 and 3 are there at 0 of 0) and times the
    reference layout's step, with its MFU: the starter ran 9,660 tokens/s at 2.26%."""
    tests = [_test("Part 1", moe, 10, "moe"), _test("Part 2", 0, 0, "ep"), _test("Part 3", 0, 0, "pp")]
    numbers = {"moe_speedup": 13.0, "reference_tokens_per_s": 9660.0 * speed, "reference_step_speedup": speed,
               "reference_mfu": 0.0226 * speed}
    return results_json(name, tests, [], 1.0, "", {"profile": "h200x1", "seed": 7, "numbers": numbers})


@pytest.fixture
def cohorts(tmp_path):
    """Two A1 results folders of two profiles with the same submission names, and an A2 one, as
    the graders write them (results_json of grader/report.py)."""
    a1, gpu, a2 = tmp_path / "a1", tmp_path / "a1-h200x1", tmp_path / "a2"
    for name, moe, ep, speed in (("fast-team", 10, 10, 3.1), ("slow-team", 10, 0, 1.2)):
        _write(a1 / name, _a1_cpu(name, moe, ep, speed))
    for name, moe, speed in (("fast-team", 10, 6.76), ("slow-team", 4, 1.5)):
        _write(gpu / name, _a1_gpu(name, moe, speed))
    for name, acc, verified in (("good-run", 0.9, True), ("bad-run", 0.55, False)):
        tests = [_test("Token budget and run audit", 20 if verified else 0, 20, "budget"),
                 _test("Benchmark: onenode_order", 22.5 if verified else 0, 22.5, "benchmarks")]
        board = [{"name": "onenode_order acc", "value": acc}, {"name": "onenode_cloze acc_norm", "value": acc / 3},
                 {"name": "val loss", "value": 5 - acc, "order": "asc"}]
        extra = {"assignment": "A2", "profile": "cpu-tiny", "seed": 1234, "numbers": {"verified": verified},
                 "stderr": {"onenode_order acc": 0.031, "onenode_cloze acc_norm": 0.02},
                 "run": {"parameters": {"total": 190000, "active": 150000}, "tokens_seen": 24576,
                         "optimizer": "adamw", "data": "solutions/a2/data.yaml"}}
        metrics = [{"step": s, "tokens": 512 * s, "loss": 6.2 - acc * s / 10} for s in range(1, 11)]
        _write(a2 / name, results_json(name, tests, board, 1.0, "", extra), metrics)
    return a1, gpu, a2


def _build(cohorts, site) -> int:
    return main(["leaderboard", *(arg for c in cohorts for arg in ("--cohort", str(c))), "--out", str(site)])


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.rows, self.scripts = [], 0, 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.links += [attrs[k] for k in ("href", "src") if k in attrs]
        self.rows += tag == "tr"
        self.scripts += tag == "script"


def _pixels(png: Path):
    import matplotlib.image

    return matplotlib.image.imread(str(png))


def _section(markdown: str, title: str) -> str:
    start = markdown.index(f"## {title}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end > 0 else None]


def test_site_has_a_table_per_profile_local_links_and_plots(cohorts, tmp_path):
    pytest.importorskip("matplotlib")
    site = tmp_path / "site"
    assert _build(cohorts, site) == 0
    page = (site / "index.html").read_text()
    parser = _Links()
    parser.feed(page)
    assert parser.rows == 3 * (2 + 1)  # A1 on two profiles and A2: two rows and a header each
    for link in parser.links:
        assert not re.match(r"^[a-z]+:", link), f"{link} leaves the page's folder"
        assert (site / link).is_file(), f"{link} does not resolve to a file beside the page"
    assert {"h200x1_a1_throughput.png", "cpu-tiny_a2_benchmarks.png", "cpu-tiny_a2_loss.png"} <= set(parser.links)
    assert "cpu-tiny_a1_throughput.png" not in parser.links  # cpu-tiny scores no whole step: nothing to plot
    for png in site.glob("*.png"):
        assert _pixels(png).std() > 0.01, f"{png.name} is blank"
    markdown = (site / "leaderboard.md").read_text()
    cpu, gpu = (_section(markdown, f"A1: a fast training stack: profile {p}") for p in ("cpu-tiny", "h200x1"))
    assert "graded on profile cpu-tiny, scores out of 40" in cpu and "graded on profile h200x1, scores out of 10" in gpu
    assert cpu.index("fast-team") < cpu.index("slow-team") and gpu.index("fast-team") < gpu.index("slow-team")
    # h200x1: Part 1 only, and the reference layout's whole step with its MFU, from the starter's to the submission's
    assert "part 2 (EP)" not in gpu and "EP step" not in gpu
    assert "| fast-team | 10 | 10 | 13.00x | 9,660 → 65,302 | 2.26 → 15.28 | 6.76x |" in gpu
    assert "reference layout whole step: 9,660 → 65,302 tokens/s, MFU 2.26% → 15.28% (starter → fast-team)" in gpu
    # cpu-tiny: every part it grades, and of the speeds the MoE layer's alone (its whole steps are noise there)
    assert "part 3 (PP)" in cpu and "step" not in cpu.split("| submission")[1]
    assert "| fast-team | 25 | 10 | 10 | 0 | 5 | 3.10x |" in cpu
    assert "| slow-team | 15 | 10 | 0 | 0 | 5 | 1.20x |" in cpu
    assert "MFU: n/a on CPU" in cpu and "Not scored (CPU timing noise)" in cpu
    a2 = _section(markdown, "A2: pretraining within a token budget: profile cpu-tiny")
    assert "| good-run | 42.5 | yes | 190,000 | 150,000 |" in a2
    assert "| 0.9 ± 0.031 | 0.3 ± 0.02 | 4.1 |" in a2  # every benchmark with its standard error
    assert "| bad-run | 0 | no |" in a2


def _env(commit: str, gpus: list[str], date: str) -> dict:
    return {"kit_commit": commit, "date": date, "machine": {"gpus": gpus}}


def test_a_cpu_cohorts_page_shows_no_whole_step_speed(tmp_path):
    """The demo cohort's whole steps on a CPU read 3.10x and 3.01x for submissions that change
    nothing of them: noise that cpu-tiny does not score, so no figure of it is published."""
    cohort = tmp_path / "a1"
    for name, moe in (("starter-unchanged", 0), ("part1-moe", 10)):
        results = _a1_cpu(name, moe, 10, 2.05)
        results["extra_data"]["numbers"].update(reference_tokens_per_s=9300.0, reference_step_speedup=3.10,
                                                ep_tokens_per_s=1240.0, ep_step_speedup=3.01)
        _write(cohort / name, results)
        write_json(cohort / name / "env.json", _env("0123456789abcdef", [], "2026-12-03T10:00:00+00:00"))
    site = tmp_path / "site"
    assert _build([cohort], site) == 0
    page, markdown = (site / "index.html").read_text(), (site / "leaderboard.md").read_text()
    for published in (page, markdown):
        for noise in ("3.10", "3.01", "9,300", "1,240", "3,000", "400"):  # the steps' ratios and tokens/s
            assert noise not in published
        assert "| part1-moe | 25 | 10 | 10 | 0 | 5 | 2.05x |" in markdown  # the MoE layer: scored, shown
        assert "MFU: n/a on CPU" in published and "not scored" in published.lower()
    assert "| starter-unchanged | 15 | 0 | 10 | 0 | 5 | - |" in markdown  # its layer earned nothing: no speed
    assert "kit commit 0123456789ab · profile cpu-tiny · GPU none · graded 2026-12-03 · grading seed 1" in markdown
    assert not list(site.glob("*a1_throughput.png"))


def test_a_zeroed_part_shows_no_speed_and_no_bar(cohorts, tmp_path):
    """wrong-fast-moe: its layer is 12x the starter's and wrong, so Part 1 earns nothing: no ratio,
    no tokens/s, no bar (a speed-up of wrong results is no gain)."""
    gpu = cohorts[1]
    wrong = _a1_gpu("wrong-fast-moe", 0, 5.5)
    wrong["extra_data"]["numbers"]["moe_speedup"] = 12.39
    _write(gpu / "wrong-fast-moe", wrong)
    site = tmp_path / "site"
    assert _build([gpu], site) == 0
    markdown = (site / "leaderboard.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| wrong-fast-moe |"))
    assert row == "| wrong-fast-moe | 0 | 0 | - | - | - | - |"
    assert "12.39" not in markdown and "53,130" not in markdown  # 9,660 x 5.5 tokens/s
    plt = _Pyplot()
    assert tables.plot_throughput(_entries(gpu), tmp_path / "gpu.png", plt)
    assert plt.axes[0].ticks == ["fast-team", "slow-team"]


def test_the_page_says_where_its_results_come_from(cohorts, tmp_path):
    gpu = cohorts[1]
    for name in ("fast-team", "slow-team"):
        write_json(gpu / name / "env.json", _env("9ea1038f00d", ["NVIDIA H200, 143771 MiB, 570.86.15"],
                                                 "2026-12-02T11:57:00+00:00"))
    site = tmp_path / "site"
    assert _build([gpu], site) == 0
    line = "kit commit 9ea1038f00d · profile h200x1 · GPU NVIDIA H200 · graded 2026-12-02 · grading seed 7"
    assert line in (site / "index.html").read_text() and line in (site / "leaderboard.md").read_text()


RECORDED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "2026-12-02-h200-a1-grading-cohort"


def test_a_recorded_cohort_folder_is_published_as_it_is(tmp_path):
    """The kit's record of a GPU cohort (each results.json kept as <name>.json beside its README):
    read in place, its provenance from the README and the folder's date, its zeroed rows bare."""
    site = tmp_path / "site"
    assert _build([RECORDED], site) == 0
    markdown = (site / "leaderboard.md").read_text()
    gpu = _section(markdown, "A1: a fast training stack: profile h200x1")
    assert "kit commit 9ea1038 · profile h200x1 · GPU NVIDIA H200 · graded 2026-12-02 · grading seed 1850118600" in gpu
    rows = {line.split(" | ")[0][2:]: line for line in gpu.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"submission", "part1-moe", "part2-ep", "part3-pp", "reference-full", "starter-unchanged",
                         "wrong-fast-moe"}
    assert rows["wrong-fast-moe"].endswith("| 0 | 0 | - | - | - | - |")  # 12.39x, wrong: not shown
    assert re.search(r"\| reference-full \| 10 \| 10 \| 13\.77x \| 2,7\d\d → 16,364 \| 0\.6\d → 3\.83 \| 5\.89x \|",
                     rows["reference-full"])


def test_a_name_graded_twice_on_one_profile_is_refused(cohorts, tmp_path, capsys):
    again = tmp_path / "a1-again"
    _write(again / "fast-team", _a1_cpu("fast-team", 10, 10, 2.0))
    assert _build([cohorts[0], again], tmp_path / "site") == 2
    err = capsys.readouterr().err
    assert "fast-team is graded twice on profile cpu-tiny" in err and "pass only the --cohort folder" in err


class _Axes:
    """Records what plot_throughput draws on one panel."""

    def __init__(self):
        self.bars, self.ticks, self.title = [], [], ""

    def bar(self, x, heights, width, **style):
        self.bars.append((style.get("label"), list(heights)))

    def set_xticks(self, where, labels, **style):
        self.ticks = list(labels)

    def set_title(self, title, **style):
        self.title = title

    def set_ylabel(self, label):
        pass

    def margins(self, **room):
        pass

    def legend(self, **style):
        pass


class _Pyplot:
    def __init__(self):
        self.axes, self.saved = [], None

    def subplots(self, rows, columns, **options):
        self.axes = [_Axes() for _ in range(columns)]
        figure = SimpleNamespace(suptitle=lambda title: setattr(self, "title", title), tight_layout=lambda: None,
                                 savefig=lambda path, dpi: setattr(self, "saved", path))
        return figure, [self.axes]

    def close(self, figure):
        pass


def _entries(folder: Path) -> list[Entry]:
    return [Entry(p.parent.name, json.loads(p.read_text()), p.parent) for p in sorted(folder.glob("*/results.json"))]


def test_throughput_plot_has_a_panel_per_timed_layout_and_no_empty_bars(cohorts, tmp_path):
    plt = _Pyplot()
    assert tables.plot_throughput(_entries(cohorts[1]), tmp_path / "gpu.png", plt)
    assert plt.title == "A1 whole-step throughput, profile h200x1" and plt.saved == tmp_path / "gpu.png"
    [panel] = plt.axes
    assert panel.title == "reference layout" and panel.ticks == ["fast-team", "slow-team"]
    assert panel.bars == [("starter (same job)", [pytest.approx(9660.0)] * 2),
                          ("submission", [pytest.approx(65301.6), pytest.approx(14490.0)])]
    assert all(h > 0 for a in plt.axes for _, heights in a.bars for h in heights)
    assert not tables.plot_throughput(_entries(cohorts[0]), tmp_path / "cpu.png", plt)  # cpu-tiny scores no step
    entries = _entries(cohorts[0])
    for entry in entries:  # graded under a rubric that scores cpu-tiny's steps
        entry.results["extra_data"]["scored_speeds"] = ["moe_layer", "moe_step", "ep_step"]
    assert tables.plot_throughput(entries, tmp_path / "cpu.png", plt)
    assert [a.title for a in plt.axes] == ["reference layout", "EP layout"]
    assert plt.axes[1].ticks == ["fast-team"]  # slow-team's ep step has no figure: no bar, not an empty slot


def test_cohort_csv_leaves_parts_a_profile_does_not_grade_blank(cohorts, tmp_path):
    results = [json.loads(p.read_text()) for p in sorted(cohorts[1].glob("*/results.json"))]
    write_cohort_csv(A1, tmp_path / "cohort.csv", results)
    with open(tmp_path / "cohort.csv") as f:
        fast = next(csv.DictReader(f))
    assert (fast["profile"], fast["max_score"], fast["moe_score"], fast["ep_score"]) == ("h200x1", "10", "10", "")
    assert (fast["reference_tokens_per_s"], fast["reference_mfu"]) == ("65301.6", "0.153")


def test_h200x1_grading_records_the_reference_steps_tokens_and_mfu(tmp_path, monkeypatch):
    """Part 1 on one GPU: the reference layout's whole step gives the leaderboard its tokens/s,
    its speedup over the starter in the same job and its MFU (the only step that profile times)."""
    monkeypatch.setattr(scoring, "moe_error", lambda ref, sub: 0.0)
    monkeypatch.setattr(scoring, "loss_error", lambda ref, sub: 0.0)
    monkeypatch.setattr(scoring, "moments_error", lambda ref, sub, reading, directions=False: 0.0)  # scored there
    rubric = load_rubric()
    profile = rubric.profiles["h200x1"]
    moe = SessionResult(digests=[[]], seconds=[1.0] * 7)
    reference = SimpleNamespace(moe=moe, moe_exact=moe, train=SessionResult(digests=[{}], seconds=[1.0] * 5))
    job = SimpleNamespace(rubric=rubric, profile=profile, reference=reference)
    runs = {"moe": SessionResult(digests=[[]], seconds=[0.1] * 7), "moe-starter": moe,
            "reference": SessionResult(digests=[{}], seconds=[0.25] * 5)}
    ctx = scoring.Context(job, None, runs, tmp_path)
    scoring.grade_moe(ctx)
    tokens = profile.batch * profile.seq_len
    assert ctx.measurements["reference_tokens_per_s"] == pytest.approx(4 * tokens)
    assert ctx.measurements["reference_step_speedup"] == ctx.measurements["moe_step_speedup"] == pytest.approx(4.0)
    assert ctx.measurements["reference_mfu"] == pytest.approx(scoring.model_flops_utilization(profile, 4 * tokens, 1))
    names = [e["name"] for e in ctx.leaderboard]
    assert names == ["Part 1: MoE speedup", "Step tokens/s (reference layout)", "Step speedup vs starter (reference)",
                     "MFU % (reference layout)"]
    assert any(f"{4 * tokens:,.0f} tokens/s, 4.00x the starter, MFU" in t["output"] for t in ctx.tests)


def test_missing_results_are_one_line(tmp_path, capsys):
    assert main(["leaderboard", "--cohort", str(tmp_path), "--out", str(tmp_path / "site")]) == 2
    assert "grade the cohort first" in capsys.readouterr().err


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs /usr/bin/chromium (Debian package `chromium`)")
def test_page_renders_in_headless_chromium(cohorts, tmp_path):
    pytest.importorskip("matplotlib")
    site = tmp_path / "site"
    assert _build(cohorts, site) == 0
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    url = (site / "index.html").as_uri()
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,2400", url], check=True,
                   capture_output=True, timeout=120)
    pixels = _pixels(shot)
    assert pixels.shape[0] >= 2400 and pixels.std() > 0.05  # text, tables and plots, not a blank page
    dom = subprocess.run([*flags, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<tr>") >= 9 and "good-run" in dom and "fast-team" in dom
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
