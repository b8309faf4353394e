"""A1 in rows and columns: its cohort.csv columns and its terminal table."""

from __future__ import annotations

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

