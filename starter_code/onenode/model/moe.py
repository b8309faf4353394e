"""NemotronH's mixture of experts: a sigmoid top-k router, routed relu² experts, a shared expert.

`MoE.routed_experts` computes the routed experts the way NVIDIA's remote code does, one expert
module at a time. The router and the module layout (`gate`, `experts.{j}.up_proj/down_proj`,
`shared_experts`) follow that code's checkpoint names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import NemotronHConfig
from .expert_index import gather_columns
from .mlp import MLP


class TopKRouter(nn.Module):
    """Sigmoid scores; a bias steers which experts are chosen but not how much they weigh.

    `e_score_correction_bias` is the auxiliary-loss-free load-balancing bias (a buffer, updated
    outside backprop). With `n_group > 1` a token first keeps the `topk_group` groups whose two
    best experts score highest, then picks its `top_k` experts inside them. The weights come from
    the unbiased scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
    Everything runs in float32, autocast or not: routing decisions are sensitive to rounding.
    """

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("NemotronHConfig: group-limited routing needs at least 2 experts per group")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (topk_idx [N, k] int64, topk_weight [N, k] float32)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~group_mask[..., None], -torch.inf).flatten(1)
        topk_idx = choice.topk(self.top_k, dim=-1).indices
        topk_weight = gather_columns(scores, topk_idx)
        if self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size, bias=False) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = MLP(config.hidden_size, config.moe_shared_expert_intermediate_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        topk_idx, topk_weight = self.gate(tokens)
        routed = self.routed_experts(tokens, topk_idx, topk_weight)
        return routed.view_as(x) + self.shared_experts(x)

    def routed_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """sum_k topk_weight[:, k] * expert_{topk_idx[:, k]}(x), one expert at a time.

        For each expert: the tokens routed to it, its MLP on them, the weighted result added
        back at their rows. An expert that got no token runs on an empty batch, so every expert
        gets a (zero) gradient every step, which FSDP's reduce-scatter needs.
        """
        out = torch.zeros_like(x, dtype=topk_weight.dtype)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(topk_idx == e)
            if token_idx.numel() > 0:
                y = expert(x[token_idx]) * topk_weight[token_idx, slot, None]
                out.index_add_(0, token_idx, y.to(out.dtype))
            else:
                out = out + expert(x[:0]).sum()  # zero, but keeps the expert in the graph
        return out.to(x.dtype)
