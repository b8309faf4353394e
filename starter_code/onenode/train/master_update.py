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
applies to plain `torch.optim.AdamW` and to steps of one micro-batch (several add up in float32, on
the masters). The first step makes the state as torch's AdamW would, so it is fused too: what it
compiles falls in a run's first step, which benchmarks leave out as warm-up.

The compiled update takes the parameters in chunks of at most `CHUNK`, sorted by shape and dtype,
so its graphs stay the size of one chunk whatever the model's parameter count: a model that keeps
one parameter per expert matrix (thousands of them) reuses a few graphs of `CHUNK` same-shaped
tensors, instead of compiling one graph that unrolls every parameter. A CPU runs the same function
uncompiled, a loop of small ops: one process in bf16 on a CPU is for tests and smoke runs, and there
it checks the very update a GPU compiles.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.tensor import DTensor

from ..parallel.mixed_precision import MasterWeights

CHUNK = 16  # parameters per compiled call: bounds each graph's size (and compile time); a step makes N / CHUNK calls


def applies(weights: MasterWeights | None, optimizer, accumulation_steps: int) -> bool:
    """Whether this step can be the fused one: bf16 copies over float32 masters, one micro-batch,
    plain AdamW (its moments in the parameters' dtype), or `AdamWCompactMoments` and its kinds
    (`offload.AdamWOffloaded`), whose step is this update."""
    plain = type(optimizer) is torch.optim.AdamW or isinstance(optimizer, AdamWCompactMoments)
    if weights is None or accumulation_steps != 1 or not plain:
        return False
    return not any(group["amsgrad"] or group["maximize"] or group["differentiable"]
                   for group in optimizer.param_groups)


def _state(optimizer: torch.optim.AdamW, group: dict, param: torch.Tensor) -> dict:
    """`param`'s AdamW state, made as torch's AdamW makes it on its first step (a step count on the
    device for its fused and capturable kinds, else on the host; both moments zero), its moments in
    the optimizer's `moments_dtype` where it has one (a loaded state is cast back to it: torch's
    `load_state_dict` casts every state tensor to its parameter's dtype), each placed by the
    optimizer's `place_state` where it has one (`offload.AdamWOffloaded`: pinned host memory)."""
    state = optimizer.state[param]
    dtype = getattr(optimizer, "moments_dtype", param.dtype)
    if not state:
        on_device = group["fused"] or group["capturable"]
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else None)
        state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
    elif state["exp_avg"].dtype != dtype:
        state["exp_avg"], state["exp_avg_sq"] = state["exp_avg"].to(dtype), state["exp_avg_sq"].to(dtype)
    else:
        return state
    if hasattr(optimizer, "place_state"):
        optimizer.place_state(state)
    return state


def _adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], copies: list[torch.Tensor | None],
           lr: torch.Tensor, coef: torch.Tensor, beta1: float, beta2: float, eps: float,
           weight_decay: float) -> None:
    """torch's AdamW step on float32 `params` from gradients of any float dtype times `coef`, each
    updated parameter also written into its copy (None: it has none). Moments stored in a narrower
    dtype (`AdamWCompactMoments`) are updated in the parameters' dtype and rounded once to their own."""
    for param, grad, exp_avg, exp_avg_sq, step, copy in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
        step.add_(1)
        grad = grad.to(param.dtype) * coef
        param.mul_(1 - lr * weight_decay)
        compact = exp_avg.dtype != param.dtype
        m, v = (exp_avg.to(param.dtype), exp_avg_sq.to(param.dtype)) if compact else (exp_avg, exp_avg_sq)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = v.sqrt() / (1 - beta2 ** step).sqrt() + eps
        param.sub_(step_size * m / denom)
        if compact:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
        if copy is not None:
            copy.copy_(param)


@functools.cache
def _compiled_adamw():
    """`_adamw` compiled (a GPU's update), made on first use: `torch.compile` loads inductor, about
    1.3 s of CPU in every process that imports the step, the CPU ones that never compile included."""
    return torch.compile(_adamw, dynamic=False)


def chunk_update(device: torch.device):
    """The function a chunk's update runs on `device`: `_adamw`, compiled on a GPU (`offload.py`
    calls it on the chunks it copies there)."""
    return _compiled_adamw() if device.type == "cuda" else _adamw


def _signature(member) -> tuple:
    """What a compiled graph specializes on, per parameter: chunks of equal signatures share a graph."""
    param, grad, state, copy = member
    return (tuple(param.shape), param.stride(), param.dtype, grad.dtype, grad.stride(), state["exp_avg"].dtype,
            None if copy is None else copy.dtype)


def chunks(members: list) -> list[tuple[tuple, list]]:
    """`members` sorted by signature and cut into runs of at most `CHUNK`, each with its members'
    signatures: a model with many parameters of one shape makes many equal chunks, which one
    compiled graph serves."""
    keyed = sorted(((repr(_signature(m)), m) for m in members), key=lambda pair: pair[0])
    return [(tuple(key for key, _ in keyed[i:i + CHUNK]), [m for _, m in keyed[i:i + CHUNK]])
            for i in range(0, len(keyed), CHUNK)]


def graphs_allowed(calls: list[tuple]) -> contextlib.AbstractContextManager:
    """Room in dynamo's cache for one graph per distinct chunk of this step (its default limit of 8
    per function would send the rest to eager): at most the number of chunks, in practice about two
    per distinct parameter shape."""
    distinct = len({(signatures, hyper) for _, signatures, _, hyper in calls})
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), distinct)})


@torch.no_grad()
def clip_and_update(weights: MasterWeights, optimizer: torch.optim.AdamW, max_norm: float,
                    update=None) -> torch.Tensor:
    """Clip the step's gradients (on the bf16 copies, or on the masters that have none) to a global
    L2 norm and take `optimizer`'s AdamW step, writing the copies; the norm before clipping, a 0-d
    float32 tensor (no host sync, as `step.clip_grad_norm_`). `update` is the chunk update to call
    (default: `_adamw`, compiled on a GPU)."""
    calls, grads = _calls(optimizer, lambda param: weights.copy_of.get(id(param)))
    if not grads:
        return torch.zeros(())
    total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    coef = torch.ones_like(total_norm)
    if max_norm and max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    getattr(optimizer, "update_chunks", _update)(calls, coef, update)
    weights.drop_copy_grads()
    weights.copies_written()
    return total_norm


def _calls(optimizer: torch.optim.AdamW, copy_of) -> tuple[list[tuple], list[torch.Tensor]]:
    """The chunked update calls of `optimizer`'s step, and the gradients in the optimizer's order
    (as the unfused clip sums their norms). A parameter's gradient is on its copy where
    `copy_of(param)` gives one, else on itself; a DTensor's local shard is updated in place."""
    calls = []  # (chunk of (param, grad, state, copy), their signatures, the group's lr tensor, other hyperparameters)
    grads = []
    for group in optimizer.param_groups:
        members = []
        for param in group["params"]:
            copy = copy_of(param)
            grad = copy.grad if copy is not None else param.grad
            if grad is not None:
                state = _state(optimizer, group, param)
                members.append((_local(param), _local(grad), {key: _local(value) for key, value in state.items()},
                                copy))
        grads += [grad for _, grad, _, _ in members]
        if members:
            lr = torch.full((), group["lr"], device=members[0][1].device)
            hyper = (*group["betas"], group["eps"], group["weight_decay"])
            calls += [(chunk, signatures, lr, hyper) for signatures, chunk in chunks(members)]
    return calls, grads


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: updated in place), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _update(calls: list[tuple], coef: torch.Tensor, update=None) -> None:
    """Run the chunked AdamW calls with gradients times `coef` (`_adamw`, compiled on a GPU)."""
    if not calls:
        return
    if update is None:
        update = chunk_update(calls[0][0][0][1].device)
    with graphs_allowed(calls):
        for chunk, _, lr, hyper in calls:
            params, chunk_grads, states, copies = (list(column) for column in zip(*chunk))
            update(params, chunk_grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                   [s["step"] for s in states], copies, lr, coef.to(lr.device), *hyper)


class AdamWCompactMoments(torch.optim.AdamW):
    """torch's AdamW on float32 parameters with both moments stored in `moments_dtype` (bfloat16:
    4 bytes of state per parameter instead of 8), updated in float32 and rounded once per step
    (`_adamw`). Its step is the fused update's, without copies: the same math wherever it runs.
    bfloat16 holds 8 significant bits, so each step must change a moment by more than about 0.4%
    of it to register: with beta2 = 0.95 it does (5%); with beta2 = 0.999 the second moment would
    stall, and the recipe refuses that pairing."""

    def __init__(self, params, moments_dtype: torch.dtype = torch.bfloat16, on_device: bool = False, **options):
        # the step is ours, torch's kernels never run; `capturable` keeps the step counts on the
        # parameters' device (as torch's fused AdamW does), so a compiled update reads no host scalar
        options.update(fused=False, foreach=False, capturable=on_device)
        super().__init__(params, **options)
        self.moments_dtype = moments_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        calls, _ = _calls(self, lambda param: None)
        if calls:
            self.update_chunks(calls, torch.ones((), device=calls[0][2].device))
        return loss

    def update_chunks(self, calls: list[tuple], coef: torch.Tensor, update=None) -> None:
        """Run this step's chunked calls (`_update`; `offload.AdamWOffloaded` streams its state)."""
        _update(calls, coef, update)
