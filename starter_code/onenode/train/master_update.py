"""The optimizer step of one process in bf16, fused: clip, AdamW on the float32 masters and the bf16
copies written, in one pass over each parameter.

The unfused step (`train_step` everywhere else) reads and writes every parameter's state several
times: each bf16 gradient is cast into a float32 one, the clip reads and rescales those, AdamW reads
gradient, master and moments and writes master and moments, and the next forward casts each
master into its bf16 copy again (`parallel/mixed_precision.py`). For the a1-1gpu model at one
sequence of 4096 tokens on an H200 that was 35 ms of a 79 ms step
(benchmarks/results/2026-12-01-h200-one-process). Here the bf16 gradients stay on the copies, the
clip's norm is computed from them, and one kernel per parameter (compiled on a GPU) applies the
clip coefficient, updates the master and both moments, and writes the copy: about 30 bytes per
parameter instead of 52. Measured there: the optimizer side 17.5 ms, the step at 15.3% MFU against
12.1% (benchmarks/results/2026-12-01-h200-fused-update).

The math is torch's AdamW (decoupled weight decay, bias corrections from each parameter's step
count), on the optimizer's own state, so checkpoints and the unfused step read and continue it. It
applies to one `torch.optim.AdamW` whose parameters all have state (the first step runs unfused,
which makes it) and to steps of one micro-batch (several add up in float32, on the masters). A CPU
runs the same function uncompiled, a loop of small ops, somewhat slower than the unfused step (a
tiny model's step: 69 ms against 51): one process in bf16 on a CPU is for tests and smoke runs, and
there it checks the very update a GPU compiles.
"""

from __future__ import annotations

import torch

from ..parallel.mixed_precision import MasterWeights


def applies(weights: MasterWeights | None, optimizer, accumulation_steps: int) -> bool:
    """Whether this step can be the fused one: bf16 copies over float32 masters, one micro-batch,
    plain AdamW whose every parameter already has its moments."""
    if weights is None or accumulation_steps != 1 or type(optimizer) is not torch.optim.AdamW:
        return False
    for group in optimizer.param_groups:
        if group["amsgrad"] or group["maximize"] or group["differentiable"]:
            return False
        if any(not optimizer.state.get(p) for p in group["params"]):
            return False
    return True


def _adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], copies: list[torch.Tensor | None],
           lr: torch.Tensor, coef: torch.Tensor, beta1: float, beta2: float, eps: float,
           weight_decay: float) -> None:
    """torch's AdamW step on float32 `params` from gradients of any float dtype times `coef`, each
    updated parameter also written into its copy (None: it has none)."""
    for param, grad, exp_avg, exp_avg_sq, step, copy in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
        step.add_(1)
        grad = grad.to(param.dtype) * coef
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = exp_avg_sq.sqrt() / (1 - beta2 ** step).sqrt() + eps
        param.sub_(step_size * exp_avg / denom)
        if copy is not None:
            copy.copy_(param)


_compiled_adamw = torch.compile(_adamw, dynamic=False)


@torch.no_grad()
def clip_and_update(weights: MasterWeights, optimizer: torch.optim.AdamW, max_norm: float) -> torch.Tensor:
    """Clip the step's gradients (on the bf16 copies, or on the masters that have none) to a global
    L2 norm and take `optimizer`'s AdamW step, writing the copies; the norm before clipping, a 0-d
    float32 tensor (no host sync, as `step.clip_grad_norm_`)."""
    groups = []
    for group in optimizer.param_groups:
        members = []
        for param in group["params"]:
            copy = weights.copy_of.get(id(param))
            grad = copy.grad if copy is not None else param.grad
            if grad is not None:
                members.append((param, grad, optimizer.state[param], copy))
        if members:
            groups.append((group, members))
    grads = [grad for _, members in groups for _, grad, _, _ in members]
    if not grads:
        return torch.zeros(())
    total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    coef = torch.ones_like(total_norm)
    if max_norm and max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for group, members in groups:
        params, group_grads, states, copies = (list(column) for column in zip(*members))
        update = _compiled_adamw if params[0].is_cuda else _adamw
        beta1, beta2 = group["betas"]
        update(params, group_grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
               [s["step"] for s in states], copies, torch.full((), group["lr"], device=params[0].device), coef,
               beta1, beta2, group["eps"], group["weight_decay"])
    weights.drop_copy_grads()
    weights.copies_written()
    return total_norm
