"""RMSNorm and the gated, grouped RMSNorm of Mamba2, computed in float32 like the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, statistics and the weight multiply in float32, result cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's output norm: `weight * norm(y * silu(z))`, normalised per group of channels.

    Each of the `n_groups` channel groups gets its own RMS, so the norm does not mix the
    groups that share B and C (and stays local when heads are split across devices).
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"GatedRMSNorm: hidden_size {hidden_size} is not a multiple of group_size {group_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y32 = y.float() * F.silu(z.float())
        groups = y32.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        # As the reference: cast back first, then the weight multiply.
        return self.weight * groups.flatten(-2).to(dtype)
