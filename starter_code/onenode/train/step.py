"""One optimizer step: loss, backward, gradient clipping, update. Shared by bench, trainer and grader.

Labels convention (the whole kit): `labels` has the shape of `input_ids` and holds each position's
next-token target (already shifted); positions with -100 are ignored.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from onenode.model.nemotron_h import cross_entropy_loss

from .optim import build_muon
from .weight_decay import param_groups

__all__ = ["cross_entropy_loss", "build_optimizer", "clip_grad_norm_", "train_step"]


def build_optimizer(
    model: nn.Module,
    name: str = "adamw",
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    **muon_options,
) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices only (the A1 default), or "muon": Muon on the
    2-D hidden matrices and AdamW on the rest (`train/optim.py`; `muon_options` go to Muon)."""
    if name == "muon":
        return build_muon(model, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **muon_options)
    if name != "adamw":
        raise ValueError(f"unknown optimizer {name!r}: use 'adamw' or 'muon'")
    # foreach is faster on GPU and fine with DTensor parameters from FSDP2 and EP.
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, foreach=True)


def _grads_by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Gradients grouped by DTensor mesh (None for plain tensors): foreach ops need one kind."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    return groups


def _local_sq_norm(groups: dict[object, list[torch.Tensor]]) -> torch.Tensor:
    """Squared L2 norm of gradients, reduced over each DTensor's mesh, as a plain tensor."""
    total = None
    for mesh, group in groups.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        if mesh is not None:
            norm = norm.full_tensor()
        total = norm.float() ** 2 if total is None else total + norm.float().to(total.device) ** 2
    return total if total is not None else torch.zeros(())


def clip_grad_norm_(model: nn.Module, max_norm: float, *, cross_rank_group=None) -> float:
    """Clip all gradients to a global L2 norm and return the norm before clipping.

    DTensor gradients (FSDP2) are reduced over their own meshes. Expert-parallel gradients
    (`model.expert_grad_norm_group = (expert_mesh, ep_group)`, set by `parallelize`) differ across
    the EP group, each rank holding other experts: their squares are summed over it. Parameters
    that live on other ranks entirely (pipeline stages) are summed over `cross_rank_group`.
    """
    import torch.distributed as dist

    groups = _grads_by_mesh([p.grad for p in model.parameters() if p.grad is not None])
    expert = getattr(model, "expert_grad_norm_group", None)
    expert_grads = groups.pop(expert[0], None) if expert is not None else None
    sq = _local_sq_norm(groups)
    if expert_grads is not None:
        expert_sq = _local_sq_norm({expert[0]: expert_grads}).to(sq.device)
        dist.all_reduce(expert_sq, group=expert[1])
        sq = sq + expert_sq
        groups[expert[0]] = expert_grads  # clipped with the rest below
    if cross_rank_group is not None:
        dist.all_reduce(sq, group=cross_rank_group)
    total_norm = float(sq.sqrt())
    if max_norm and max_norm > 0 and total_norm > max_norm:
        coef = max_norm / (total_norm + 1e-6)
        for group in groups.values():
            torch._foreach_mul_(group, coef)
    return total_norm


def autocast_context(device: torch.device | str, dtype: torch.dtype | None):
    """bf16 autocast where asked; a no-op context otherwise."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def forward_backward(model, input_ids: torch.Tensor, labels: torch.Tensor, *, autocast_dtype=None):
    """Loss of one batch with its gradients accumulated. Pipeline runners run their schedule."""
    if getattr(model, "is_pipeline", False):
        return model.step(input_ids, labels)
    with autocast_context(input_ids.device, autocast_dtype):
        logits = model(input_ids).logits
    loss = cross_entropy_loss(logits, labels)
    loss.backward()
    return loss.detach()


def train_step(
    model,
    optimizer: torch.optim.Optimizer,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    grad_clip: float = 1.0,
    autocast_dtype: torch.dtype | None = None,
) -> dict:
    """One optimizer step. Returns the loss (None on pipeline stages that do not compute it)."""
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, input_ids, labels, autocast_dtype=autocast_dtype)
    grad_norm = clip_grad_norm_(model, grad_clip, cross_rank_group=getattr(model, "grad_norm_group", None))
    optimizer.step()
    value = None if loss is None else float(loss)
    if value is not None and not math.isfinite(value):
        raise FloatingPointError(f"loss is {value}: lower the learning rate or check the data")
    return {"loss": value, "grad_norm": grad_norm}
