"""Optimizer-state bytes per parameter for float32, bfloat16 and int8 moments (the state the kit's
optimizer makes for each parameter of a preset, on the meta device: no memory), and the tiny
preset's loss curves from three `onenode train` runs; one JSON record.

    python benchmarks/results/2026-12-04-cpu-low-bit-moments/measure.py RUNS_DIR > record.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from onenode.model import NemotronHForCausalLM
from onenode.model.config import get_preset
from onenode.train import master_update

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.uint8}


def state_bytes(preset: str) -> dict:
    with torch.device("meta"):
        params = list(NemotronHForCausalLM(get_preset(preset)).parameters())
    count = sum(p.numel() for p in params)
    out = {"parameters": count}
    for name, dtype in DTYPES.items():
        optimizer = master_update.AdamWCompactMoments(params, moments_dtype=dtype, lr=1e-3)
        group = optimizer.param_groups[0]
        states = [master_update._state(optimizer, group, p) for p in params]
        moments = sum(t.numel() * t.element_size() for s in states for k, t in s.items() if k != "step")
        out[name] = moments / count  # bytes of moments (codes and scales for int8) a parameter
    return out


def curve(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if isinstance(r.get("step"), int) and "loss" in r]
    return {"losses": losses, "last20_mean": sum(losses[-20:]) / 20, "steps_100_to_150_mean": sum(losses[99:149]) / 50}


if __name__ == "__main__":
    runs = Path(sys.argv[1])
    curves = {name: curve(runs / name) for name in DTYPES}
    for name in ("bfloat16", "int8"):
        curves[name]["last20_minus_float32"] = curves[name]["last20_mean"] - curves["float32"]["last20_mean"]
    print(json.dumps({"bytes_per_param": {p: state_bytes(p) for p in ("a1-1gpu", "tiny")}, "tiny_200_steps": curves},
                     indent=1))
