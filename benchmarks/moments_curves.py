"""The loss curves of AdamW's moments (`optimizer.moments`: float32, bfloat16, int8) on the A2
baseline, read from the runs' metrics.jsonl into one record: each run's validation losses and the
mean of its last training losses, each low-bit run against float32 (seed 0), and float32's seed 0
against its seed 1, the run-to-run noise each difference is held to (issue 43: keep an option
only where its curve stays within it).

    python benchmarks/moments_curves.py OUT    # OUT holds curve-<moments>-seed<seed>/metrics.jsonl

or, where only the trainer's output came back, curve-<moments>-<seed>.log (its lines `step N/T |
... loss X | val_loss Y | ...` every log.every_steps, `finished: ... val loss Y` and `throughput: N
tokens/s` at the end).
It writes OUT/record.json and, with matplotlib, OUT/curves.png. The runs are `onenode train
a2_pretrain/recipes/baseline.yaml` with the settings benchmarks/README.md gives (the commands go
in the record's README beside it).

Any other setting is read the same way against a reference of its own, which has seeds 0 and 1
(`--reference sdpa`: curve-sdpa-seed0, curve-sdpa-seed1 and curve-flex-seed0 for the attention
kernel, `model.attention_kernel`).
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
    return summarized(train, val)


STEP_LINE = re.compile(r"^step (\d+)/\d+ \| tokens [\d,]+ \| loss ([\d.eE+-]+)(?: \| val_loss ([\d.eE+-]+))?")
FINISHED = re.compile(r"^finished: (\d+) steps, .* val loss ([\d.eE+-]+)")
THROUGHPUT = re.compile(r"^throughput: ([\d,]+) tokens/s")


def read_log(path: Path) -> dict:
    """`read_curve` from the trainer's output instead of its metrics.jsonl, with the run's throughput
    (its last line, `throughput: N tokens/s`: the whole run, compiles and evaluations included)."""
    train, val, tokens_per_s = [], [], None
    for line in path.read_text(errors="replace").splitlines():
        if match := STEP_LINE.match(line):
            train.append([int(match[1]), float(match[2])])
            if match[3]:
                val.append([int(match[1]), float(match[3])])
        elif (match := FINISHED.match(line)) and not (val and val[-1][0] == int(match[1])):
            val.append([int(match[1]), float(match[2])])
        elif match := THROUGHPUT.match(line):
            tokens_per_s = int(match[1].replace(",", ""))
    return summarized(train, val) | {"tokens_per_s": tokens_per_s}


def summarized(train: list, val: list) -> dict:
    steps = max((step for step, _ in train), default=0)
    tail = [loss for step, loss in train if step > steps - TAIL_STEPS]
    return {"train": train, "val": val, "steps": steps, "tail_mean": sum(tail) / len(tail) if tail else None,
            "final_val": val[-1][1] if val else None}


def compare(curves: dict, reference_name: str = "float32") -> dict:
    """Each run against the reference's seed 0 (its validation loss at the last step that it and both
    reference runs evaluated, and the mean of its last training losses), and whether that difference
    is within the reference's own seed-to-seed one there."""
    reference, other = curves.get(f"{reference_name}-seed0"), curves.get(f"{reference_name}-seed1")
    if reference is None or other is None:
        return {}
    out = {}
    for name, curve in curves.items():
        if name.startswith(f"{reference_name}-"):
            continue
        evaluated = [dict(run["val"]) for run in (reference, other, curve)]
        shared = max(set(evaluated[0]) & set(evaluated[1]) & set(evaluated[2]), default=None)
        noise, differences = {}, {}
        if shared is not None:
            noise["val"] = evaluated[1][shared] - evaluated[0][shared]
            differences["val"] = evaluated[2][shared] - evaluated[0][shared]
        if curve["steps"] == reference["steps"] == other["steps"]:
            noise["tail_mean"] = other["tail_mean"] - reference["tail_mean"]
            differences["tail_mean"] = curve["tail_mean"] - reference["tail_mean"]
        out[name] = {"val_step": shared, f"{reference_name}_seed1_minus_seed0": noise,
                     f"minus_{reference_name}_seed0": differences,
                     "within_noise": bool(differences) and len(differences) == 2
                     and all(abs(differences[key]) <= abs(noise[key]) for key in differences)}
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
    parser.add_argument("out", help="the folder holding curve-<setting>-seed<seed>/ run folders")
    parser.add_argument("--reference", default="float32",
                        help="the setting the others are held to, with its seeds 0 and 1 (default: float32 moments)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    curves = {}
    for path in sorted(out.glob("curve-*")):
        folder = re.fullmatch(r"curve-(\w+)-seed(\d+)", path.name)
        log = re.fullmatch(r"curve-(\w+)-(\d+)\.log", path.name)
        if folder and (path / "metrics.jsonl").is_file():
            curves[f"{folder[1]}-seed{folder[2]}"] = read_curve(path)
        elif log and f"{log[1]}-seed{log[2]}" not in curves:
            curves[f"{log[1]}-seed{log[2]}"] = read_log(path)
    if not curves:
        raise SystemExit(f"no curve-<setting>-seed<seed>/metrics.jsonl or curve-<setting>-<seed>.log under {out}")
    what = (f"the A2 baseline's loss by setting, against {args.reference}'s two seeds" if args.reference != "float32"
            else "the A2 baseline's loss with AdamW's moments in float32 (two seeds), bfloat16 and int8")
    record = {"what": what, "tail_steps": TAIL_STEPS, "reference": args.reference, "curves": curves,
              "comparison": compare(curves, args.reference)}
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
