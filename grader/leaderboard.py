"""`onenode-grade leaderboard`: the cohort's results as one static page (and Markdown).

    onenode-grade leaderboard --cohort out/a1 --cohort out/a2 --out site/

reads every `<name>/results.json` that `onenode-grade a1`/`a2` wrote under each --cohort folder
(with its env.json), or a cohort the kit recorded (`benchmarks/results/*-grading-cohort/`: each
submission's results.json kept as `<name>.json` beside a README.md), and writes `site/index.html`
(one page: inline CSS, a few lines of inline JS to sort columns, no server, nothing fetched from
anywhere), the plots beside it as PNG files, and `leaderboard.md` with the same tables. Plots need
matplotlib; without it the page says so and keeps the tables.

Each assignment gets a table and plots per grading profile: scores and speeds of different
machines (cpu-tiny's three parts and notebook beside h200x1's Part 1 alone, a CPU's MoE layer
beside an H200's) are never ranked together. A column that no submission of a profile has (MFU
on CPU, a layout the profile does not grade, a speed the profile does not score) is left out of
that profile's table. Each section says where its results come from: kit commit, profile, GPU,
date and grading seed.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from .assignment import Assignment
from .report import assignment_label


def number(results: dict, key: str):
    """One of a results.json's measurements (extra_data.numbers), or None."""
    return results["extra_data"].get("numbers", {}).get(key)


@dataclass
class Entry:
    name: str
    results: dict
    folder: Path  # where its logs are (a recorded cohort keeps none)
    env: dict = field(default_factory=dict)  # where it ran: its env.json, or what a recorded cohort's README says

    @property
    def assignment(self) -> str:
        return assignment_label(self.results)

    @property
    def profile(self) -> str:
        return self.results["extra_data"].get("profile", "unknown")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not valid JSON: re-grade that submission") from None


def _is_results(obj) -> bool:
    """Whether a JSON file of a recorded cohort is a submission's results.json (not a summary)."""
    return (isinstance(obj, dict) and isinstance(obj.get("tests"), list) and isinstance(obj.get("extra_data"), dict)
            and "submission" in obj["extra_data"])


def recorded_env(folder: Path) -> dict:
    """Where a recorded cohort ran, in env.json's keys, from what it keeps (no env.json): the first
    `commit <sha>` and `NVIDIA <GPU>` its README.md names, the date its folder's name begins with."""
    readme = folder / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    commit = re.search(r"\bcommit ([0-9a-f]{7,40})\b", text)
    gpu = re.search(r"\bNVIDIA [A-Z]+\d+\w*", text)
    date = re.match(r"\d{4}-\d{2}-\d{2}", folder.name)
    return {"kit_commit": commit and commit[1], "machine": {"gpus": [gpu[0]] if gpu else None},
            "date": date and date[0]}


def read_cohorts(folders: list[Path]) -> list[Entry]:
    """Every graded submission under the given results folders: `<name>/results.json` as the
    grader writes them, or else the `<name>.json` results of a cohort the kit recorded."""
    entries = []
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a results folder: pass the --out folder of onenode-grade a1/a2")
        graded = [path for path in sorted(folder.glob("*/results.json")) if not path.parent.name.startswith(".")]
        for path in graded:
            results, env = _read_json(path), path.parent / "env.json"
            entries.append(Entry(results["extra_data"]["submission"], results, path.parent,
                                 _read_json(env) if env.is_file() else {}))
        if not graded:
            recorded = [(path, results) for path in sorted(folder.glob("*.json"))
                        if _is_results(results := _read_json(path))]
            env = recorded_env(folder) if recorded else {}
            entries += [Entry(results["extra_data"]["submission"], results, folder / path.stem, env)
                        for path, results in recorded]
    if not entries:
        raise FileNotFoundError(f"no */results.json (nor a recorded cohort's results) under "
                                f"{', '.join(map(str, folders))}: grade the cohort first")
    return entries


def _gpus(entry: Entry) -> str | None:
    """The GPUs of the machine a submission ran on (env.json's machine.gpus), None if not recorded."""
    gpus = entry.env.get("machine", {}).get("gpus")
    if gpus is None:
        return None
    names = [gpu.split(",")[0].strip() for gpu in gpus]
    return ", ".join(f"{names.count(n)}x {n}" if names.count(n) > 1 else n for n in dict.fromkeys(names)) or "none"


def provenance(entries: list[Entry]) -> str:
    """One line: the kit commit, profile, GPU, date and grading seed the entries were graded with
    (each value they hold, in order; "not recorded" where none holds one)."""
    def values(read) -> str:
        found = list(dict.fromkeys(value for entry in entries if (value := read(entry)) is not None))
        return ", ".join(map(str, found)) or "not recorded"

    return " · ".join([f"kit commit {values(lambda e: (e.env.get('kit_commit') or '')[:12] or None)}",
                       f"profile {values(lambda e: e.profile)}", f"GPU {values(_gpus)}",
                       f"graded {values(lambda e: (e.env.get('date') or '')[:10] or None)}",
                       f"grading seed {values(lambda e: e.results['extra_data'].get('seed'))}"])


def _present(value) -> bool:
    return value is not None and not (isinstance(value, float) and not math.isfinite(value))


def by_profile(entries: list[Entry]) -> dict[str, list[Entry]]:
    """The entries of each grading profile, profiles in name order; a submission graded twice on
    one profile (two --cohort folders holding the same name) is refused: which one counts is the
    instructor's call."""
    groups: dict[str, dict[str, Entry]] = {}
    for entry in entries:
        group = groups.setdefault(entry.profile, {})
        if entry.name in group:
            raise ValueError(f"{entry.name} is graded twice on profile {entry.profile} ({group[entry.name].folder} "
                             f"and {entry.folder}): pass only the --cohort folder whose result counts")
        group[entry.name] = entry
    return {profile: list(groups[profile].values()) for profile in sorted(groups)}


def shown_columns(entries: list[Entry], columns: list[tuple]) -> list[tuple]:
    """The columns that at least one of the entries has a value in."""
    return [c for c in columns if any(_present(c[1](entry.results)) for entry in entries)]


def _text(fmt, value, results: dict) -> str:
    return fmt(value, results) if callable(fmt) else fmt.format(value)


def table_rows(entries: list[Entry], columns: list[tuple]) -> list[list]:
    """[name, (raw value, text), ...] per entry, best score first. A column is (header, read,
    format) or (header, read, format, read its standard error): then the text is "value ± error".
    A format is a str.format pattern, or a function (value, results.json) -> text."""
    rows = []
    for entry in sorted(entries, key=lambda e: -e.results["score"]):
        cells = [entry.name]
        for _, read, fmt, *spread in columns:
            value = read(entry.results)
            if not _present(value):
                cells.append((None, "-"))
                continue
            error = spread[0](entry.results) if spread else None
            cells.append((value, _text(fmt, value, entry.results) + (f" ± {error:.2g}" if _present(error) else "")))
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
def pyplot():
    """matplotlib's pyplot drawing to files, or None without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(plt, fig, ax, path: Path, title: str, ylabel: str) -> bool:
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    return save_figure(plt, fig, path, title)


def save_figure(plt, fig, path: Path, title: str) -> bool:
    """Title the figure (its profile, from the entries' results), write it, let it go."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_profile(entries: list[Entry]) -> str:
    """The grading profile the plotted entries share (the site draws one plot per profile)."""
    return entries[0].profile if entries else "unknown"


# -- the page ------------------------------------------------------------------------------------
_STYLE = """body{font-family:system-ui,sans-serif;max-width:80em;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{padding:.3em .7em;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}th{cursor:pointer;background:#f4f4f4;user-select:none}
th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}img{max-width:100%;display:block;margin:1em 0}
.note{color:#666}.provenance{font-weight:600}"""
_SORT_JS = (
    'document.querySelectorAll("table.sortable th").forEach(function(th,col){\n'
    'th.addEventListener("click",function(){var body=th.closest("table").tBodies[0];\n'
    'var asc=!th.classList.contains("asc");'
    'th.parentNode.querySelectorAll("th").forEach(function(h){h.classList.remove("asc","desc")});\n'
    'th.classList.add(asc?"asc":"desc");'
    'var key=function(tr){var td=tr.children[col];var v=td.getAttribute("data-value");\n'
    'return v!==null&&v!==""?parseFloat(v):td.textContent.toLowerCase()};\n'
    'Array.from(body.rows).sort(function(a,b){var x=key(a),y=key(b);if(x===y)return 0;\n'
    'if(typeof x!==typeof y)return typeof x==="number"?-1:1;return (x<y?-1:1)*(asc?1:-1)})'
    '.forEach(function(tr){body.appendChild(tr)})})});'
)
_NOTE = ('Click a column header to sort. Each grading profile has its own table: its points and its machine\'s '
         'speeds are not comparable with another\'s. Every speed is a ratio to the unpatched starter timed in the '
         'same job; a whole step\'s tokens/s and MFU read starter \u2192 submission. A speed is shown only where the '
         'profile scores it (the rubric\'s scored_speeds: on CPU the MoE layer alone) and its part earned points: '
         'a part that is wrong, failed or no faster than the starter shows none. A2 runs marked "no" under '
         'verified failed the budget audit and earn no benchmark points.')


def _slug(profile: str) -> str:
    """A profile's name as a file name and an HTML id."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", profile)


def _profile_note(group: list[Entry], profile: str) -> str:
    maxima = sorted({g.results["extra_data"].get("max_score", 0) for g in group})
    return (f"{len(group)} submission{'s' * (len(group) != 1)} graded on profile {profile}, scores out of "
            + " or ".join(f"{m:g}" for m in maxima))


def build_site(folders: list[Path], out: Path, assignments: list[Assignment]) -> Path:
    """Write out/index.html, out/leaderboard.md and the plots: per assignment with results, a
    section per grading profile, with its table and its plots; returns the page."""
    entries = read_cohorts(folders)
    out.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    built = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    sections, markdown = [], ["# OneNode leaderboard", "", f"Page built {built}.", ""]
    e = html.escape
    for assignment in assignments:
        graded = [entry for entry in entries if entry.assignment == assignment.label]
        for profile, group in by_profile(graded).items():
            title = f"{assignment.leaderboard_title}: profile {profile}"
            columns = shown_columns(group, assignment.leaderboard_columns(group))
            rows = table_rows(group, columns)
            note = _profile_note(group, profile)
            images = ""
            if plt is None:
                images = "<p class='note'>Plots need matplotlib (pip install matplotlib).</p>"
            else:
                for name, plot in assignment.leaderboard_plots:
                    png = f"{_slug(profile)}_{name}"
                    if plot(group, out / png, plt):
                        images += f'<img src="{png}" alt="{e(name[:-4].replace("_", " "))}, profile {e(profile)}">'
            table = html_table(f"{assignment.name}-{_slug(profile)}", rows, columns)
            origin = f"Graded with {provenance(group)}."
            lines = assignment.leaderboard_headline(group) if assignment.leaderboard_headline else []
            headline = "".join(f"<li>{e(line)}</li>" for line in lines)
            sections.append(f"<h2>{e(title)}</h2><p class='provenance'>{e(origin)}</p><p class='note'>{e(note)}</p>"
                            + (f"<ul class='headline'>{headline}</ul>" if headline else "") + f"{table}{images}")
            markdown += [f"## {title}", "", origin, "", note, "", *(f"- {line}" for line in lines),
                         *([""] if lines else []), markdown_table(rows, columns), ""]
    page = out / "index.html"
    page.write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>OneNode leaderboard</title>
<style>{_STYLE}</style></head><body>
<h1>OneNode leaderboard</h1>
<p class="note">{_NOTE}
The same tables are in <a href="leaderboard.md">leaderboard.md</a>. Page built {built}.</p>
{''.join(sections)}
<script>{_SORT_JS}</script>
</body></html>
""", encoding="utf-8")
    (out / "leaderboard.md").write_text("\n".join(markdown), encoding="utf-8")
    return page
