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
    """cpu-tiny grades all three parts and the notebook (40 points); slow-team's ep step was wrong."""
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
    assert {"cpu-tiny_a1_throughput.png", "h200x1_a1_throughput.png", "cpu-tiny_a2_benchmarks.png",
            "cpu-tiny_a2_loss.png"} <= set(parser.links)
    for png in site.glob("*.png"):
        assert _pixels(png).std() > 0.01, f"{png.name} is blank"
    markdown = (site / "leaderboard.md").read_text()
    cpu, gpu = (_section(markdown, f"A1: a fast training stack: profile {p}") for p in ("cpu-tiny", "h200x1"))
    assert "graded on profile cpu-tiny, scores out of 40" in cpu and "graded on profile h200x1, scores out of 10" in gpu
    assert cpu.index("fast-team") < cpu.index("slow-team") and gpu.index("fast-team") < gpu.index("slow-team")
    # h200x1: Part 1 only, and the reference layout's whole step with its MFU, each beside the starter's
    assert "part 2 (EP)" not in gpu and "EP step" not in gpu
    assert "| fast-team | 10 | 10 | 13.00x | 65,302 (starter 9,660) | 15.28 (starter 2.26) | 6.76x |" in gpu
    # cpu-tiny: every part and layout it grades, no MFU (none on a CPU)
    assert "MFU" not in cpu and "part 3 (PP)" in cpu
    assert ("| fast-team | 25 | 10 | 10 | 0 | 5 | 3.10x | 9,300 (starter 3,000) | 3.10x | 1,240 (starter 400) | 3.10x |"
            in cpu)
    assert "| slow-team | 15 | 10 | 0 | 0 | 5 | 1.20x | 3,600 (starter 3,000) | 1.20x | - | - |" in cpu
    a2 = _section(markdown, "A2: pretraining within a token budget: profile cpu-tiny")
    assert "| good-run | 42.5 | yes | 190,000 | 150,000 |" in a2
    assert "| 0.9 ± 0.031 | 0.3 ± 0.02 | 4.1 |" in a2  # every benchmark with its standard error
    assert "| bad-run | 0 | no |" in a2


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
    assert tables.plot_throughput(_entries(cohorts[0]), tmp_path / "cpu.png", plt)
    assert [a.title for a in plt.axes] == ["reference layout", "EP layout"]
    assert plt.axes[1].ticks == ["fast-team"]  # slow-team's ep step has no figure: no bar, not an empty slot
    assert all(h > 0 for a in plt.axes for _, heights in a.bars for h in heights)


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
