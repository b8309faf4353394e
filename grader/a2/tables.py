"""A2 in rows and columns: its cohort.csv columns, its terminal table, its leaderboard columns
and plots. Every leaderboard entry the grader recorded (benchmarks, held-out numbers) is a column."""

from __future__ import annotations

import json
from pathlib import Path

from ..leaderboard import Entry, number, plot_profile, save_plot


def _stderr(results: dict, name: str) -> float | None:
    """The standard error the grader recorded beside a leaderboard entry (benchmarks, perplexity)."""
    return results["extra_data"].get("stderr", {}).get(name)


def csv_columns(results: dict) -> dict:
    """Whether the run is verified, then its leaderboard entries, each with its standard error."""
    columns = {"verified": results["extra_data"].get("numbers", {}).get("verified", False)}
    for e in results["leaderboard"]:
        columns[e["name"]] = e["value"]
        if _stderr(results, e["name"]) is not None:
            columns[f"{e['name']} stderr"] = _stderr(results, e["name"])
    return columns


def table(rows: list[dict]) -> list[list[str]]:
    keys = ["name", "score", "verified"] + [k for k in dict.fromkeys(k for r in rows for k in r)
                                            if k not in ("name", "score", "max_score", "verified", "note")]
    return [keys] + [[f"{r.get(k)}" if r.get(k) is not None else "-" for k in keys] for r in rows]


# -- the leaderboard ---------------------------------------------------------------------------
def _run(results: dict, key: str, default=None):
    return results["extra_data"].get("run", {}).get(key, default)


FACTS = [  # (header, how to read it from a results.json, format)
    ("score", lambda r: r["score"], "{:g}"),
    ("verified", lambda r: "yes" if number(r, "verified") else "no", "{}"),
    ("params (total)", lambda r: _run(r, "parameters", {}).get("total"), "{:,}"),
    ("params (active)", lambda r: _run(r, "parameters", {}).get("active"), "{:,}"),
    ("data", lambda r: _run(r, "data"), "{}"),
    ("tokens", lambda r: _run(r, "tokens_seen"), "{:,}"),
    ("optimizer", lambda r: _run(r, "optimizer"), "{}"),
]


def leaderboard_columns(entries: list[Entry]) -> list[tuple]:
    """The run's facts, then one column per leaderboard entry the grader recorded, ± its standard
    error where the evaluation gave one."""
    names = list(dict.fromkeys(e["name"] for entry in entries for e in entry.results["leaderboard"]))

    def reader(name):
        return lambda r: next((e["value"] for e in r["leaderboard"] if e["name"] == name), None)

    def spread(name):
        return lambda r: _stderr(r, name)

    return FACTS + [(name, reader(name), "{:.4g}", spread(name)) for name in names]


def plot_benchmarks(entries: list[Entry], path: Path, plt) -> bool:
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
    return save_plot(plt, fig, ax, path, f"A2 benchmarks, profile {plot_profile(entries)}", "score (higher is better)")


def _metrics(folder: Path) -> list[dict]:
    """The training log the grader kept beside the results (logs/metrics.jsonl)."""
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


def plot_losses(entries: list[Entry], path: Path, plt) -> bool:
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
    return save_plot(plt, fig, ax, path, f"A2 training loss, profile {plot_profile(entries)}", "training loss")
