"""`onenode-grade leaderboard`: one static page with the A1 and A2 tables, plots beside it,
the same tables in Markdown, every link local; it renders in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from grader.cli import main
from grader.report import results_json, write_json

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


@pytest.fixture
def cohorts(tmp_path):
    """An A1 and an A2 results folder as the graders write them (results_json of grader/report.py)."""
    a1, a2 = tmp_path / "a1", tmp_path / "a2"
    for name, moe, ep, speed in (("fast-team", 10, 10, 3.1), ("slow-team", 10, 0, 1.2)):
        tests = [_test("Part 1", moe, 10, "moe"), _test("Part 2", ep, 10, "ep"), _test("Part 3", 0, 10, "pp")]
        numbers = {"moe_speedup": speed, "ep_tokens_per_s": 400.0 * speed, "ep_step_speedup": speed}
        extra = {"profile": "cpu-tiny", "seed": 1, "numbers": numbers}
        _write(a1 / name, results_json(name, tests, [], 1.0, "", extra))
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
    return a1, a2


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


def test_site_has_both_tables_local_links_and_plots(cohorts, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    site = tmp_path / "site"
    assert main(["leaderboard", "--cohort", str(cohorts[0]), "--cohort", str(cohorts[1]), "--out", str(site)]) == 0
    page = (site / "index.html").read_text()
    parser = _Links()
    parser.feed(page)
    assert parser.rows == 2 + 1 + 2 + 1  # two A1 rows, two A2 rows, one header each
    for link in parser.links:
        assert not re.match(r"^[a-z]+:", link), f"{link} leaves the page's folder"
        assert (site / link).is_file(), f"{link} does not resolve to a file beside the page"
    assert {"a1_throughput.png", "a2_benchmarks.png", "a2_loss.png"} <= set(parser.links)
    for png in site.glob("*.png"):
        assert _pixels(png).std() > 0.01, f"{png.name} is blank"
    assert page.index("fast-team") < page.index("slow-team")  # best score first
    markdown = (site / "leaderboard.md").read_text()
    assert "| good-run | 42.5 | yes | 190,000 | 150,000 |" in markdown
    assert "| 0.9 ± 0.031 | 0.3 ± 0.02 | 4.1 |" in markdown  # every benchmark with its standard error
    assert "| bad-run | 0 | no |" in markdown


def test_missing_results_are_one_line(tmp_path, capsys):
    assert main(["leaderboard", "--cohort", str(tmp_path), "--out", str(tmp_path / "site")]) == 2
    assert "grade the cohort first" in capsys.readouterr().err


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs /usr/bin/chromium (Debian package `chromium`)")
def test_page_renders_in_headless_chromium(cohorts, tmp_path):
    pytest.importorskip("matplotlib")
    site = tmp_path / "site"
    assert main(["leaderboard", "--cohort", str(cohorts[0]), "--cohort", str(cohorts[1]), "--out", str(site)]) == 0
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    url = (site / "index.html").as_uri()
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,2400", url], check=True,
                   capture_output=True, timeout=120)
    pixels = _pixels(shot)
    assert pixels.shape[0] >= 2400 and pixels.std() > 0.05  # text, tables and plots, not a blank page
    dom = subprocess.run([*flags, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<tr>") >= 6 and "good-run" in dom and "fast-team" in dom
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
