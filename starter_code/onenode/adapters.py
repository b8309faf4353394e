"""Where the public tests find the parts of your model that they check.

They reach the routed experts only through these functions, so a MoE is tested on what it
computes, not on what its parameters are called. (The grader does not call them: it finds each
expert's weights among the layer's parameters by their values, as it loaded them, and reads the
gradients there.) If you store the experts differently (other
names, another layout, a padded batch), change these functions so they still return the same
numbers in the layout below.

Layout: `up` [E, I, H] and `down` [E, H, I] (E experts, hidden size H, intermediate size I), so
expert j computes `down[j] @ relu(up[j] @ x) ** 2`. E counts the experts this process holds.
"""

from __future__ import annotations

import torch
from torch import nn


def _experts_of(moe: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters holding the up and down projections (one per expert, or one stacked)."""
    experts = moe.experts
    if isinstance(experts, nn.ModuleList):
        return [e.up_proj.weight for e in experts], [e.down_proj.weight for e in experts]
    return [experts.up_proj], [experts.down_proj]


def _stacked(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    if any(t is None for t in tensors):
        return None
    return tensors[0] if len(tensors) == 1 and tensors[0].dim() == 3 else torch.stack(tensors)


def routed_expert_weights(moe: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [E, I, H], down [E, H, I]) of a MoE layer's routed experts."""
    up, down = _experts_of(moe)
    return _stacked(up), _stacked(down)


def routed_expert_grads(moe: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of `routed_expert_weights(moe)`, in the same layout (None before a backward)."""
    up, down = _experts_of(moe)
    return _stacked([p.grad for p in up]), _stacked([p.grad for p in down])
