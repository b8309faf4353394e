"""MoE load balancing from outside the model: forward hooks on every router (`mixer.gate`).

Auxiliary-loss-free balancing (DeepSeek-V3, Nemotron-H): after each optimizer step every
router's `e_score_correction_bias` moves by `rate * sign(mean_load - load)`, so overloaded
experts get chosen less. The bias only steers the choice, never the weights, so it changes no
gradient. The load of a step is counted from the top-k indices each router returns, summed
over micro-batches and over the ranks that saw different data. Optionally a switch-style
auxiliary loss `E * sum_i f_i * P_i` (fraction of assignments times mean normalised score).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model.expert_index import count_per_expert

ROUTER_SUFFIX = "mixer.gate"


def _recomputing() -> bool:
    """True while autograd runs a backward pass: activation checkpointing re-runs the forward
    there, and its routing (identical to the first pass) must not be counted twice."""
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("onenode::count_expert_load", mutates_args=("load",))
def count_expert_load(indices: torch.Tensor, load: torch.Tensor) -> None:
    """Add each expert's number of assignments in `indices` to `load`, unless a checkpointed
    forward is being recomputed. An op of its own, so that a compiled block calls it as one opaque
    step: the recompute check reads autograd's state, which dynamo cannot trace (a graph break in
    every MoE block, each step) and which must be read when the op runs, not when it is traced."""
    if _recomputing():
        return
    load += count_per_expert(indices, load.numel(), load.dtype)


@count_expert_load.register_fake
def _(indices: torch.Tensor, load: torch.Tensor) -> None:
    return None


def _topk_indices(output) -> torch.Tensor:
    """The integer tensor among a router's outputs: (idx, weight) here, (logits, weight, idx) in HF."""
    for item in output if isinstance(output, (tuple, list)) else (output,):
        if isinstance(item, torch.Tensor) and not item.is_floating_point():
            return item
    raise TypeError("a router (mixer.gate) returned no integer top-k indices: the balancing hook reads them")


class RouterBalancer:
    """Counts expert load per router each step; updates the bias and gives the auxiliary loss.

    Each router's load of the step accumulates in a buffer the balancer gives it (`expert_load`,
    not persistent: no checkpoint or export holds it), and one hook, the same for every router,
    adds to it: in a compiled block the hook then compiles into the graph, with no constant that
    differs from block to block (a per-router key would recompile each MoE block).
    """

    def __init__(self, model: nn.Module, aux_loss: bool = False):
        self.routers = {name: m for name, m in model.named_modules() if name.endswith(ROUTER_SUFFIX)}
        self.aux_loss_enabled = aux_loss
        self._aux_terms: list[torch.Tensor] = []
        self.last_loads: torch.Tensor | None = None  # [routers, experts] of the last finished step
        for router in self.routers.values():
            bias = router.e_score_correction_bias
            router.register_buffer("expert_load", torch.zeros(bias.numel(), device=bias.device,
                                                              dtype=torch.float32), persistent=False)
        self._handles = [m.register_forward_hook(self._hook) for m in self.routers.values()]

    def __bool__(self) -> bool:
        return bool(self.routers)

    def _hook(self, module: nn.Module, inputs, output) -> None:
        idx = _topk_indices(output)
        count_expert_load(idx, module.expert_load)
        if self.aux_loss_enabled and torch.is_grad_enabled() and not _recomputing():
            num_experts = module.e_score_correction_bias.numel()
            counts = count_per_expert(idx, num_experts, torch.float32)
            x = inputs[0].reshape(-1, module.weight.shape[-1])
            scores = F.linear(x.float(), module.weight.float()).sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
            fraction = counts / idx.numel()
            self._aux_terms.append(num_experts * (fraction * probs.mean(dim=0)).sum())

    def pop_aux_loss(self) -> torch.Tensor | None:
        """Mean over routers of the switch loss of the forwards since the last call."""
        if not self._aux_terms:
            return None
        loss = torch.stack(self._aux_terms).mean()
        self._aux_terms = []
        return loss

    @torch.no_grad()
    def finish_step(self, rate: float, group=None) -> dict:
        """All-reduce the step's counts over `group`, move the biases, return balance metrics.

        Metrics: `load_cv` (coefficient of variation of the per-expert load, averaged over
        routers; 0 is perfect balance) and `load_cv_max` (the worst router).
        """
        self._aux_terms = []
        if not self.routers:
            return {}
        names = list(self.routers)
        loads = torch.stack([self.routers[n].expert_load for n in names])
        for name in names:
            self.routers[name].expert_load.zero_()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loads, group=group)
        self.last_loads = loads
        mean = loads.mean(dim=1, keepdim=True)
        if rate > 0:
            for name, delta in zip(names, torch.sign(mean - loads)):
                bias = self.routers[name].e_score_correction_bias
                bias.add_(delta.to(bias.device, bias.dtype), alpha=rate)
        cv = loads.std(dim=1, unbiased=False) / mean.squeeze(1).clamp(min=1e-9)
        return {"load_cv": float(cv.mean()), "load_cv_max": float(cv.max())}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for router in self.routers.values():
            del router.expert_load
