"""`onenode-grade leaderboard`: the cohort's results as one static page (and Markdown).

    onenode-grade leaderboard --cohort out/a1 --cohort out/a2 --out site/

reads every `<name>/results.json` that `onenode-grade a1`/`a2` wrote under each --cohort folder
and writes `site/index.html` (one page: inline CSS, a few lines of inline JS to sort columns, no
server, nothing fetched from anywhere), the plots beside it as PNG files, and `leaderboard.md`
with the same tables. Plots need matplotlib; without it the page says so and keeps the tables.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

A1_COLUMNS = [  # (header, how to read it from a results.json, format)
    ("score", lambda r: r["score"], "{:g}"),
    ("part 1 (MoE)", lambda r: _part(r, "moe"), "{:g}"),
    ("part 2 (EP)", lambda r: _part(r, "ep"), "{:g}"),
    ("part 3 (PP)", lambda r: _part(r, "pp"), "{:g}"),
    ("MoE speedup", lambda r: _number(r, "moe_speedup"), "{:.2f}x"),
    ("EP step speedup", lambda r: _number(r, "ep_step_speedup"), "{:.2f}x"),
    ("EP tokens/s", lambda r: _number(r, "ep_tokens_per_s"), "{:,.0f}"),
    ("PP tokens/s", lambda r: _number(r, "pp_tokens_per_s"), "{:,.0f}"),
    ("MFU % (EP)", lambda r: _percent(r, "ep_mfu"), "{:.2f}"),
    ("MFU % (PP)", lambda r: _percent(r, "pp_mfu"), "{:.2f}"),
]
A2_FACTS = [
    ("score", lambda r: r["score"], "{:g}"),
    ("verified", lambda r: "yes" if _number(r, "verified") else "no", "{}"),
    ("params (total)", lambda r: _run(r, "parameters", {}).get("total"), "{:,}"),
    ("params (active)", lambda r: _run(r, "parameters", {}).get("active"), "{:,}"),
    ("data", lambda r: _run(r, "data"), "{}"),
    ("tokens", lambda r: _run(r, "tokens_seen"), "{:,}"),
    ("optimizer", lambda r: _run(r, "optimizer"), "{}"),
]


def _part(results: dict, tag: str) -> float | None:
    scores = [t["score"] for t in results["tests"] if tag in t.get("tags", [])]
    return sum(scores) if scores else None


def _number(results: dict, key: str):
    return results["extra_data"].get("numbers", {}).get(key)


def _percent(results: dict, key: str) -> float | None:
    value = _number(results, key)
    return None if value is None else 100 * value


def _run(results: dict, key: str, default=None):
    return results["extra_data"].get("run", {}).get(key, default)


@dataclass
class Entry:
    name: str
    results: dict
    folder: Path

    @property
    def assignment(self) -> str:
        return self.results["extra_data"].get("assignment", "A1")


def read_cohorts(folders: list[Path]) -> list[Entry]:
    """Every graded submission under the given results folders."""
    entries = []
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a results folder: pass the --out folder of onenode-grade a1/a2")
        for path in sorted(folder.glob("*/results.json")):
            if path.parent.name.startswith("."):
                continue
            try:
                results = json.loads(path.read_text())
            except json.JSONDecodeError:
                raise ValueError(f"{path} is not valid JSON: re-grade that submission") from None
            entries.append(Entry(results["extra_data"]["submission"], results, path.parent))
    if not entries:
        raise FileNotFoundError(f"no */results.json under {', '.join(map(str, folders))}: grade the cohort first")
    return entries


def a2_metric_columns(entries: list[Entry]) -> list[tuple]:
    """One column per leaderboard entry the A2 grader recorded (benchmarks, held-out numbers)."""
    names = list(dict.fromkeys(e["name"] for entry in entries for e in entry.results["leaderboard"]))

    def reader(name):
        return lambda r: next((e["value"] for e in r["leaderboard"] if e["name"] == name), None)

    return [(name, reader(name), "{:.4g}") for name in names]


def table_rows(entries: list[Entry], columns: list[tuple]) -> list[list]:
    """[name, (raw value, text), ...] per entry, best score first."""
    rows = []
    for entry in sorted(entries, key=lambda e: -e.results["score"]):
        cells = [entry.name]
        for _, read, fmt in columns:
            value = read(entry.results)
            missing = value is None or (isinstance(value, float) and not math.isfinite(value))
            cells.append((None, "-") if missing else (value, fmt.format(value)))
        rows.append(cells)
    return rows


def markdown_table(rows: list[list], columns: list[tuple]) -> str:
    lines = ["| submission | " + " | ".join(c[0] for c in columns) + " |",
             "| --- |" + " ---: |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join([row[0].replace("|", "\\|")] + [text for _, text in row[1:]]) + " |")
    return "\n".join(lines)


def html_table(table_id: str, rows: list[list], columns: list[tuple]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(c[0])}</th>" for c in [("submission",), *columns])
    body = ""
    for row in rows:
        cells = f"<td>{e(row[0])}</td>" + "".join(
            f"<td data-value=\"{e(str(value)) if isinstance(value, (int, float)) else ''}\">{e(text)}</td>"
            for value, text in row[1:])
        body += f"<tr>{cells}</tr>\n"
    return f'<table id="{table_id}" class="sortable"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table>'


# -- plots ---------------------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_a2_benchmarks(entries: list[Entry], path: Path, plt) -> bool:
    tasks = list(dict.fromkeys(e["name"] for x in entries for e in x.results["leaderboard"]
                               if e.get("order") != "asc" and e["value"] is not None))
    if not tasks:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks) * max(1, len(entries)) / 2), 4))
    width = 0.8 / len(entries)
    for i, entry in enumerate(entries):
        values = {e["name"]: e["value"] for e in entry.results["leaderboard"]}
        ax.bar([t + i * width for t in range(len(tasks))], [values.get(t) or 0 for t in tasks], width, label=entry.name)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks)
    return _save(plt, fig, ax, path, "A2 benchmarks", "score (higher is better)")


def _metrics(folder: Path) -> list[dict]:
    path = folder / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a log is the submission's: skip what does not parse
    return records


def plot_a2_losses(entries: list[Entry], path: Path, plt) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for entry in entries:
        records = [r for r in _metrics(entry.folder) if isinstance(r.get("loss"), (int, float))
                   and isinstance(r.get("tokens"), (int, float))]
        if records:
            ax.plot([r["tokens"] for r in records], [r["loss"] for r in records], label=entry.name)
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("tokens seen")
    return _save(plt, fig, ax, path, "A2 training loss", "training loss")


def plot_a1_throughput(entries: list[Entry], path: Path, plt) -> bool:
    """Tokens/s of a whole step: the starter, then each submission's ep and pp layouts."""
    rows = []
    for entry in entries:
        ep, speedup = _number(entry.results, "ep_tokens_per_s"), _number(entry.results, "ep_step_speedup")
        starter = ep / speedup if ep and speedup else None
        rows.append((entry.name, starter, ep, _number(entry.results, "pp_tokens_per_s")))
    if not any(any(v for v in row[1:]) for row in rows):
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.27
    for i, label in enumerate(("starter (same job)", "ep layout", "pp layout")):
        ax.bar([k + i * width for k in range(len(rows))], [row[1 + i] or 0 for row in rows], width, label=label)
    ax.set_xticks([k + width for k in range(len(rows))], [row[0] for row in rows], rotation=20, ha="right")
    return _save(plt, fig, ax, path, "A1 training throughput", "tokens / s")


def _save(plt, fig, ax, path: Path, title: str, ylabel: str) -> bool:
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# -- the page ------------------------------------------------------------------------------------
_STYLE = """body{font-family:system-ui,sans-serif;max-width:80em;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{padding:.3em .7em;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}th{cursor:pointer;background:#f4f4f4;user-select:none}
th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}img{max-width:100%;display:block;margin:1em 0}
.note{color:#666}"""
_SORT_JS = """document.querySelectorAll("table.sortable th").forEach(function(th,col){
th.addEventListener("click",function(){var body=th.closest("table").tBodies[0];
var asc=!th.classList.contains("asc");th.parentNode.querySelectorAll("th").forEach(function(h){h.classList.remove("asc","desc")});
th.classList.add(asc?"asc":"desc");var key=function(tr){var td=tr.children[col];var v=td.getAttribute("data-value");
return v!==null&&v!==""?parseFloat(v):td.textContent.toLowerCase()};
Array.from(body.rows).sort(function(a,b){var x=key(a),y=key(b);if(x===y)return 0;
if(typeof x!==typeof y)return typeof x==="number"?-1:1;return (x<y?-1:1)*(asc?1:-1)}).forEach(function(tr){body.appendChild(tr)})})});"""


def build_site(folders: list[Path], out: Path) -> Path:
    """Write out/index.html, out/leaderboard.md and the plots; returns the page."""
    entries = read_cohorts(folders)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    sections, markdown = [], ["# OneNode leaderboard", ""]
    a1 = [e for e in entries if e.assignment == "A1"]
    a2 = [e for e in entries if e.assignment == "A2"]
    e = html.escape
    for title, group, columns, plots in (
            ("A1: a fast training stack", a1, A1_COLUMNS, [("a1_throughput.png", plot_a1_throughput)]),
            ("A2: pretraining within a token budget", a2, A2_FACTS + a2_metric_columns(a2),
             [("a2_benchmarks.png", plot_a2_benchmarks), ("a2_loss.png", plot_a2_losses)])):
        if not group:
            continue
        rows = table_rows(group, columns)
        profiles = sorted({g.results["extra_data"].get("profile", "?") for g in group})
        note = f"{len(group)} submissions, profile {', '.join(profiles)}"
        table_id = title.split(":")[0].lower()
        images = ""
        if plt is None:
            images = "<p class='note'>Plots need matplotlib (pip install matplotlib).</p>"
        else:
            for name, plot in plots:
                if plot(group, out / name, plt):
                    images += f'<img src="{name}" alt="{e(name[:-4].replace("_", " "))}">'
        sections.append(f"<h2>{e(title)}</h2><p class='note'>{e(note)}</p>{html_table(table_id, rows, columns)}{images}")
        markdown += [f"## {title}", "", note, "", markdown_table(rows, columns), ""]
    page = out / "index.html"
    page.write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>OneNode leaderboard</title>
<style>{_STYLE}</style></head><body>
<h1>OneNode leaderboard</h1>
<p class="note">Click a column header to sort. A2 runs marked "no" under verified failed the budget audit and earn no benchmark points.
The same tables are in <a href="leaderboard.md">leaderboard.md</a>.</p>
{''.join(sections)}
<script>{_SORT_JS}</script>
</body></html>
""", encoding="utf-8")
    (out / "leaderboard.md").write_text("\n".join(markdown), encoding="utf-8")
    return page


def register(sub) -> None:
    parser = sub.add_parser("leaderboard", help="the cohort's results as a static site (HTML + PNG + Markdown)")
    parser.add_argument("--cohort", action="append", required=True,
                        help="a results folder of onenode-grade a1 or a2 (repeatable)")
    parser.add_argument("--out", required=True, help="site folder to write (index.html, leaderboard.md, *.png)")
    parser.set_defaults(func=run_leaderboard)


def run_leaderboard(args) -> int:
    page = build_site([Path(c) for c in args.cohort], Path(args.out))
    print(f"leaderboard: {page} (open it in a browser; no server needed)")
    return 0
