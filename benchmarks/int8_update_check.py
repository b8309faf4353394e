"""int8 moments' update compiled by inductor against the same update eager, on one device: where
the int8 curve diverged (one H200, issue 43, results/2026-12-05-h200-first-number-moments-curves/)
and the CPU's runs did not, this says whether the compiled step (the only one a GPU runs for int8
codes, `master_update.compiled_update`) is the update at all.

    python benchmarks/int8_update_check.py OUT.json              # cuda
    python benchmarks/int8_update_check.py OUT.json --device cpu  # the same comparison on a CPU

For a few shapes (a row shorter than a block, rows of several blocks, a stack of expert matrices),
six AdamW steps on random bf16 gradients from the same state, eager and compiled: the largest
difference of the weights (against how far they moved), and whether the codes and scales agree.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = [(64, 128), (64, 1024), (8, 512, 1024)]
STEPS = 6


def run(update, shape: tuple, device: torch.device) -> dict:
    from onenode.train import master_update as mu

    generator = torch.Generator(device="cpu").manual_seed(0)
    param = (torch.randn(shape, generator=generator) * 0.02).to(device)
    start = param.clone()
    codes = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(2)]
    scales = [mu._zero_scales(param) for _ in range(2)]
    step = torch.zeros((), device=device)
    for _ in range(STEPS):
        rows = 0.01 + 0.1 * torch.rand((*shape[:-1], 1), generator=generator)
        grad = (torch.randn(shape, generator=generator) * rows).bfloat16().to(device)
        update([param], [grad], [codes[0]], [codes[1]], [step], [None], torch.tensor(6e-4, device=device),
               torch.tensor(1.0, device=device), 0.9, 0.95, 1e-8, 0.1, [tuple(scales)], mu._codebooks(device))
    return {"param": param.cpu(), "start": start.cpu(), "codes": [c.cpu() for c in codes],
            "scales": [s.cpu() for s in scales]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON record to write")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    from onenode.train import master_update as mu

    device = torch.device(args.device)
    compiled = torch.compile(mu._adamw, dynamic=False)
    record = {"device": str(device), "torch": torch.__version__, "steps": STEPS, "shapes": {}}
    for shape in SHAPES:
        eager, graph = run(mu._adamw, shape, device), run(compiled, shape, device)
        moved = float((eager["param"] - eager["start"]).abs().max())
        entry = {"max_difference": float((eager["param"] - graph["param"]).abs().max()), "eager_moved": moved,
                 "compiled_moved": float((graph["param"] - graph["start"]).abs().max()),
                 "codes_equal": all(torch.equal(a, b) for a, b in zip(eager["codes"], graph["codes"])),
                 "scales_equal": all(torch.equal(a, b) for a, b in zip(eager["scales"], graph["scales"]))}
        record["shapes"]["x".join(map(str, shape))] = entry
        print(shape, entry)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
