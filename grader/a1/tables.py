"""A1 in rows and columns: its cohort.csv columns, its terminal table, its leaderboard columns and plot."""

from __future__ import annotations

from pathlib import Path

from ..leaderboard import Entry, number, plot_profile, save_figure

PARTS = ("moe", "ep", "pp")
# The layouts whose whole step scoring.py times against the starter's in the same job, and their names
LAYOUTS = {"reference": "reference", "ep": "EP", "pp": "PP"}
STEP_NUMBERS = ("tokens_per_s", "step_speedup", "mfu")
CSV_NUMBERS = ("moe_speedup", "expert_traffic_ratio",
               *(f"{layout}_{key}" for layout in LAYOUTS for key in STEP_NUMBERS))


def part_score(results: dict, part: str) -> float | None:
    """A part's score, or None where the job's profile does not grade it (its tests are worth 0)."""
    tests = [t for t in results["tests"] if part in t["tags"]]
    return sum(t["score"] for t in tests) if any(t["max_score"] for t in tests) else None


def csv_columns(results: dict) -> dict:
    """Each part's score (blank where the profile does not grade it), the measurements, the
    profile and seed of the job."""
    extra = results["extra_data"]
    numbers = extra.get("numbers", {})
    scores = {part: part_score(results, part) for part in PARTS}
    row = {f"{part}_score": "" if score is None else score for part, score in scores.items()}
    row.update({k: (round(numbers[k], 3) if numbers.get(k) is not None else "") for k in CSV_NUMBERS})
    return {**row, "profile": extra["profile"], "seed": extra["seed"]}


def table(rows: list[dict]) -> list[list[str]]:
    header = ["submission", "score", "part1", "part2", "part3", "moe x", "step tok/s", "note"]
    return [header] + [[row["name"], f"{row['score']:g}/{row['max_score']:g}",
                        *(f"{row[f'{p}_score']:g}" if row[f"{p}_score"] != "" else "-" for p in PARTS),
                        f"{row['moe_speedup']}" if row["moe_speedup"] != "" else "-",
                        f"{row['reference_tokens_per_s']:.0f}" if row["reference_tokens_per_s"] != "" else "-",
                        row["note"][:60]] for row in rows]


# -- the leaderboard ---------------------------------------------------------------------------
def _percent(results: dict, key: str) -> float | None:
    value = number(results, key)
    return None if value is None else 100 * value


def starter_figure(results: dict, layout: str, key: str) -> float | None:
    """The unpatched starter's tokens/s or MFU in the submission's job, on the same layout: the
    submission's figure over its speedup (both timed in that job)."""
    value, speedup = number(results, f"{layout}_{key}"), number(results, f"{layout}_step_speedup")
    return value / speedup if value is not None and speedup else None


def _against_starter(layout: str, key: str, pattern: str, scale: float = 1.0):
    """A cell's text: the submission's figure, then the starter's in the same job."""
    def text(value, results):
        starter = starter_figure(results, layout, key)
        return pattern.format(value) + (f" (starter {pattern.format(scale * starter)})" if starter else "")
    return text


def _layout_columns(layout: str, name: str) -> list[tuple]:
    """A layout's whole step: tokens/s and MFU, each beside the starter's, and the speedup."""
    return [(f"{name} step tokens/s", lambda r: number(r, f"{layout}_tokens_per_s"),
             _against_starter(layout, "tokens_per_s", "{:,.0f}")),
            (f"{name} step MFU %", lambda r: _percent(r, f"{layout}_mfu"),
             _against_starter(layout, "mfu", "{:.2f}", 100)),
            (f"{name} step vs starter", lambda r: number(r, f"{layout}_step_speedup"), "{:.2f}x")]


LEADERBOARD_COLUMNS = [  # (header, how to read it from a results.json, format)
    ("score", lambda r: r["score"], "{:g}"),
    ("part 1 (MoE)", lambda r: part_score(r, "moe"), "{:g}"),
    ("part 2 (EP)", lambda r: part_score(r, "ep"), "{:g}"),
    ("part 3 (PP)", lambda r: part_score(r, "pp"), "{:g}"),
    ("notebook", lambda r: part_score(r, "notebook"), "{:g}"),
    ("MoE layer vs starter", lambda r: number(r, "moe_speedup"), "{:.2f}x"),
    *(column for layout, name in LAYOUTS.items() for column in _layout_columns(layout, name)),
]


def leaderboard_columns(entries: list[Entry]) -> list[tuple]:
    return LEADERBOARD_COLUMNS


def plot_throughput(entries: list[Entry], path: Path, plt) -> bool:
    """Tokens/s of a whole step, one panel per layout the profile times: each submission beside
    the unpatched starter in its job. A submission with no figure for a layout (its step failed
    or was wrong) has no bars there."""
    panels = {}
    for layout, name in LAYOUTS.items():
        bars = [(entry.name, starter_figure(entry.results, layout, "tokens_per_s"),
                 number(entry.results, f"{layout}_tokens_per_s")) for entry in entries]
        bars = [bar for bar in bars if bar[2] is not None]
        if bars:
            panels[name] = bars
    if not panels:
        return False
    widest = max(len(bars) for bars in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6, len(panels) * (1 + 0.9 * widest)), 4), squeeze=False)
    for ax, (name, bars) in zip(axes[0], panels.items()):
        where = range(len(bars))
        ax.bar([k - 0.2 for k in where], [starter or 0 for _, starter, _ in bars], 0.4, color="0.6",
               label="starter (same job)")
        ax.bar([k + 0.2 for k in where], [value for _, _, value in bars], 0.4, label="submission")
        ax.set_xticks(list(where), [submission for submission, _, _ in bars], rotation=20, ha="right")
        ax.set_title(f"{name} layout", fontsize="medium")
        ax.set_ylabel("tokens / s")
        ax.legend(fontsize="small")
    return save_figure(plt, fig, path, f"A1 whole-step throughput, profile {plot_profile(entries)}")
