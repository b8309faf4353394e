"""The fused update's kernels timed alone on a GPU over one model's parameters: int8 moments
(`adamw_kernel.adamw_int8_blocks`) at several tile sizes and warp counts, float32 and bfloat16
moments (`adamw_blocks`) beside them, all with bf16 gradients and copies as one process in bf16 has.

    PYTHONPATH=starter_code python3 benchmarks/int8_kernel_configs.py OUT.json [--preset a1-1gpu]
        [--configs 16x1x2 32x2x4 ...]

Each config is BLOCKSxTILExWARPS (`adamw_kernel.INT8_BLOCKS`, `INT8_TILE`, `INT8_NUM_WARPS`). Run it from a patched
tree to time the solution's parameter layout (stacked experts), from the kit for the starter's.
The record gives milliseconds a step and bytes moved a second (16 bytes a parameter for int8, 28
for float32, 20 for bfloat16 moments).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

BYTES = {"int8": 16, "float32": 28, "bfloat16": 20}  # read and written per parameter, scales left out


def members(preset: str, moments: str) -> list[dict]:
    """Every parameter of `preset`'s model as the update sees it, random values on the GPU."""
    from onenode.model import build_model, get_preset
    from onenode.train import adamw_kernel

    shapes = [tuple(p.shape) for p in build_model(get_preset(preset), device="meta").parameters()]
    out = []
    for shape in shapes:
        param = torch.randn(shape, device="cuda")
        int8 = moments == "int8" and len(shape) >= 2
        dtype = torch.uint8 if int8 else getattr(torch, moments) if len(shape) >= 2 else torch.float32
        m = {"param": param, "grad": (torch.randn(shape, device="cuda") * 1e-3).bfloat16(), "copy": param.bfloat16(),
             "step": torch.ones((), device="cuda"),
             "exp_avg": torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8) if int8 else
             (torch.randn(shape, device="cuda") * 1e-3).to(dtype),
             "exp_avg_sq": torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8) if int8 else
             (torch.rand(shape, device="cuda") * 1e-6).to(dtype)}
        if int8:  # one scale a block of a row
            blocks = (*shape[:-1], -(-shape[-1] // min(adamw_kernel.INT8_BLOCK, shape[-1])))
            m["scales"] = (torch.full(blocks, 1e-3, device="cuda"), torch.full(blocks, 1e-6, device="cuda"))
        out.append(m)
    return out


def time_update(update_members: list[dict], repeats: int = 10) -> float:
    """Milliseconds of one `adamw_kernel.adamw` call over the members, the median of `repeats`."""
    from onenode.train import adamw_kernel, master_update

    columns = [[m[k] for m in update_members] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "step", "copy")]
    scales = [m.get("scales") for m in update_members]
    extra = (scales, master_update.int8_codebooks(torch.device("cuda"))) if any(scales) else ()
    lr, coef = torch.tensor(1e-4, device="cuda"), torch.tensor(1.0, device="cuda")
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        adamw_kernel.adamw(*columns, lr, coef, 0.9, 0.95, 1e-8, 0.1, *extra)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--preset", default="a1-1gpu")
    parser.add_argument("--configs", nargs="*",
                        default=["16x1x1", "16x1x2", "32x1x2", "8x1x2", "16x2x2", "16x2x4", "64x1x2"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("int8_kernel_configs.py times kernels on a CUDA GPU: none is visible here", file=sys.stderr)
        return 2
    from onenode.train import adamw_kernel

    rows = []
    for moments in ("float32", "bfloat16", "int8"):
        update_members = members(args.preset, moments)
        params = sum(m["param"].numel() for m in update_members)
        for config in args.configs if moments == "int8" else ["-"]:
            if moments == "int8":
                adamw_kernel.INT8_BLOCKS, adamw_kernel.INT8_TILE, adamw_kernel.INT8_NUM_WARPS = (
                    int(v) for v in config.split("x"))
            ms = time_update(update_members)
            rows.append({"moments": moments, "config": config, "ms": ms, "parameters": params,
                         "bytes_per_s": BYTES[moments] * params / (ms / 1e3)})
            print(f"{moments:9s} {config:8s} {ms:8.2f} ms  {rows[-1]['bytes_per_s'] / 1e12:5.2f} TB/s", flush=True)
        del update_members
        torch.cuda.empty_cache()
    record = {"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
