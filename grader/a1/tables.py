"""A1 in rows and columns: its cohort.csv columns, its terminal table, its leaderboard columns and plot."""

from __future__ import annotations

from pathlib import Path

from ..leaderboard import Entry, number, save_plot
from ..report import part_scores

PARTS = ("moe", "ep", "pp")
CSV_NUMBERS = ("moe_speedup", "ep_tokens_per_s", "ep_step_speedup", "expert_allgather_ratio", "pp_tokens_per_s")


def csv_columns(results: dict) -> dict:
    """Each part's score, the measurements, the profile and seed of the job."""
    extra = results["extra_data"]
    numbers = extra.get("numbers", {})
    row = {f"{part}_score": s for part, s in part_scores(results).items() if part != "notebook"}
    row.update({k: (round(numbers[k], 3) if numbers.get(k) is not None else "") for k in CSV_NUMBERS})
    return {**row, "profile": extra["profile"], "seed": extra["seed"]}


def table(rows: list[dict]) -> list[list[str]]:
    header = ["submission", "score", "part1", "part2", "part3", "moe x", "ep tok/s", "note"]
    return [header] + [[row["name"], f"{row['score']:g}/{row['max_score']:g}",
                        *(f"{row.get(f'{p}_score', 0):g}" for p in PARTS),
                        f"{row['moe_speedup']}" if row["moe_speedup"] != "" else "-",
                        f"{row['ep_tokens_per_s']:.0f}" if row["ep_tokens_per_s"] != "" else "-",
                        row["note"][:60]] for row in rows]


# -- the leaderboard ---------------------------------------------------------------------------
def _percent(results: dict, key: str) -> float | None:
    value = number(results, key)
    return None if value is None else 100 * value


LEADERBOARD_COLUMNS = [  # (header, how to read it from a results.json, format)
    ("score", lambda r: r["score"], "{:g}"),
    ("part 1 (MoE)", lambda r: part_scores(r).get("moe"), "{:g}"),
    ("part 2 (EP)", lambda r: part_scores(r).get("ep"), "{:g}"),
    ("part 3 (PP)", lambda r: part_scores(r).get("pp"), "{:g}"),
    ("MoE speedup", lambda r: number(r, "moe_speedup"), "{:.2f}x"),
    ("EP step speedup", lambda r: number(r, "ep_step_speedup"), "{:.2f}x"),
    ("EP tokens/s", lambda r: number(r, "ep_tokens_per_s"), "{:,.0f}"),
    ("PP tokens/s", lambda r: number(r, "pp_tokens_per_s"), "{:,.0f}"),
    ("MFU % (EP)", lambda r: _percent(r, "ep_mfu"), "{:.2f}"),
    ("MFU % (PP)", lambda r: _percent(r, "pp_mfu"), "{:.2f}"),
]


def leaderboard_columns(entries: list[Entry]) -> list[tuple]:
    return LEADERBOARD_COLUMNS


def plot_throughput(entries: list[Entry], path: Path, plt) -> bool:
    """Tokens/s of a whole step: the starter, then each submission's ep and pp layouts."""
    rows = []
    for entry in entries:
        ep, speedup = number(entry.results, "ep_tokens_per_s"), number(entry.results, "ep_step_speedup")
        starter = ep / speedup if ep and speedup else None
        rows.append((entry.name, starter, ep, number(entry.results, "pp_tokens_per_s")))
    if not any(any(v for v in row[1:]) for row in rows):
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.27
    for i, label in enumerate(("starter (same job)", "ep layout", "pp layout")):
        ax.bar([k + i * width for k in range(len(rows))], [row[1 + i] or 0 for row in rows], width, label=label)
    ax.set_xticks([k + width for k in range(len(rows))], [row[0] for row in rows], rotation=20, ha="right")
    return save_plot(plt, fig, ax, path, "A1 training throughput", "tokens / s")
