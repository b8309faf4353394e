"""Expert parallelism: each rank of an EP group holds E / ep routed experts; tokens travel to them.

torchtitan's recipe, applied from outside the model. The MoE layer's class is swapped for a
subclass (as FSDP2 does) whose `routed_experts` dispatches and combines around the layer's own
expert code:
  1. sort the (token, slot) pairs by expert, hence by the rank that owns the expert;
  2. exchange the per-expert counts (all_to_all), the one host sync: the split sizes;
  3. all_to_all the tokens with those uneven splits (autograd-aware: gradients travel back);
  4. run this rank's experts on what arrived, through the layer's own `routed_experts`;
  5. all_to_all the outputs back, undo the sort (the inverse permutation), and add up each
     token's k outputs weighted by the router.
The router and the shared expert stay replicated (FSDP shards them like any dense layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single as _all_to_all_single

from ..model.expert_index import count_per_expert


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    return _all_to_all_single(out, x, output_splits, input_splits, group=group)


class ExpertParallelMoE:
    """Put in front of an MoE class: the layer holds its EP rank's experts only, in its own layout,
    and sends every token to the rank that owns its expert. Set up by `apply_expert_parallel`."""

    ep_group: dist.ProcessGroup
    ep_num_experts: int  # routed experts over the whole EP group

    def routed_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        ep, top_k = self.ep_group.size(), topk_idx.shape[1]
        local = self.ep_num_experts // ep
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs by expert, so by owner rank
        token = order // top_k
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=x.device))
        send_counts = count_per_expert(flat, self.ep_num_experts)
        recv_counts = torch.empty_like(send_counts)  # [source rank, local expert]
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send_splits = send_counts.view(ep, local).sum(1).tolist()
        recv_splits = recv_counts.view(ep, local).sum(1).tolist()
        received = _all_to_all(x[token], recv_splits, send_splits, self.ep_group)
        expert_ids = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(
            recv_counts, output_size=sum(recv_splits))
        unit = torch.ones(len(expert_ids), 1, dtype=topk_weight.dtype, device=x.device)
        out = super().routed_experts(received, expert_ids[:, None], unit)
        back = _all_to_all(out, send_splits, recv_splits, self.ep_group)
        slots = back[inverse].unflatten(0, (-1, top_k))  # back in (token, slot) order: no scatter-add
        return (slots.to(topk_weight.dtype) * topk_weight[..., None]).sum(dim=1).to(x.dtype)


_EP_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelMoE, cls), {})
    return _EP_CLASSES[cls]


def _num_experts(experts: nn.Module | None) -> int | None:
    """How many routed experts `experts` holds, in either layout: a ModuleList with one module per
    expert (NVIDIA's remote code), or a module whose own parameters are all stacked over a leading
    expert dimension (transformers). None for anything else."""
    if isinstance(experts, nn.ModuleList):
        return len(experts) or None
    params = list(experts.parameters(recurse=False)) if isinstance(experts, nn.Module) else []
    leading = {p.shape[0] for p in params}
    return leading.pop() if params and len(leading) == 1 and all(p.dim() == 3 for p in params) else None


def _keep_local_experts(experts: nn.Module, start: int, stop: int) -> nn.Module:
    """The experts [start, stop) of either layout; stacked ones as new leaf parameters."""
    if isinstance(experts, nn.ModuleList):
        return nn.ModuleList(experts[start:stop])
    for name, param in list(experts.named_parameters(recurse=False)):
        local = nn.Parameter(param.detach()[start:stop].clone(), requires_grad=param.requires_grad)
        setattr(experts, name, local)
    return experts


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split the routed experts of every MoE layer over `ep_mesh`; returns the layers it changed."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    changed = []
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        total = _num_experts(experts)
        if total is None or not hasattr(module, "routed_experts"):
            continue
        if total % ep:
            raise ValueError(f"{total} routed experts cannot be split over ep={ep}: choose an ep that divides {total}")
        per_rank = total // ep
        module.experts = _keep_local_experts(experts, rank * per_rank, (rank + 1) * per_rank)
        module.__class__ = _expert_parallel_class(type(module))
        module.ep_group, module.ep_num_experts = ep_mesh.get_group(), total
        changed.append(module)
    return changed
