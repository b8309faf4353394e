"""int8 moments' update compiled by inductor against the same update eager, on one device: where
the int8 curve diverged (one H200, issue 43, results/2026-12-05-h200-first-number-moments-curves/)
and the CPU's runs did not, this says whether the compiled step (the only one a GPU runs for int8
codes, `master_update.compiled_update`) is the update at all. On one H100 it was not
(results/2026-12-05-h100-int8-fault/: a block's largest second moment wrapped to code 0).

    python benchmarks/int8_update_check.py OUT.json              # cuda
    python benchmarks/int8_update_check.py OUT.json --device cpu  # the same comparison on a CPU

For a few shapes (a row shorter than a block, rows of several blocks, a stack of expert matrices),
six AdamW steps on random bf16 gradients from the same state, eager and compiled: the largest
difference of the weights (against how far they moved), and whether the codes and scales agree.
And the encoding alone (`encodes`): both moments' codes of random blocks, compiled against eager,
how many differ and by how many codes at most (one where the division rounds apart at a code's
boundary; 255 where a block's largest value wrapped to code 0, the fault the GPU check found).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = [(64, 128), (64, 1024), (8, 512, 1024)]
STEPS = 6


def run(update, shape: tuple, device: torch.device) -> dict:
    """`STEPS` steps of `update` (`_adamw` eager or compiled, through `master_update.run_call` as the
    kit's step calls it) on one parameter of `shape` with int8 moments, from zeros."""
    from onenode.train import master_update as mu

    generator = torch.Generator(device="cpu").manual_seed(0)
    param = (torch.randn(shape, generator=generator) * 0.02).to(device)
    start = param.clone()
    blocks = (*shape[:-1], -(-shape[-1] // min(mu.INT8_BLOCK, shape[-1])))
    state = {"step": torch.zeros((), device=device),
             **{key: torch.zeros(shape, dtype=torch.uint8, device=device) for key in ("exp_avg", "exp_avg_sq")},
             **{key: torch.zeros(blocks, device=device) for key in ("exp_avg_scale", "exp_avg_sq_scale")}}
    for _ in range(STEPS):
        rows = 0.01 + 0.1 * torch.rand((*shape[:-1], 1), generator=generator)
        grad = (torch.randn(shape, generator=generator) * rows).bfloat16().to(device)
        mu.run_call(update, [(param, grad, state, None)], torch.tensor(6e-4, device=device),
                    torch.tensor(1.0, device=device), (0.9, 0.95, 1e-8, 0.1))
    return {"param": param.cpu(), "start": start.cpu(),
            "codes": [state[key].cpu() for key in ("exp_avg", "exp_avg_sq")],
            "scales": [state[key].cpu() for key in ("exp_avg_scale", "exp_avg_sq_scale")]}


def encodes(device: torch.device) -> dict:
    """`master_update.int8_codes` of random blocks compiled against eager: codes differing, and by
    how much at most, per moment."""
    from onenode.train import master_update as mu

    generator = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(4096, 1024, generator=generator) * torch.logspace(-4, 0, 1024)).to(device)
    found = {}
    for name, book, toward_zero, values in (("exp_avg", mu.int8_codebooks(device)[0], True, x),
                                            ("exp_avg_sq", mu.int8_codebooks(device)[1], False, x.square())):
        def codes(blocks, book=book, toward_zero=toward_zero):  # with the division `_encode` makes
            return mu.int8_codes(blocks / blocks.abs().amax(-1, keepdim=True), book, toward_zero)

        blocks = values.unflatten(-1, (-1, mu.INT8_BLOCK))
        eager, compiled = codes(blocks), torch.compile(codes, dynamic=False)(blocks)
        difference = (eager.int() - compiled.int()).abs()
        found[name] = {"codes_differing": int((difference > 0).sum()), "max_code_difference": int(difference.max())}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON record to write")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    from onenode.train import master_update as mu

    device = torch.device(args.device)
    eager, compiled = mu.update_on(torch.device("cpu")).run, mu.compiled_update()  # `_adamw` as the kit runs it
    record = {"device": str(device), "torch": torch.__version__, "steps": STEPS, "shapes": {}}
    for shape in SHAPES:
        plain, graph = run(eager, shape, device), run(compiled, shape, device)
        moved = float((plain["param"] - plain["start"]).abs().max())
        entry = {"max_difference": float((plain["param"] - graph["param"]).abs().max()), "eager_moved": moved,
                 "compiled_moved": float((graph["param"] - graph["start"]).abs().max()),
                 "codes_equal": all(torch.equal(a, b) for a, b in zip(plain["codes"], graph["codes"])),
                 "scales_equal": all(torch.equal(a, b) for a, b in zip(plain["scales"], graph["scales"]))}
        record["shapes"]["x".join(map(str, shape))] = entry
        print(shape, entry)
    record["encodes"] = encodes(device)
    print("encodes", record["encodes"])
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
