"""A1 in rows and columns: its cohort.csv columns, its terminal table, its leaderboard columns and plot."""

from __future__ import annotations

import functools
from pathlib import Path

from ..cohort import short_note
from ..leaderboard import Entry, number, plot_profile, save_figure
from .rubric import SPEED_MEASUREMENTS, load_rubric

PARTS = ("moe", "ep", "pp")
# The scored columns of cohort.csv and the table beside the score: the parts, then the notebook
COLUMNS = {"moe": "part1", "ep": "part2", "pp": "part3", "notebook": "notebook"}
# The layouts whose whole step scoring.py times against the starter's in the same job, and their names
LAYOUTS = {"reference": "reference", "ep": "EP", "pp": "PP"}
# The rubric's name of each layout's whole-step speed
STEP_MEASUREMENTS = {"reference": "moe_step", "ep": "ep_step", "pp": "pp_step"}
STEP_NUMBERS = ("tokens_per_s", "step_speedup", "mfu")
CSV_NUMBERS = ("moe_speedup", "expert_traffic_ratio",
               *(f"{layout}_{key}" for layout in LAYOUTS for key in STEP_NUMBERS))


def part_score(results: dict, part: str) -> float | None:
    """A part's score, or None where the job's profile does not grade it (its tests are worth 0)."""
    tests = [t for t in results["tests"] if part in t["tags"]]
    return sum(t["score"] for t in tests) if any(t["max_score"] for t in tests) else None


@functools.cache
def _kit_profiles() -> dict:
    return load_rubric().profiles


def scored_speeds(results: dict) -> list[str]:
    """The speeds the job's profile scored: as the grader recorded them, or (results graded before
    it did) as the kit's rubric scores that profile."""
    extra = results["extra_data"]
    if "scored_speeds" in extra:
        return extra["scored_speeds"]
    profile = _kit_profiles().get(extra.get("profile"))
    return profile.scored_speeds if profile else list(SPEED_MEASUREMENTS)


def shown(results: dict, measurement: str, key: str) -> float | None:
    """A speed figure (extra_data.numbers[key], of `measurement`) where it may be published as a
    gain: the profile scores the measurement and its part earned points (a part wrong, failed or
    no faster than the starter shows none), else None."""
    if measurement not in scored_speeds(results) or not part_score(results, SPEED_MEASUREMENTS[measurement]):
        return None
    return number(results, key)


def _speed_key(key: str) -> str | None:
    """The measurement a CSV number is a figure of (None: not a speed)."""
    if key == "moe_speedup":
        return "moe_layer"
    return next((STEP_MEASUREMENTS[layout] for layout in LAYOUTS if key.startswith(f"{layout}_")), None)


def part_max(results: dict, part: str) -> float | None:
    """A part's maximum, or None where the job does not grade it."""
    return sum(t["max_score"] for t in results["tests"] if part in t["tags"]) or None


def csv_columns(results: dict) -> dict:
    """Each part's and the notebook's score and maximum (blank where the job does not grade it:
    a profile without the part's layout, --no-notebook), the measurements (a speed only where it is
    `shown`: every raw figure stays in results.json), the profile and seed of the job."""
    extra = results["extra_data"]
    row = {}
    for part in COLUMNS:
        score, most = part_score(results, part), part_max(results, part)
        row.update({f"{part}_score": "" if score is None else score, f"{part}_max": "" if most is None else most})
    for key in CSV_NUMBERS:
        value = number(results, key) if _speed_key(key) is None else shown(results, _speed_key(key), key)
        row[key] = round(value, 3) if value is not None else ""
    return {**row, "profile": extra["profile"], "seed": extra["seed"]}


def _maximum(rows: list[dict], key: str) -> float | str | None:
    """The maximum every graded row shares under `key` (None: they differ; "": none grades it)."""
    maxima = {row[key] for row in rows if row["graded"]}
    return maxima.pop() if len(maxima) == 1 else None


def table(rows: list[dict]) -> list[list[str]]:
    """The terminal table: the score, each part's and the notebook's, with the maximum in the
    header where every graded row has the same (else in each cell); the whole step's tokens/s only
    where some row shows it (never on CPU). A submission that was not graded shows "-" (its
    reason is printed below the table)."""
    step = any(row["reference_tokens_per_s"] != "" for row in rows)
    scores = {"score": ("score", "max_score"), **{part: (name, f"{part}_max") for part, name in COLUMNS.items()}}
    maxima = {column: _maximum(rows, most) for column, (_, most) in scores.items()}
    header = ["submission", *(f"{name}/{maxima[column]:g}" if maxima[column] else name
                              for column, (name, _) in scores.items()), "moe x", *(["step tok/s"] * step), "note"]

    def cell(row: dict, column: str) -> str:
        got, most = row["score" if column == "score" else f"{column}_score"], row[scores[column][1]]
        if not row["graded"] or got == "":
            return "-"
        return f"{got:g}" if most == maxima[column] else f"{got:g}/{most:g}"

    return [header] + [[row["name"], *(cell(row, column) for column in scores),
                        f"{row['moe_speedup']}" if row["moe_speedup"] != "" else "-",
                        *([f"{row['reference_tokens_per_s']:.0f}" if row["reference_tokens_per_s"] != "" else "-"]
                          * step),
                        short_note(row["note"]) if row["graded"] else "not graded (below)"] for row in rows]


# -- the leaderboard ---------------------------------------------------------------------------
def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def starter_figure(results: dict, layout: str, key: str) -> float | None:
    """The unpatched starter's tokens/s or MFU in the submission's job, on the same layout: the
    submission's figure over its speedup (both timed in that job)."""
    value, speedup = number(results, f"{layout}_{key}"), number(results, f"{layout}_step_speedup")
    return value / speedup if value is not None and speedup else None


def _arrow(starter: float | None, value: float, pattern: str, scale: float = 1.0) -> str:
    """"starter \u2192 value" (the value alone where the starter's figure is missing)."""
    return (f"{pattern.format(scale * starter)} \u2192 " if starter else "") + pattern.format(value)


def _from_starter(layout: str, key: str, pattern: str, scale: float = 1.0):
    """A cell's text: the starter's figure in the same job, then the submission's."""
    return lambda value, results: _arrow(starter_figure(results, layout, key), value, pattern, scale)


def _layout_columns(layout: str, name: str) -> list[tuple]:
    """A layout's whole step, where shown: tokens/s and MFU, starter -> submission, and the speedup."""
    measurement = STEP_MEASUREMENTS[layout]
    return [(f"{name} step tokens/s", lambda r: shown(r, measurement, f"{layout}_tokens_per_s"),
             _from_starter(layout, "tokens_per_s", "{:,.0f}")),
            (f"{name} step MFU %", lambda r: _percent(shown(r, measurement, f"{layout}_mfu")),
             _from_starter(layout, "mfu", "{:.2f}", 100)),
            (f"{name} step vs starter", lambda r: shown(r, measurement, f"{layout}_step_speedup"), "{:.2f}x")]


LEADERBOARD_COLUMNS = [  # (header, how to read it from a results.json, format)
    ("score", lambda r: r["score"], "{:g}"),
    ("part 1 (MoE)", lambda r: part_score(r, "moe"), "{:g}"),
    ("part 2 (EP)", lambda r: part_score(r, "ep"), "{:g}"),
    ("part 3 (PP)", lambda r: part_score(r, "pp"), "{:g}"),
    ("notebook", lambda r: part_score(r, "notebook"), "{:g}"),
    ("MoE layer vs starter", lambda r: shown(r, "moe_layer", "moe_speedup"), "{:.2f}x"),
    *(column for layout, name in LAYOUTS.items() for column in _layout_columns(layout, name)),
]


def leaderboard_columns(entries: list[Entry]) -> list[tuple]:
    return LEADERBOARD_COLUMNS


def _device(entry: Entry) -> str | None:
    """"cpu" or "cuda": the job's profile as env.json recorded it, else the kit's profile of that name."""
    device = entry.env.get("profile", {}).get("device")
    kit = _kit_profiles().get(entry.profile)
    return device or (kit.device if kit else None)


MEASUREMENT_NAMES = {"moe_layer": "the MoE layer", "moe_step": "the reference layout's whole step",
                     "ep_step": "the EP layout's whole step", "pp_step": "the PP layout's whole step"}


def _fastest(entries: list[Entry], measurement: str, key: str) -> tuple[Entry, float] | None:
    shown_by = [(entry, value) for entry in entries if (value := shown(entry.results, measurement, key)) is not None]
    return max(shown_by, key=lambda pair: pair[1]) if shown_by else None


def headline(entries: list[Entry]) -> list[str]:
    """Per grading job (its seed): the fastest shown MoE layer, and for each whole step the profile
    scores, tokens/s and MFU from the starter's in that job to the fastest submission's; then what
    the profile does not score (shown nowhere)."""
    on_cpu = any(_device(entry) == "cpu" for entry in entries)
    lines = []
    for seed in dict.fromkeys(entry.results["extra_data"].get("seed") for entry in entries):
        job = [entry for entry in entries if entry.results["extra_data"].get("seed") == seed]
        figures = []
        if layer := _fastest(job, "moe_layer", "moe_speedup"):
            figures.append(f"MoE layer: {layer[1]:.2f}x the starter ({layer[0].name})")
        for layout, name in LAYOUTS.items():
            measurement = STEP_MEASUREMENTS[layout]
            if not (fastest := _fastest(job, measurement, f"{layout}_tokens_per_s")):
                continue
            entry, tokens = fastest
            text = (f"{name} layout whole step: "
                    f"{_arrow(starter_figure(entry.results, layout, 'tokens_per_s'), tokens, '{:,.0f}')} tokens/s")
            if (mfu := shown(entry.results, measurement, f"{layout}_mfu")) is not None:
                text += f", MFU {_arrow(starter_figure(entry.results, layout, 'mfu'), 100 * mfu, '{:.2f}%', 100)}"
            figures.append(f"{text} (starter \u2192 {entry.name})")
        if on_cpu:
            figures.append("MFU: n/a on CPU")
        lines.append(f"Grading seed {seed}: " + ("; ".join(figures) or "no submission earned a speed"))
    unscored = [m for m in SPEED_MEASUREMENTS if any(m not in scored_speeds(e.results) for e in entries)]
    if unscored:
        why = "CPU timing noise" if on_cpu else "the rubric's scored_speeds leaves them out"
        lines.append(f"Not scored ({why}), so shown nowhere: {', '.join(MEASUREMENT_NAMES[m] for m in unscored)}.")
    return lines


def plot_throughput(entries: list[Entry], path: Path, plt) -> bool:
    """Tokens/s of a whole step, one panel per layout whose step the profile scores: each
    submission beside the unpatched starter in its job. A submission with no figure shown for a
    layout (not scored, its part earned nothing, its step failed or was wrong) has no bars there."""
    panels = {}
    for layout, name in LAYOUTS.items():
        bars = [(entry.name, starter_figure(entry.results, layout, "tokens_per_s"),
                 shown(entry.results, STEP_MEASUREMENTS[layout], f"{layout}_tokens_per_s")) for entry in entries]
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
        ax.margins(y=0.25)  # room above the tallest bar for the legend
        ax.legend(fontsize="small", loc="upper left")
    return save_figure(plt, fig, path, f"A1 whole-step throughput, profile {plot_profile(entries)}")
