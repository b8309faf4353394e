"""One optimizer step: forward and backward (gradient accumulation, auxiliary loss), gradient
clipping, update. The one step bench, trainer and grader harness run.

Labels convention (the whole kit): `labels` has the shape of `input_ids` and holds each position's
next-token target (already shifted); positions with -100 are ignored.

What else runs during a step, as hooks that the layout (and the trainer) installed:
- forward, per layer: FSDP2 gathers the layer's shards (`parallel/fsdp.py`); in one process in
  bf16, the layer's bf16 copies are swapped in for its float32 masters instead
  (`parallel/mixed_precision.py`, `CastUnit`);
- forward, per router (the trainer's `train/balance.py`): it counts the tokens each expert got
  (the load-balancing bias update after the step reads them) and collects the auxiliary loss;
- backward, per parameter: FSDP2 reduce-scatters the gradients; in one process each copy's
  gradient goes to its master, or stays on the copy for the fused update (`MasterWeights`);
- after `optimizer.step`: the bf16 copies are marked stale, refreshed at the next forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from ..parallel import ParallelModel
from . import master_update
from .offload import offload_masters
from .optim import build_adamw, build_muon

__all__ = ["build_optimizer", "clip_grad_norm_", "train_step"]


def build_optimizer(
    model: nn.Module,
    name: str = "adamw",
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    moments: str = "float32",
    state: str = "device",
    **muon_options,
) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices only (the A1 default), or "muon": Muon on the
    2-D hidden matrices and AdamW on the rest (`train/optim.py`; `muon_options` go to Muon);
    `moments` is the dtype AdamW stores its moments in (`optim.MOMENTS`); `state` "cpu" moves the
    float32 masters of one process in bf16 to host memory and keeps AdamW's state there
    (`offload.py`: AdamW only; the fused step streams it through the device). Over
    a layout's float32 masters (`ParallelModel.master_weights`) each step of it marks their bf16
    copies stale (a hook of this optimizer's own, not of every optimizer in the process)."""
    weights = getattr(model, "master_weights", None)
    if state == "cpu" and (name != "adamw" or weights is None):
        raise ValueError("optimizer state in CPU memory is AdamW's over one process's float32 masters in bf16: "
                         "use name 'adamw', one process and bf16, or state 'device'")
    if name == "muon":
        optimizer = build_muon(model, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, moments=moments,
                               **muon_options)
    elif name == "adamw":
        optimizer = build_adamw(model.named_parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                                moments=moments, offload_to=offload_masters(weights) if state == "cpu" else None)
    else:
        raise ValueError(f"unknown optimizer {name!r}: use 'adamw' or 'muon'")
    if weights is not None:
        optimizer.register_step_post_hook(lambda *unused: weights.masters_changed())
    return optimizer


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


def _is_expert_shard(mesh: DeviceMesh | None) -> bool:
    """Experts that expert parallelism split are FSDP-sharded over the ranks holding the same
    experts, the mesh named "dp_mod_ep" (`parallel/mesh.py`); nothing else is."""
    return mesh is not None and mesh.mesh_dim_names == ("dp_mod_ep",)


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, *, pp_mesh: DeviceMesh | None = None,
                    ep_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Clip all gradients to a global L2 norm; the norm before clipping, a 0-d float32 tensor.

    Nothing here waits for the device: the norm and the clipping coefficient stay tensors, and the
    gradients are always multiplied by min(1, max_norm / norm), so the host can queue the optimizer
    step behind the backward (reading the norm is for logging, once the step is queued).

    DTensor gradients (FSDP2) are reduced over their own meshes. With `ep_mesh` (the routed experts
    split over it) the experts' gradients differ across it, each rank holding other experts: their
    squares are summed there. With `pp_mesh` each rank holds other stages' parameters: every square
    is summed over it. (torchtitan's `clip_grad_norm_(..., pp_mesh, ep_enabled)`.)
    """
    groups = _grads_by_mesh([p.grad for p in parameters if p.grad is not None])
    experts = {mesh: grads for mesh, grads in groups.items() if ep_mesh is not None and _is_expert_shard(mesh)}
    sq = _local_sq_norm({mesh: grads for mesh, grads in groups.items() if mesh not in experts})
    if ep_mesh is not None:
        expert_sq = _local_sq_norm(experts).to(sq.device)
        dist.all_reduce(expert_sq, group=ep_mesh.get_group())
        sq = sq + expert_sq
    if pp_mesh is not None:
        dist.all_reduce(sq, group=pp_mesh.get_group())
    total_norm = sq.sqrt()
    if max_norm and max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for group in groups.values():
            torch._foreach_mul_(group, coef.to(group[0].device))
    return total_norm


def _forward_backward(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, accumulation_steps: int,
                      aux_loss_fn: Callable[[], torch.Tensor | None] | None,
                      aux_loss_coef: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean loss (and auxiliary loss) over the micro-batches, their gradients added up.

    The losses stay on the device: one host sync per step, not per micro-batch. FSDP reduces
    gradients on the last micro-batch only; the earlier ones accumulate locally.
    """
    if input_ids.shape[0] % accumulation_steps:
        raise ValueError(f"batch size {input_ids.shape[0]} is not a multiple of {accumulation_steps} "
                         "accumulation steps: change one of them")
    sync_last_only = accumulation_steps > 1 and isinstance(model, FSDPModule)
    losses, aux_losses = [], []
    for micro, (ids, targets) in enumerate(zip(input_ids.chunk(accumulation_steps), labels.chunk(accumulation_steps))):
        if sync_last_only:
            model.set_requires_gradient_sync(micro == accumulation_steps - 1)
        loss = model(ids, labels=targets).loss
        objective = loss
        aux = aux_loss_fn() if aux_loss_fn is not None else None
        if aux is not None:
            objective = loss + aux_loss_coef * aux
            aux_losses.append(aux.detach())
        (objective / accumulation_steps).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean(), torch.stack(aux_losses).mean() if aux_losses else None


def train_step(
    model: ParallelModel | nn.Module,
    optimizer: torch.optim.Optimizer,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    grad_clip: float = 1.0,
    *,
    accumulation_steps: int = 1,
    aux_loss_fn: Callable[[], torch.Tensor | None] | None = None,
    aux_loss_coef: float = 0.0,
    fused_update: bool = True,
    update_kernel: str = "triton",
) -> dict:
    """One optimizer step on this rank's batch.

    `model` is what `parallelize` returned (a plain model is the one-process layout); it computes in
    the precision `parallelize` gave it, so no autocast here. The batch runs as `accumulation_steps`
    micro-batches whose gradients add up; with pipeline parallelism the schedule splits it into its
    own microbatches instead. `aux_loss_fn` returns the auxiliary
    loss of the forward just run (`RouterBalancer.pop_aux_loss`); the objective adds it times
    `aux_loss_coef`. Where `train/master_update.py` applies (one process in bf16, AdamW), the clip
    and the update are its fused pass, from the bf16 gradients on the copies (one micro-batch) or the
    float32 ones added up on the masters (several) (on a GPU by `update_kernel`: triton or
    inductor, `master_update.update_on`), unless `fused_update` is False: then the
    masters take float32 gradients and the optimizer steps them. Returns this rank's loss (mean
    over micro-batches; None on pipeline ranks without the last stage), the global gradient norm
    before clipping and, with `aux_loss_fn`, `aux_loss`.
    """
    parallel = model if isinstance(model, ParallelModel) else ParallelModel(model)
    optimizer.zero_grad(set_to_none=True)
    weights = parallel.master_weights
    fused = fused_update and master_update.applies(weights, optimizer)
    if parallel.pipeline is not None:
        if accumulation_steps > 1 or aux_loss_fn is not None:
            raise ValueError("pipeline parallelism splits the batch into its own microbatches and computes the "
                             "loss on its last stage: no accumulation_steps or aux_loss_fn with pp > 1")
        loss, aux = parallel.pipeline.step(input_ids, labels), None
    elif fused and accumulation_steps == 1:  # the gradients stay bf16 on the copies, for the fused update
        with weights.deferring_grads():
            loss, aux = _forward_backward(parallel.model, input_ids, labels, 1, aux_loss_fn, aux_loss_coef)
    else:
        loss, aux = _forward_backward(parallel.model, input_ids, labels, accumulation_steps, aux_loss_fn,
                                      aux_loss_coef)
    if fused:
        grad_norm = master_update.clip_and_update(weights, optimizer, grad_clip, kernel=update_kernel)
    else:
        grad_norm = clip_grad_norm_(parallel.parameters(), grad_clip, pp_mesh=parallel.pp_mesh,
                                    ep_mesh=parallel.ep_mesh)
        optimizer.step()
        if weights is not None:  # whatever optimizer it is: its kernels may count no version
            weights.masters_changed()
    # The step's one wait for the device, with all of its work queued: the numbers it reports.
    value = None if loss is None else float(loss)
    if value is not None and not math.isfinite(value):
        raise FloatingPointError(f"loss is {value}: lower the learning rate or check the data")
    out = {"loss": value, "grad_norm": float(grad_norm)}
    if aux_loss_fn is not None:
        out["aux_loss"] = None if aux is None else float(aux)
    return out
