"""`onenode sweep SWEEP.yaml`: a grid of short proxy runs and a table comparing them.

    name: proxy_study
    base: proxy_dense.yaml             # a recipe, relative to this file
    axes:                              # the grid is every combination of one variant per axis
      arch:
        dense: {}                      # dotted recipe overrides ...
        moe: {recipe: proxy_moe.yaml}  # ... or another recipe as the base of this variant
      optimizer:
        adamw: {optimizer.name: adamw}
        muon: {optimizer.name: muon}

Runs go to OUT/<variant>-<variant>/ (a finished run is reused, so an interrupted sweep picks up
where it stopped); OUT/summary.md, summary.csv, results.json and loss_curves.png compare them.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import shlex
import sys
from pathlib import Path

import yaml

from .checkpoint import write_json
from .cli import add_recipe_arguments, overrides_from
from .logging import environment, git_commit, read_metrics
from .plots import plot_loss_curves
from .recipe import RecipeError, load_recipe


def load_sweep(path: str | Path, extra: dict | None = None) -> tuple[str, list[tuple[str, dict, object]]]:
    """(sweep name, [(run name, {axis: variant}, recipe)]) for every point of the grid."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"sweep {path}: no such file")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - {"name", "base", "axes"}
    if unknown:
        raise RecipeError(f"sweep {path.name}: unknown key(s) {sorted(unknown)} (known: name, base, axes)")
    if not spec.get("base") or not isinstance(spec.get("axes"), dict) or not spec["axes"]:
        raise RecipeError(f"sweep {path.name}: needs `base:` (a recipe) and `axes:` (axis -> variant -> overrides)")
    axes = spec["axes"]
    for axis, variants in axes.items():
        if not isinstance(variants, dict) or not variants:
            raise RecipeError(f"sweep {path.name}: axes.{axis} must map variant names to overrides")
    runs = []
    for combo in itertools.product(*(variants.items() for variants in axes.values())):
        base = path.parent / spec["base"]
        overrides = {}
        for _, changes in combo:
            changes = dict(changes or {})
            if "recipe" in changes:
                base = path.parent / changes.pop("recipe")
            overrides.update(changes)
        name = "-".join(variant for variant, _ in combo)
        recipe = load_recipe(base, {**overrides, **(extra or {}), "name": name})
        runs.append((name, {axis: variant for axis, (variant, _) in zip(axes, combo)}, recipe))
    return spec.get("name") or path.stem, runs


def summarize(run_dir: Path, name: str, point: dict, recipe) -> dict:
    """One row of the comparison: the point, sizes, losses and speed of a finished run."""
    from ..model import count_parameters

    manifest = json.loads((run_dir / "run_manifest.json").read_text())
    records = read_metrics(run_dir)
    speeds = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    total, active = count_parameters(recipe.model_config())
    row = {"run": name, **point, "params_total": total, "params_active": active}
    try:
        from ..flops import model_flops

        row["matmul_flops_per_token"] = model_flops(recipe.model_config(), recipe.train.seq_len).matmul_flops_per_token
    except ImportError:
        pass
    row.update({
        "tokens": manifest["tokens_seen"],
        "final_train_loss": manifest["final_losses"]["train_mean_last_10"],
        "final_val_loss": manifest["final_losses"]["val"],
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "wall_time_s": manifest["wall_time_s"],
    })
    return row


def write_table(rows: list[dict], out: Path) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def run_sweep(path: str | Path, out: str | Path | None = None, overrides: dict | None = None,
              fresh: bool = False, command: str | None = None) -> Path:
    """Run (or reuse) every point, then write the table, the plot and results.json; returns OUT."""
    from .trainer import Trainer

    name, runs = load_sweep(path, overrides)
    out = Path(out or f"runs/{name}")
    rows, curves = [], {}
    for run_name, point, recipe in runs:
        run_dir = out / run_name
        manifest = run_dir / "run_manifest.json"
        done = manifest.is_file() and json.loads(manifest.read_text()).get("status") == "finished"
        if fresh or not done:
            print(f"== {run_name} ({', '.join(f'{k}={v}' for k, v in point.items())})")
            Trainer(recipe, run_dir, resume=None if fresh else "auto").fit()
        rows.append(summarize(run_dir, run_name, point, recipe))
        curves[run_name] = read_metrics(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_table(rows, out)
    plot_loss_curves(curves, out / "loss_curves.png", title=name)
    write_json(out / "results.json", {
        "sweep": str(path), "command": command, "commit": git_commit(), **environment(1), "runs": rows,
    })
    return out


def register(subparsers) -> None:
    parser = subparsers.add_parser("sweep", help="run a grid of short proxy runs and compare them",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="sweep YAML (see a2_pretrain/recipes/sweep_*.yaml)")
    parser.add_argument("--out", default=None, help="sweep folder (default: runs/<sweep name>)")
    parser.add_argument("--fresh", action="store_true", help="rerun points that already finished")
    add_recipe_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        out = run_sweep(args.sweep, args.out, overrides_from(args), fresh=args.fresh,
                        command=shlex.join(["onenode", *sys.argv[1:]]))
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((out / "summary.md").read_text())
    return 0
