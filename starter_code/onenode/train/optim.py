"""Muon for the hidden matrices, AdamW for everything else, behind one optimizer-like object.

Muon (Keller Jordan; Moonshot's "Muon is scalable for LLM training") orthogonalises each 2-D
update with a few Newton-Schulz steps. It is meant for hidden-layer matrices only: embeddings,
the LM head, the router, norms, 1-D tensors (A_log, D, dt_bias, biases) and N-D tensors (the
Mamba conv kernel, stacked 3-D experts) stay on AdamW. `torch.optim.Muon` (torch >= 2.9, same
signature on 2.11 and 2.13) accepts FSDP2's DTensor parameters: its matmuls run as DTensor ops,
which gather what they need, so sharded and unsharded runs take the same steps.
"""

from __future__ import annotations

import torch
from torch import nn

from .weight_decay import no_weight_decay as _no_weight_decay  # the name build_muon calls

# Parameter names that stay on AdamW whatever their shape: token-level lookups and the router,
# whose rows are per-class scores rather than a hidden linear map.
_ADAMW_ONLY = ("embeddings.", "lm_head.", "gate.weight")


def is_muon_param(name: str, param: nn.Parameter) -> bool:
    return param.ndim == 2 and not any(key in name for key in _ADAMW_ONLY)


class OptimizerList:
    """Several optimizers stepped as one (the trainer, clipping and schedules see one object).

    `optimizers` is what `torch.distributed.checkpoint.state_dict.get_state_dict` takes.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state: dict) -> None:
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(state[str(i)])


def build_muon(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr_fn: str = "match_rms_adamw",
) -> OptimizerList:
    """Muon on the 2-D hidden matrices, AdamW (decay on matrices only) on the rest, one lr."""
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Muon: install torch >= 2.9 or use adamw")
    muon, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if is_muon_param(name, param):
            muon.append(param)
        else:
            (no_decay if _no_weight_decay(name, param) else decay).append(param)
    optimizers = []
    if muon:
        optimizers.append(torch.optim.Muon(
            muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        ))
    adamw_groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    optimizers.append(torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps, foreach=True))
    return OptimizerList(optimizers)


def optimizers_of(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside `optimizer` (itself when it is one)."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerList) else [optimizer]
