"""The fused update's Triton kernel (`train/adamw_kernel.py`) compiled for a Hopper GPU on a CPU
(Triton ships the compiler and ptxas), and what its machine code says about its speed: the registers
a thread takes (a memory-bound kernel needs many warps in flight on each SM, so few registers), and
the vector loads and stores of a whole block (16 bytes each). No GPU needed.

    PYTHONPATH=starter_code python3 benchmarks/adamw_kernel_ptx.py [--block N --warps W ...] [--out F.json]

One row per kind of parameter (the gradient's and moments' dtypes, with or without a bf16 copy) and
per (block, step, warps) asked for; the kit's own `BLOCK`, `STEP` and `NUM_WARPS` by default. A last
row for the int8 moments' kernel (`adamw_int8_blocks`) at the kit's `INT8_BLOCKS`, `INT8_TILE` and
`INT8_NUM_WARPS`: it is bound by its arithmetic, not its loads, so it takes more registers.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = {  # name: (gradients, moments, copies)
    "bf16-grad-copy": ("*bf16", "*fp32", "*bf16"),
    "fp32-grad": ("*fp32", "*fp32", None),
    "bf16-moments": ("*bf16", "*bf16", "*bf16"),
}
INT8 = {"int8": ("*bf16", "*u8", "*bf16")}  # the int8 kernel's, bf16 gradients and copies


def compiled(kind: str, block: int, step: int, warps: int, arch: int = 90):
    """The kernel compiled for `kind`: `block` elements a program, `step` at a time, `warps` warps
    (`int8`: `adamw_int8_blocks` with `block` int8 blocks a program, `step` at a time)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onenode.train import adamw_kernel, adamw_triton

    grads, moments, copies = {**KINDS, **INT8}[kind]
    pointers = {"block_tensor": "*i32", "tensor_first_block": "*i32", "offsets": "*i64",
                "rows" if kind == "int8" else "numels": "*i64", "step_sizes": "*fp32", "bias2_sqrts": "*fp32",
                "masters": "*fp32", "grads": grads, "exp_avgs": moments, "exp_avg_sqs": moments,
                "copies": copies or "*fp32"}
    if kind == "int8":
        pointers |= dict.fromkeys(("exp_avg_scales", "exp_avg_sq_scales", "exp_avg_book", "exp_avg_sq_book"), "*fp32")
    pointers |= {"lr_ptr": "*fp32", "coef_ptr": "*fp32"}
    scalars = {name: "fp32" for name in ("one_minus_beta1", "beta2", "one_minus_beta2", "eps", "weight_decay")}
    constants = {"P_ALIGN": 16, "G_ALIGN": 16, "M_ALIGN": 16, "V_ALIGN": 16, "C_ALIGN": 16}
    if kind == "int8":
        constants |= {"MS_ALIGN": 16, "VS_ALIGN": 16, "ROW_ALIGN": 16, "HAS_COPY": True, "BLOCKS": block,
                      "TILE": step, "WIDTH": adamw_kernel.INT8_BLOCK}
    else:
        constants |= {"HAS_COPY": copies is not None, "BLOCK": block, "STEP": step}
    signature = {**pointers, **scalars, **{name: "constexpr" for name in constants}}
    names = list(signature)
    kernel = adamw_triton.adamw_int8_blocks if kind == "int8" else adamw_triton.adamw_blocks
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(name),): value for name, value in constants.items()},
                       attrs={(names.index(name),): [["tt.divisibility", 16]] for name in pointers})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def facts(kind: str, block: int, step: int, warps: int) -> dict:
    """Registers a thread (ptxas -v) and the vector loads and stores (of the unmasked path)."""
    import triton

    ptx = compiled(kind, block, step, warps).asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    return {"kind": kind, "block": block, "step": step, "warps": warps, "registers": registers,
            "spills": "0 bytes spill stores" not in report,
            "vector_loads": len(re.findall(r"ld\.global[.\w]*\.v[24]", ptx)),
            "vector_stores": len(re.findall(r"st\.global[.\w]*\.v[24]", ptx))}


def main() -> int:
    from onenode.train import adamw_kernel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, nargs="*", default=[adamw_kernel.BLOCK])
    parser.add_argument("--step", type=int, nargs="*", default=[adamw_kernel.STEP])
    parser.add_argument("--warps", type=int, nargs="*", default=[adamw_kernel.NUM_WARPS])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("adamw_kernel_ptx: triton does not import: pip install triton (make setup does)") from None
    rows = [facts(kind, block, step, warps) for block in args.block for step in args.step if step <= block
            for warps in args.warps for kind in KINDS]
    rows.append(facts("int8", adamw_kernel.INT8_BLOCKS, adamw_kernel.INT8_TILE, adamw_kernel.INT8_NUM_WARPS))
    for row in rows:
        print(f"{row['kind']:16} block {row['block']:5} step {row['step']:5} warps {row['warps']:2}: "
              f"{row['registers']:3} registers"
              f"{' (spills)' if row['spills'] else ''}, {row['vector_loads']} vector loads, "
              f"{row['vector_stores']} vector stores")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
