"""The loss curves of AdamW's moments (`optimizer.moments`: float32, bfloat16, int8) on the A2
baseline, read from the runs' metrics.jsonl into one record: each run's validation losses and the
mean of its last training losses, each low-bit run against float32 (seed 0), and float32's seed 0
against its seed 1, the run-to-run noise each difference is held to (issue 43: keep an option
only where its curve stays within it).

    python benchmarks/moments_curves.py OUT    # OUT holds curve-<moments>-seed<seed>/metrics.jsonl

It writes OUT/record.json and, with matplotlib, OUT/curves.png. The runs are `onenode train
a2_pretrain/recipes/baseline.yaml` with the settings benchmarks/README.md gives (the commands go
in the record's README beside it).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TAIL_STEPS = 50  # the training losses averaged at the end of a run


def read_curve(folder: Path) -> dict:
    """One run's curve: {"train": [[step, loss]], "val": [[step, val_loss]], "steps", "tail_mean",
    "final_val"}."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [[r["step"], r["loss"]] for r in records if isinstance(r.get("loss"), (int, float))]
    val = [[r["step"], r["val_loss"]] for r in records if isinstance(r.get("val_loss"), (int, float))]
    steps = max((step for step, _ in train), default=0)
    tail = [loss for step, loss in train if step > steps - TAIL_STEPS]
    return {"train": train, "val": val, "steps": steps, "tail_mean": sum(tail) / len(tail) if tail else None,
            "final_val": val[-1][1] if val else None}


def compare(curves: dict) -> dict:
    """Each run against float32 seed 0 at the end of the run (validation loss, mean of the last
    training losses), and whether that difference is within float32's own seed-to-seed one."""
    reference, other = curves.get("float32-seed0"), curves.get("float32-seed1")
    if reference is None or other is None:
        return {}
    noise = {key: abs(other[key] - reference[key]) for key in ("final_val", "tail_mean")
             if other[key] is not None and reference[key] is not None}
    out = {"noise_float32_seed1_minus_seed0": {key: other[key] - reference[key] for key in noise}}
    for name, curve in curves.items():
        if name.startswith("float32"):
            continue
        differences = {key: curve[key] - reference[key] for key in noise if curve[key] is not None}
        out[name] = {"minus_float32_seed0": differences,
                     "within_noise": all(abs(value) <= noise[key] for key, value in differences.items())
                     and len(differences) == len(noise)}
    return out


def plot(curves: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (train, val) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in sorted(curves.items()):
        train.plot(*zip(*curve["train"]), label=name, linewidth=1)
        if curve["val"]:
            val.plot(*zip(*curve["val"]), marker="o", label=name)
    train.set(title="training loss", xlabel="step", ylabel="loss")
    val.set(title="validation loss", xlabel="step")
    train.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the folder holding curve-<moments>-seed<seed>/ run folders")
    args = parser.parse_args(argv)
    out = Path(args.out)
    curves = {}
    for folder in sorted(out.glob("curve-*-seed*")):
        match = re.fullmatch(r"curve-(\w+)-seed(\d+)", folder.name)
        if match and (folder / "metrics.jsonl").is_file():
            curves[f"{match[1]}-seed{match[2]}"] = read_curve(folder)
    if not curves:
        raise SystemExit(f"no curve-<moments>-seed<seed>/metrics.jsonl under {out}")
    record = {"what": "the A2 baseline's loss with AdamW's moments in float32 (two seeds), bfloat16 and int8",
              "tail_steps": TAIL_STEPS, "curves": curves, "comparison": compare(curves)}
    (out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    plotted = plot(curves, out / "curves.png")
    for name, curve in curves.items():
        print(f"{name:<16} steps {curve['steps']:>4}  final val {curve['final_val']}  last {TAIL_STEPS} mean "
              f"{curve['tail_mean']}")
    print(json.dumps(record["comparison"], indent=2))
    print(f"-> {out / 'record.json'}" + (f", {out / 'curves.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
