"""Which parameters weight decay applies to: the matrices, not norm weights, biases or other 1-D
tensors (A_log, D, dt_bias). One rule for every optimizer the kit builds."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or name.endswith(".bias")


def param_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """The trainable parameters in optimizer groups, decayed and not (an empty group is left out)."""
    decay, no_decay = [], []
    for name, param in named_parameters:
        if param.requires_grad:
            (no_decay if no_weight_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
