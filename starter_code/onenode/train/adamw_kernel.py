"""The fused update's GPU kernel: `master_update._adamw`'s AdamW step for any number of parameters in
one Triton launch per kind of parameter (the dtypes of its gradient and moments, whether it has a
bf16 copy), as torch's fused AdamW and apex's multi-tensor apply do.

Why hand-written: `_adamw` compiled by inductor specializes a graph on every chunk's sizes, and a
cold compile of a1-1gpu's 13 distinct chunks took about 100 s of the first step on one H200
(benchmarks/results/2026-12-04-h200-first-number/), most of the time to a first number; symbolic
sizes made the step 24% slower. torch's own fused AdamW (`torch._fused_adamw_`) needs the gradient
in the parameter's dtype, so the bf16 gradients would first be cast to float32 and the bf16 copies
written by another pass (about 48 bytes a parameter against these 28). This kernel compiles once per
kind (a few seconds) whatever the sizes, and launches once per kind a step.

How: every parameter is cut into blocks of `BLOCK` elements; program i updates block i, `STEP`
elements at a time. A table on the device maps each block to its tensor, and each tensor to its
element offsets from the first tensor of each role (master, gradient, moments, copy), so the kernel
reads everything from a few base pointers. The tables follow the tensors' sizes and addresses, and
are built again only when these change (the gradients of an eager step are new tensors each step;
the caching allocator mostly gives them the addresses they had). Bias corrections are computed per tensor with torch ops
on the device from each tensor's step count, as `_adamw` computes them, so the host never waits.

The math, per element, is `_adamw`'s for float32 and bfloat16 moments, in float32. On a CPU the
tests run this kernel in Triton's interpreter (`TRITON_INTERPRET=1`) against `_adamw`.

int8 moments (`master_update`'s docstring) have a kernel of their own, `adamw_int8_blocks`: a
program takes `INT8_BLOCKS` blocks of one tensor (each up to `INT8_BLOCK` elements of
a row), decodes both moments, updates, finds each block's new scale and encodes again, all in
registers: one pass, about 16 bytes a parameter. Inductor's compiled `_adamw` split the same step
into kernels that wrote the decoded moments and their codes in the padded block layout and read
them back into the rows: a1-1gpu's step at 1 x 4096 on one H100 took 145 ms with int8 moments
against 71 with float32; with this kernel 83 (benchmarks/results/2026-12-06-h100-int8-kernel-router/).
The kernel moves fewer bytes than float32's but is bound by its arithmetic, not the memory: its
tile sizes changed its time by a few percent (`benchmarks/int8_kernel_configs.py`), while the
encode's divisions made products with each block's reciprocal took it from 35.1 to 28.6 ms over
a1-1gpu's parameters (float32 moments: 24.3).
"""

from __future__ import annotations

import math

import torch

# Elements a program updates (one table lookup), the elements it updates at a time, and its warps:
# 4 elements a thread at a time, about 50 registers for sm_90, so five programs fit an SM. 4096 at
# once on 8 warps (16 a thread) took 214 registers, one program an SM, and its update ran at 23.5 ms
# against inductor's 14.7 on one H200 (benchmarks/adamw_kernel_ptx.py counts them on a CPU).
BLOCK = 8192
STEP = 1024
NUM_WARPS = 8
# int8 moments (`master_update`'s docstring): the elements one scale covers along a row (a shorter row is one
# block), the state's format; then the blocks a program updates, the blocks it updates at a time, its warps
INT8_BLOCK = 256
INT8_BLOCKS = 16
INT8_TILE = 1
INT8_NUM_WARPS = 1
TABLES_KEPT = 16  # on the device: block maps (one a kind) and offsets (an eager step's few gradient layouts)


def available() -> str | None:
    """Why the kernel cannot run here, or None where it can (Triton imports)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e})"
    return None


def supports(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             copy: torch.Tensor | None) -> bool:
    """Whether one parameter's update can be these kernels': float32 master, float moments or int8
    codes of its shape, every tensor contiguous (the kernels read them as flat runs of elements)."""
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([] if copy is None else [copy])
    codes = exp_avg.dtype == torch.uint8 and param.ndim >= 2 and exp_avg.shape == param.shape
    return (param.dtype == torch.float32 and (exp_avg.dtype in (torch.float32, torch.bfloat16) or codes)
            and exp_avg_sq.dtype == exp_avg.dtype and grad.dtype in (torch.float32, torch.bfloat16)
            and (copy is None or copy.dtype in (torch.float32, torch.bfloat16))
            and all(t.is_contiguous() for t in tensors))


def _kernel(name: str = "adamw_blocks"):
    """A Triton kernel of `adamw_triton`, imported on first use: the kit imports where Triton does not."""
    from . import adamw_triton

    return getattr(adamw_triton, name)


def adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
          exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], copies: list[torch.Tensor | None],
          lr: torch.Tensor, coef: torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
          scales: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
          codebooks: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`master_update._adamw` over all the given parameters (`supports`), each kind of parameter in
    one launch; int8 codes with their blocks' `scales` and the `codebooks`, as `_adamw` takes them.
    `lr` and `coef` are 0-d float32 tensors on the device."""
    kinds: dict[tuple, list[int]] = {}
    for i, (grad, exp_avg, copy) in enumerate(zip(grads, exp_avgs, copies)):
        kinds.setdefault((grad.dtype, exp_avg.dtype, None if copy is None else copy.dtype), []).append(i)
    torch._foreach_add_(steps, 1)
    step_values = torch.stack([s.to(params[0].device, torch.float32) for s in steps])
    step_sizes = lr / (1 - beta1 ** step_values)
    bias2_sqrts = (1 - beta2 ** step_values).sqrt()
    hyper = (1 - beta1, beta2, 1 - beta2, eps, weight_decay)  # as `_adamw`'s torch ops round them
    for (_, moments, copy_dtype), members in kinds.items():
        pick = _to(torch.tensor(members), step_values.device) if len(members) < len(params) else None
        columns = [[params[i] for i in members], [grads[i] for i in members], [exp_avgs[i] for i in members],
                   [exp_avg_sqs[i] for i in members], [copies[i] for i in members] if copy_dtype else None]
        per_tensor = (step_sizes if pick is None else step_sizes[pick],
                      bias2_sqrts if pick is None else bias2_sqrts[pick])
        if moments == torch.uint8:
            columns += [[scales[i][0] for i in members], [scales[i][1] for i in members]]
            _launch_int8(columns, *per_tensor, lr, coef, hyper, codebooks)
        else:
            _launch(columns, *per_tensor, lr, coef, hyper)


def _launch(columns: list, step_sizes: torch.Tensor, bias2_sqrts: torch.Tensor, lr: torch.Tensor,
            coef: torch.Tensor, hyper: tuple) -> None:
    """One launch over the tensors of one kind: `columns` = masters, gradients, exp_avgs,
    exp_avg_sqs, copies (None: no copies)."""
    bases = [column[0] if column else None for column in columns]
    rows = _rows(columns)
    numels = tuple(t.numel() for t in rows[0])
    blocks = _cached(("blocks", rows[0][0].device, BLOCK, numels), lambda: _Blocks(numels, BLOCK, rows[0][0].device))
    offsets = _offsets(rows)
    has_copy = columns[4] is not None
    _kernel()[(blocks.count,)](
        blocks.block_tensor, blocks.first_block, offsets.table, blocks.units, step_sizes, bias2_sqrts,
        *bases[:4], bases[4] if has_copy else bases[0], lr, coef, *hyper,
        *offsets.align, HAS_COPY=has_copy, BLOCK=BLOCK, STEP=min(STEP, BLOCK), num_warps=NUM_WARPS)


def _launch_int8(columns: list, step_sizes: torch.Tensor, bias2_sqrts: torch.Tensor, lr: torch.Tensor,
                 coef: torch.Tensor, hyper: tuple, codebooks: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One launch over tensors with int8 moments: `columns` as `_launch`'s, then the exp_avg and
    exp_avg_sq scales."""
    rows = _rows(columns)
    device = rows[0][0].device
    shapes = tuple(tuple(t.shape) for t in rows[0])
    blocks, layout = _cached(("int8", device, INT8_BLOCKS, shapes), lambda: _int8_layout(shapes, device))
    offsets = _offsets(rows)
    has_copy = columns[4] is not None
    _kernel("adamw_int8_blocks")[(blocks.count,)](
        blocks.block_tensor, blocks.first_block, offsets.table, layout.table, step_sizes, bias2_sqrts,
        *[row[0] for row in rows], *codebooks, lr, coef, *hyper, *offsets.align, ROW_ALIGN=layout.align,
        HAS_COPY=has_copy, BLOCKS=INT8_BLOCKS, TILE=min(INT8_TILE, INT8_BLOCKS), WIDTH=INT8_BLOCK,
        num_warps=INT8_NUM_WARPS)


class _Blocks:
    """Which tensor each program of a launch updates, and each tensor's first program and size in
    units (elements, or int8 blocks), `per_program` units a program: they follow the sizes alone,
    so a run makes them once per kind. Made on the host (a GPU's `repeat_interleave` is a
    cumulative sum, which deterministic runs may refuse) and copied."""

    def __init__(self, units: tuple[int, ...], per_program: int, device: torch.device):
        blocks = torch.tensor([-(-n // per_program) for n in units])
        self.count = int(blocks.sum())
        self.first_block = _to((blocks.cumsum(0) - blocks).to(torch.int32), device)
        self.units = _to(torch.tensor(units, dtype=torch.int64), device)
        self.block_tensor = _to(torch.repeat_interleave(torch.arange(len(units), dtype=torch.int32), blocks), device)


class _Int8Layout:
    """Per tensor with int8 moments: its row length in units of `align` (the largest power of two
    up to 16 dividing every row length: the kernel multiplies it back, so the compiler knows each
    block's start aligned), its blocks a row and its blocks in all."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], device: torch.device):
        lengths = [shape[-1] for shape in shapes]
        self.align = _alignment(lengths)
        per_row = [-(-n // min(INT8_BLOCK, n)) for n in lengths]
        self.blocks = [math.prod(shape[:-1]) * k for shape, k in zip(shapes, per_row)]
        self.table = _to(torch.tensor([[n // self.align, k, b] for n, k, b in zip(lengths, per_row, self.blocks)],
                                      dtype=torch.int64), device)


def _int8_layout(shapes: tuple[tuple[int, ...], ...], device: torch.device) -> tuple[_Blocks, _Int8Layout]:
    """The program map over these tensors' int8 blocks, `INT8_BLOCKS` a program, and their layout."""
    layout = _Int8Layout(shapes, device)
    return _Blocks(tuple(layout.blocks), INT8_BLOCKS, device), layout


class _Offsets:
    """Each tensor's element offsets from its role's base (the role's first tensor) in units of
    `align`: per role, the power of two (at most 16) that divides every offset, which the kernel
    multiplies back (so the compiler knows the addresses aligned: vector loads). Computed on int64
    tensors, not per tensor in Python: gradients that move make it again every step, over thousands
    of tensors in the unpatched starter."""

    def __init__(self, addresses: torch.Tensor, element_sizes: torch.Tensor, device: torch.device):
        distances = addresses - addresses[:, :1]  # [roles, tensors], in bytes
        if bool((distances % element_sizes).any()):
            raise ValueError("a tensor does not start at a whole element from its kind's first: "
                             "the fused update's kernel cannot address it")
        offsets = distances // element_sizes
        self.align = tuple(next(a for a in (16, 8, 4, 2, 1) if not bool((role % a).any())) for role in offsets)
        self.table = _to((offsets // torch.tensor(self.align).unsqueeze(1)).T.contiguous(), device)


def _alignment(offsets: list[int]) -> int:
    """The largest power of two up to 16 that divides every offset."""
    align = 16
    while align > 1 and any(offset % align for offset in offsets):
        align //= 2
    return align


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host table on `device`, copied without making the host wait (pinned memory)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


_cache: dict[tuple, _Blocks | _Offsets] = {}


def _cached(key: tuple, make):
    """`make()`, or what it made for `key` among the last `TABLES_KEPT` tables."""
    value = _cache.pop(key, None) or make()
    _cache[key] = value  # the most recent last
    while len(_cache) > TABLES_KEPT:
        del _cache[next(iter(_cache))]
    return value


def _rows(columns: list) -> list[list[torch.Tensor]]:
    """`columns` (a launch's) with a missing column read as the masters' (never written)."""
    return [column if column is not None else columns[0] for column in columns]


def _offsets(rows: list[list[torch.Tensor]]) -> _Offsets:
    """The offsets of these tensors' addresses, made again only when their addresses or sizes change."""
    device = rows[0][0].device
    addresses = [t.data_ptr() for column in rows for t in column]
    key = ("offsets", device, tuple(t.numel() for column in rows for t in column), tuple(addresses))
    return _cached(key, lambda: _Offsets(torch.tensor(addresses, dtype=torch.int64).view(len(rows), -1),
                                         torch.tensor([[column[0].element_size()] for column in rows]), device))
