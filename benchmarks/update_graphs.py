"""How many graphs the fused update (`train/master_update.py`) compiles for a preset, by chunk size,
where inductor compiles it (`train.fused_update_kernel: inductor`, or auto with compiled layers; the
Triton kernel of `train/adamw_kernel.py` compiles once per kind of parameter instead).

Run from a kit tree (a patched copy for the solution); nothing is allocated (the meta device):

    PYTHONPATH=starter_code python3 benchmarks/update_graphs.py --preset a1-1gpu --chunks 16 8 4 --out OUT.json

The members are the kit's (float32 master and moments, the bf16 copy's gradient and the copy),
grouped as the kit's AdamW groups them (`weight_decay.param_groups`), flattened and chunked by
`master_update.chunks`. For each chunk size: the update's calls a step, its distinct
graphs (each compiled once, in the first step) and the parameters those graphs trace: what a cold
first step compiles (`results/2026-12-04-cpu-update-graphs/`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from onenode.model import build_model, get_preset
from onenode.train import master_update
from onenode.train.weight_decay import param_groups


def _meta_member(param: torch.Tensor) -> tuple:
    def like(dtype):
        return torch.empty(param.shape, dtype=dtype, device="meta")

    master = like(torch.float32)
    state = {"step": torch.zeros((), device="meta"), "exp_avg": like(torch.float32), "exp_avg_sq": like(torch.float32)}
    return master, like(torch.bfloat16), state, like(torch.bfloat16)


def count(preset: str, chunk: int) -> dict:
    """{"calls", "graphs", "parameters_traced"} of one step's fused update for `preset`."""
    model = build_model(get_preset(preset), device="meta")
    master_update.CHUNK, default = chunk, master_update.CHUNK
    try:
        distinct, calls = {}, 0
        for index, group in enumerate(param_groups(model.named_parameters(), weight_decay=0.1)):
            for signatures, members in master_update.chunks([_meta_member(p) for p in group["params"]]):
                calls += 1
                distinct[(index, signatures)] = len(members)
    finally:
        master_update.CHUNK = default
    return {"calls": calls, "graphs": len(distinct), "parameters_traced": sum(distinct.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="a1-1gpu")
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--out", help="a JSON record")
    args = parser.parse_args()
    rows = {str(chunk): count(args.preset, chunk) for chunk in args.chunks}
    for chunk, row in rows.items():
        print(f"chunk {chunk:>3}: {row['calls']:>5} calls a step, {row['graphs']:>3} graphs, "
              f"{row['parameters_traced']:>4} parameters traced")
    if args.out:
        Path(args.out).write_text(json.dumps({"preset": args.preset, "chunks": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
