"""The optimizer step of one process in bf16, fused: clip, AdamW on the float32 masters and the bf16
copies written, in one pass over each parameter.

The unfused step (`train_step` everywhere else) reads and writes every parameter's state several
times: each bf16 gradient is cast into a float32 one, the clip reads and rescales those, AdamW reads
gradient, master and moments and writes master and moments, and the next forward casts each
master into its bf16 copy again (`parallel/mixed_precision.py`). Here the bf16 gradients stay on the
copies, the clip's norm is computed from them, and one kernel per parameter (compiled on a GPU)
applies the clip coefficient, updates the master and both moments, and writes the copy: about 30
bytes per parameter instead of 52.

The math is torch's AdamW (decoupled weight decay, bias corrections from each parameter's step
count), on the optimizer's own state, so checkpoints and the unfused step read and continue it. It
applies to plain `torch.optim.AdamW`, at any number of micro-batches: one leaves its bf16 gradients on
the copies; several add theirs up in float32 on the masters (`parallel/mixed_precision.py`), and the
update reads those and still writes the copies, where the unfused step runs the clip, AdamW and
the copies' refresh as passes of their own (torch's AdamW alone took 9.9 ms of the A2 baseline's
279 ms step of two micro-batches on one H100: `difference-det-true.json` of
benchmarks/results/2026-12-06-h100-accumulation-replay-decay-difference/). The first step makes
the state as torch's AdamW would, so it is fused too: what it compiles falls in a run's first step,
which benchmarks leave out as warm-up.

On a GPU the update is one of two (`update_on`, the recipe's `train.fused_update_kernel`):
`adamw_kernel`'s Triton kernel (`KernelUpdate`), one launch per kind of parameter, compiled in
seconds whatever the sizes; or `_adamw` compiled by inductor in chunks (`ChunkedUpdate`), below. A
cold inductor compile of a1-1gpu's chunks took about 100 s of the first step on one H200, the Triton
kernel 8 (benchmarks/results/2026-12-04-h200-first-number/).

The compiled update takes the parameters in chunks of at most `CHUNK`, so its graphs stay the size
of one chunk whatever the model's parameter count. The update is elementwise, so each tensor goes in
flattened and chunks are sorted by dtype and size: parameters of one size share a graph whatever
their shapes, and a model that keeps one parameter per expert matrix (thousands of them) reuses a
few graphs of `CHUNK` equal tensors. The sizes stay static: graphs with symbolic sizes (one per kind
of chunk) made a1-1gpu's step 24% slower on one H200 (55,572 against 68,993 tokens/s at 1 x 4096)
and its first step no faster (benchmarks/results/2026-12-04-h200-update-graphs-node-check/). int8
moments, whose blocks follow rows, keep their shapes. A CPU runs the same function uncompiled, a
loop of small ops: one process in bf16 on a CPU is for tests and smoke runs, and there it checks the
very update a GPU compiles.

int8 moments (`optimizer.moments: int8`): each moment of a tensor of two or more dimensions is kept
as 8-bit codes (uint8: indexes into a map of 256 values) and one float32 scale per block of up to
`INT8_BLOCK` values along a row (the block's largest magnitude), with bitsandbytes' dynamic (tree)
map, signed for exp_avg and unsigned for exp_avg_sq, as bitsandbytes' and torchao's 8-bit AdamW do:
about 2 bytes of state a parameter. 1-D tensors (norms, biases, a few thousand values) keep float32
moments. The step decodes, updates in float32 and encodes in `_adamw`, as plain torch ops, which a
CPU runs; a GPU runs `adamw_kernel`'s int8 kernel, the same math in one pass (inductor's compile of
`_adamw`, `train.fused_update_kernel: inductor`, split it into kernels that made a1-1gpu's step twice
as slow as float32 moments, benchmarks/results/2026-12-06-h100-int8-kernel-router/); torchao's `AdamW8bit`
keeps its codes in a tensor subclass that this chunked update, torch's `load_state_dict`, DCP and
the replay's hashes do not read as plain tensors, so only its map is taken. Codes are rounded toward
zero (exp_avg) and up (exp_avg_sq), not to the nearest: every stored state then keeps AdamW's
|exp_avg| <= ratio x sqrt(exp_avg_sq), the invariant A2's bounds on a step and on the state rest on,
for steps slightly smaller than float32's. Blocks follow rows, so a shard of rows (FSDP2 and expert
parallelism shard dimension 0) holds whole blocks and the scales shard as their parameter does.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.tensor import DTensor

from ..parallel.mixed_precision import MasterWeights
from . import adamw_kernel

CHUNK = 16  # parameters per compiled call: bounds each graph's size (and compile time); a step makes N / CHUNK calls


def applies(weights: MasterWeights | None, optimizer) -> bool:
    """Whether a step can be the fused one, at any number of micro-batches: bf16 copies over float32
    masters, plain AdamW (its moments in the parameters' dtype), or `AdamWCompactMoments` and its
    kinds (`offload.AdamWOffloaded`, one micro-batch: `assembly.assemble` checks), whose step is
    this update."""
    plain = type(optimizer) is torch.optim.AdamW or isinstance(optimizer, AdamWCompactMoments)
    if weights is None or not plain:
        return False
    return not any(group["amsgrad"] or group["maximize"] or group["differentiable"]
                   for group in optimizer.param_groups)


def _state(optimizer: torch.optim.AdamW, group: dict, param: torch.Tensor) -> dict:
    """`param`'s AdamW state, made as torch's AdamW makes it on its first step (a step count on the
    device for its fused and capturable kinds, else on the host; both moments zero), its moments in
    the optimizer's `moments_dtype` where it has one (int8: see the module docstring), placed by the
    optimizer's `place_state` where it has one (`offload.AdamWOffloaded`: pinned host memory).
    A loaded state gets its dtypes back in `_cast_loaded_moments`."""
    state = optimizer.state[param]
    if not state:
        on_device = group["fused"] or group["capturable"]
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else None)
        dtype = _moments_dtype(optimizer, param)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            if dtype == torch.uint8:
                state[f"{key}_scale"] = _zero_scales(param)
        if hasattr(optimizer, "place_state"):
            optimizer.place_state(state)
    return state


def _moments_dtype(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.dtype:
    """The dtype `param`'s moments are stored in: the optimizer's `moments_dtype`, but int8 codes
    (uint8) only for tensors of two or more dimensions (see the module docstring), the others in the
    parameters' dtype."""
    dtype = getattr(optimizer, "moments_dtype", param.dtype)
    return param.dtype if dtype == torch.uint8 and param.ndim < 2 else dtype


def _cast_loaded_moments(optimizer: torch.optim.Optimizer) -> None:
    """Give a loaded state its stored dtypes back (torch's `load_state_dict` casts every state
    tensor but the step to its parameter's dtype): so a resumed run, and a replay's hash of its
    state, read the bits the run had. int8 codes must be whole numbers 0..255."""
    for param, state in optimizer.state.items():
        if "exp_avg" not in state:
            continue
        dtype = _moments_dtype(optimizer, param)
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            if dtype == torch.uint8:
                local = _local(value)
                if not (bool((local == local.round()).all()) and bool(((local >= 0) & (local <= 255)).all())):
                    raise ValueError(f"the optimizer state's {key} holds values that are not 8-bit codes (0..255): "
                                     "load a checkpoint of a run with optimizer.moments: int8")
            state[key] = value.to(dtype)


def _adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], copies: list[torch.Tensor | None],
           lr: torch.Tensor, coef: torch.Tensor, beta1: float, beta2: float, eps: float,
           weight_decay: float, scales: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
           codebooks: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """torch's AdamW step on float32 `params` from gradients of any float dtype times `coef`, each
    updated parameter also written into its copy (None: it has none). Moments stored in a narrower
    dtype (`AdamWCompactMoments`) are updated in the parameters' dtype and rounded once to their own;
    int8 codes (uint8) are decoded with their blocks' `scales` and `codebooks` (module docstring),
    updated in float32 and encoded again."""
    scales = scales or [None] * len(params)
    for param, grad, exp_avg, exp_avg_sq, step, copy, scale in zip(params, grads, exp_avgs, exp_avg_sqs, steps,
                                                                   copies, scales):
        step.add_(1)
        grad = grad.to(param.dtype) * coef
        param.mul_(1 - lr * weight_decay)
        compact = exp_avg.dtype != param.dtype
        if exp_avg.dtype == torch.uint8:
            m, v = _decode(exp_avg, scale[0], codebooks[0]), _decode(exp_avg_sq, scale[1], codebooks[1])
        else:
            m, v = (exp_avg.to(param.dtype), exp_avg_sq.to(param.dtype)) if compact else (exp_avg, exp_avg_sq)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = v.sqrt() / (1 - beta2 ** step).sqrt() + eps
        param.sub_(step_size * m / denom)
        if exp_avg.dtype == torch.uint8:
            _encode(m, exp_avg, scale[0], codebooks[0], toward_zero=True)
            _encode(v, exp_avg_sq, scale[1], codebooks[1], toward_zero=False)
        elif compact:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
        if copy is not None:
            copy.copy_(param)


INT8_BLOCK = adamw_kernel.INT8_BLOCK  # elements a scale covers, along a row (a shorter row is one block)


def dynamic_map(signed: bool) -> list[float]:
    """The 256 values of bitsandbytes' dynamic (tree) quantization map (Dettmers et al. 2022, as
    torchao's `create_dynamic_map` makes it), sorted, in [-1, 1] (signed) or [0, 1]: per decade
    from 1e-7 up, twice as many values as the decade below, 0 and 1 exact."""
    values = [0.0, 1.0]
    for decade in range(7):
        items = 2 ** decade + 1 if signed else 2 ** (decade + 1) + 1
        bounds = [0.1 + 0.9 * i / (items - 1) for i in range(items)]
        means = [10.0 ** (decade - 6) * (a + b) / 2 for a, b in zip(bounds, bounds[1:])]
        values += means + ([-x for x in means] if signed else [])
    return sorted(values)


@functools.cache
def int8_codebooks(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`dynamic_map`'s signed (first moment) and unsigned (second) maps in float32 on `device`."""
    return tuple(torch.tensor(dynamic_map(signed), dtype=torch.float32, device=device) for signed in (True, False))


def int8_values(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """What 8-bit `codes` of the signed or unsigned map stand for, in float64 (A2's verification
    reads them): each code's value times its block's scale."""
    book = int8_codebooks(torch.device("cpu"))[0 if signed else 1].double()
    values = book[codes.long().cpu()]
    return (_blocks(values) * scale.double().cpu().unsqueeze(-1)).flatten(-2)[..., :codes.shape[-1]]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., n) as (..., blocks, b) zero-padded, b = min(`INT8_BLOCK`, n)."""
    size = min(INT8_BLOCK, x.shape[-1])
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % size)).unflatten(-1, (-1, size))


def _zero_scales(param: torch.Tensor) -> torch.Tensor:
    """Float32 zeros, one a block of `param`'s rows (a DTensor sharded as `param` is: a shard of rows
    holds its rows' blocks, so a checkpoint gathers and reshards them with the codes)."""
    shape = (*param.shape[:-1], -(-param.shape[-1] // min(INT8_BLOCK, param.shape[-1])))
    if not isinstance(param, DTensor):
        return torch.zeros(shape, dtype=torch.float32, device=param.device)
    if any(p.is_shard(param.ndim - 1) for p in param.placements):
        raise ValueError("int8 moments keep one scale per block of a row: a parameter sharded along its rows "
                         "cannot hold them; use optimizer.moments: bfloat16")
    from torch.distributed.tensor import zeros

    return zeros(shape, dtype=torch.float32, device_mesh=param.device_mesh, placements=param.placements)


def _decode(codes: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The float32 values 8-bit `codes` stand for: each its codebook value times its block's scale."""
    values = _blocks(codebook[codes.long()]) * scale.unsqueeze(-1)
    return values.flatten(-2)[..., :codes.shape[-1]]


def int8_codes(normed: torch.Tensor, codebook: torch.Tensor, toward_zero: bool) -> torch.Tensor:
    """The codes (uint8) of values already divided by their block's largest magnitude: the
    largest code value at most each of its sign's magnitude (`toward_zero`) or the smallest at least
    it. `normed` is clamped to [-1, 1] first: a GPU's compiled division is not correctly rounded, so
    a block's largest value over itself can come out a float above 1, whose index past the map's last
    value (256) wrapped to code 0 in uint8: the largest second moment of a block read as zero, a
    step of lr x m / eps, and int8 moments diverged on GPUs (issue 43)."""
    normed = normed.clamp(-1.0, 1.0)
    codes = torch.bucketize(normed, codebook, out_int32=True)  # the smallest code value at least each
    if toward_zero:
        codes = torch.where(normed >= 0, torch.bucketize(normed, codebook, right=True, out_int32=True) - 1, codes)
    # uint8 where they are made: a row whose length is no multiple of the block is padded, and the
    # codes go back to the row's layout in a kernel of their own; int64 codes in between (bucketize's
    # default) were 8 bytes a value written and read again, twice for exp_avg.
    return codes.to(torch.uint8)


def _encode(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor,
            toward_zero: bool) -> None:
    """Write `x` as codes of `codebook` times its blocks' largest magnitude (`scale`), each value
    rounded toward zero (`toward_zero`) or up: the module docstring says why not to the nearest."""
    blocks = _blocks(x)
    absmax = blocks.abs().amax(-1)
    normed = blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(-1)
    codes.copy_(int8_codes(normed, codebook, toward_zero).flatten(-2)[..., :x.shape[-1]])
    scale.copy_(absmax)


@functools.cache
def compiled_update(backend="inductor", fullgraph: bool = False):
    """`_adamw` compiled (a GPU's update) with static sizes, a graph per chunk signature (`_signature`),
    made on first use: `torch.compile` loads inductor, about 1.3 s of CPU in every process that
    imports the step, the CPU ones that never compile included. `backend` and `fullgraph` are
    torch.compile's (tests trace with their own)."""
    return torch.compile(_adamw, dynamic=False, backend=backend, fullgraph=fullgraph)


def update_on(device: torch.device, kernel: str = "triton"):
    """How a step's parameters are updated on `device`: on a GPU `KernelUpdate` (`adamw_kernel`'s
    Triton kernel) where `kernel` is triton and Triton imports, else `_adamw` compiled by inductor
    in chunks (the recipe's `train.fused_update_kernel`); on a CPU `_adamw` itself in chunks
    (`offload.py` runs the calls on the chunks it copies to the device)."""
    if device.type != "cuda":
        return ChunkedUpdate(_adamw)
    if kernel == "triton" and adamw_kernel.available() is None:
        return KernelUpdate()
    return ChunkedUpdate(compiled_update())


def compiled_on_gpu(kernel: str = "triton") -> bool:
    """Whether the fused update is `_adamw` compiled by inductor on a GPU (a graph per
    distinct chunk: a minute or more cold), not `adamw_kernel`'s: `kernel` inductor, or no Triton."""
    return kernel != "triton" or adamw_kernel.available() is not None


class ChunkedUpdate:
    """`run` (`_adamw` or a compiled form of it) over one group's members in chunks of at most
    `CHUNK` (`chunks`): a compiled graph stays the size of one chunk."""

    def __init__(self, run):
        self.run = run

    def calls(self, members: list) -> list[tuple]:
        """(function, members, their signatures) per call."""
        return [(self.run, chunk, signatures) for signatures, chunk in chunks(members)]


class KernelUpdate:
    """`adamw_kernel`'s launches over every member of a group it takes (`adamw_kernel.supports`),
    in one call: it needs no chunks, and launches once per kind of parameter. The others (a tensor
    not contiguous) go to `_adamw` compiled, in chunks."""

    def calls(self, members: list) -> list[tuple]:
        takes = [adamw_kernel.supports(param, grad, state["exp_avg"], state["exp_avg_sq"], copy)
                 for param, grad, state, copy in members]
        kernel = [member for member, taken in zip(members, takes) if taken]
        rest = [member for member, taken in zip(members, takes) if not taken]
        return (([(adamw_kernel.adamw, kernel, ())] if kernel else [])
                + ChunkedUpdate(compiled_update()).calls(rest))


def _flat(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor` as one dimension (a view: updated in place through it)."""
    return None if tensor is None else tensor.view(-1)


def flattened(member: tuple) -> tuple:
    """One parameter's tensors for a compiled chunk, flattened where the update is elementwise on
    them all (float moments, every tensor contiguous; int8's blocks follow rows: kept as they are),
    so chunks of equal sizes share a graph whatever their shapes. The kernel's launches take them as
    they are: views made for each of thousands of parameters (the unpatched starter's) every step
    cost the host more than the update's kernel."""
    param, grad, state, copy = member
    tensors = [param, grad, state["exp_avg"], state["exp_avg_sq"]] + ([] if copy is None else [copy])
    if state["exp_avg"].dtype == torch.uint8 or not all(t.is_contiguous() for t in tensors):
        return member
    state = {**state, "exp_avg": _flat(state["exp_avg"]), "exp_avg_sq": _flat(state["exp_avg_sq"])}
    return _flat(param), _flat(grad), state, _flat(copy)


def _signature(member) -> tuple:
    """What a compiled graph specializes on, per parameter: chunks of equal signatures share a graph.
    A flattened member is its size and dtypes, whatever shape its parameter has."""
    param, grad, state, copy = member
    dtypes = (param.dtype, grad.dtype, state["exp_avg"].dtype, None if copy is None else copy.dtype)
    if param.ndim == 1 and param.stride() == grad.stride() == (1,) and state["exp_avg"].dtype != torch.uint8:
        return ("flat", param.numel(), *dtypes)
    return (tuple(param.shape), param.stride(), grad.stride(), *dtypes)


def chunks(members: list) -> list[tuple[tuple, list]]:
    """`members` flattened (`flattened`), sorted by signature and cut into runs of at most `CHUNK`,
    each with its members' signatures: a model with many parameters of one shape makes many equal
    chunks, which one compiled graph serves."""
    keyed = sorted(((repr(_signature(m)), m) for m in map(flattened, members)), key=lambda pair: pair[0])
    return [(tuple(key for key, _ in keyed[i:i + CHUNK]), [m for _, m in keyed[i:i + CHUNK]])
            for i in range(0, len(keyed), CHUNK)]


def graphs_allowed(calls: list[tuple]) -> contextlib.AbstractContextManager:
    """Room in dynamo's cache for one graph per distinct chunk of this step (`calls`, as `cut` makes
    them) besides those it holds: its default limit of 8 per function would send the rest to eager,
    with other roundings than the compiled update's. The graphs of every `compiled_update` and of every
    run this process made before (a test, a bench beside another) are entries of `_adamw`'s one code
    object, so the limit counts them too; this step adds at most its distinct chunks (`_signature`;
    `benchmarks/update_graphs.py` counts them: 13 for the reference solution's a1-1gpu, 12 for the
    starter's)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    distinct = len({(signatures, hyper) for _, _, signatures, _, hyper in calls if signatures})
    cached = len(_debug_get_cache_entry_list(_adamw.__code__))
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), cached + distinct)})


@torch.no_grad()
def clip_and_update(weights: MasterWeights, optimizer: torch.optim.AdamW, max_norm: float,
                    update: ChunkedUpdate | KernelUpdate | None = None, kernel: str = "triton",
                    apply=None) -> torch.Tensor:
    """Clip the step's gradients (on the bf16 copies, or on the masters that have none) to a global
    L2 norm and take `optimizer`'s AdamW step, writing the copies; the norm before clipping, a 0-d
    float32 tensor (no host sync, as `step.clip_grad_norm_`). `update` says how the parameters are
    updated (default: `update_on` the gradients' device with `kernel`); `apply(groups, coef, update)`
    runs the step's groups (default: the optimizer's `update_groups`, else `apply_update`;
    `benchmarks/update_overlap.py` queues them on a side stream)."""
    groups, grads = _groups(optimizer, lambda param: weights.copy_of.get(id(param)))
    if not grads:
        return torch.zeros(())
    total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    coef = torch.ones_like(total_norm)
    if max_norm and max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    if update is None:
        update = update_on(grads[0].device, kernel)
    (apply or getattr(optimizer, "update_groups", apply_update))(groups, coef, update)
    weights.drop_copy_grads()
    weights.copies_written()
    return total_norm


def _groups(optimizer: torch.optim.AdamW, copy_of) -> tuple[list[tuple], list[torch.Tensor]]:
    """Per parameter group of `optimizer` with gradients, its members (param, grad, state, copy), its
    lr as a tensor on their device and its other hyperparameters; and the gradients in the optimizer's
    order (as the unfused clip sums their norms). A parameter's gradient is on its copy where
    `copy_of(param)` gives one that holds it (one micro-batch), else on itself (several add up on
    the master, in float32); a DTensor's local shard is updated in place."""
    groups, grads = [], []
    for group in optimizer.param_groups:
        members = []
        for param in group["params"]:
            copy = copy_of(param)
            grad = copy.grad if copy is not None and copy.grad is not None else param.grad
            if grad is not None:
                state = _state(optimizer, group, param)
                members.append((_local(param), _local(grad), {key: _local(value) for key, value in state.items()},
                                copy))
        grads += [grad for _, grad, _, _ in members]
        if members:
            lr = torch.full((), group["lr"], device=members[0][1].device)
            groups.append((members, lr, (*group["betas"], group["eps"], group["weight_decay"])))
    return groups, grads


def cut(groups: list[tuple], update: ChunkedUpdate | KernelUpdate) -> list[tuple]:
    """The step's calls: (function, members, their signatures, lr, hyperparameters) each, as
    `update` cuts each group's members."""
    return [(run, members, signatures, lr, hyper) for group_members, lr, hyper in groups
            for run, members, signatures in update.calls(group_members)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: updated in place), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def apply_update(groups: list[tuple], coef: torch.Tensor, update: ChunkedUpdate | KernelUpdate | None = None) -> None:
    """Update the groups' members (`_groups`) with gradients times `coef`, as `update` says
    (default: `update_on` their device)."""
    if not groups:
        return
    if update is None:
        update = update_on(groups[0][1].device)
    calls = cut(groups, update)
    with graphs_allowed(calls):
        for run, members, _, lr, hyper in calls:
            run_call(run, members, lr, coef.to(lr.device), hyper)


def run_call(run, members: list, lr: torch.Tensor, coef: torch.Tensor, hyper: tuple) -> None:
    """One call of `run` over `members` (param, grad, state, copy), their moments, step counts and
    int8 scales read from the states (`offload.py` calls it on the copies it stages on the device)."""
    params, grads, states, copies = (list(column) for column in zip(*members))
    scales = [(s["exp_avg_scale"], s["exp_avg_sq_scale"]) if "exp_avg_scale" in s else None for s in states]
    run(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
        [s["step"] for s in states], copies, lr, coef, *hyper,
        *((scales, int8_codebooks(lr.device)) if any(scales) else ()))


class AdamWCompactMoments(torch.optim.AdamW):
    """torch's AdamW on float32 parameters with both moments stored in `moments_dtype` (bfloat16:
    4 bytes of state per parameter instead of 8; uint8: 8-bit codes, about 2, see the module docstring),
    updated in float32 and rounded once per step (`_adamw`). Its step is the fused update's, without
    copies: the same math wherever it runs. A loaded state gets its dtypes back at once.
    bfloat16 holds 8 significant bits, so each step must change a moment by more than about 0.4%
    of it to register: with beta2 = 0.95 it does (5%); with beta2 = 0.999 the second moment would
    stall, and the recipe refuses that pairing."""

    def __init__(self, params, moments_dtype: torch.dtype = torch.bfloat16, on_device: bool = False, **options):
        # the step is ours, torch's kernels never run; `capturable` keeps the step counts on the
        # parameters' device (as torch's fused AdamW does), so a compiled update reads no host scalar
        options.update(fused=False, foreach=False, capturable=on_device)
        super().__init__(params, **options)
        self.moments_dtype = moments_dtype
        self.register_load_state_dict_post_hook(_cast_loaded_moments)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, _ = _groups(self, lambda param: None)
        if groups:
            self.update_groups(groups, torch.ones((), device=groups[0][1].device))
        return loss

    def update_groups(self, groups: list[tuple], coef: torch.Tensor, update=None) -> None:
        """Update the groups' members (`apply_update`; `offload.AdamWOffloaded` streams its state)."""
        apply_update(groups, coef, update)
