"""NemotronH's mixture of experts: a sigmoid top-k router, routed relu² experts, a shared expert.

The routed experts are stacked (`experts.up_proj` [E, I, H], `experts.down_proj` [E, H, I], the
transformers-native names) and run as one grouped GEMM per projection over the tokens sorted by
expert. `hf_io` loads and saves both checkpoint layouts into this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import NemotronHConfig
from .expert_index import count_per_expert, gather_columns
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


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows `offsets[j-1]:offsets[j]` of x [M, K] times weight[j] [K, N], for every expert j.

    `torch._grouped_mm` (one kernel) where it runs: bf16 on Hopper or newer, and on CPU; both want
    rows of K and N a multiple of 16 bytes. Elsewhere (fp32 on CUDA or compiled, older GPUs, odd
    sizes) a loop over the contiguous groups, with one host sync for their sizes.
    """
    aligned = all(size * x.element_size() % 16 == 0 for size in (x.shape[-1], weight.shape[-1]))
    bf16 = x.dtype == torch.bfloat16
    if hasattr(torch, "_grouped_mm") and aligned and (
        # the compiler's shape check wants bf16 even on CPU, where eager takes float32 too
        (x.device.type == "cpu" and (bf16 or not torch.compiler.is_compiling()))
        or (bf16 and x.is_cuda and torch.cuda.get_device_properties(x.device).major >= 9)
    ):
        return torch._grouped_mm(x, weight, offs=offsets.to(torch.int32))
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    return torch.cat([rows @ w for rows, w in zip(x.split(sizes), weight)])


def _to_expert_order(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [N, H] -> [N * k, H]: row p is the token of the p-th (token, slot) pair in expert order."""
    return x[order // top_k]


def _to_token_order(y: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """y [N * k, H] in expert order -> [N, H]: each token's k rows, gathered back and summed."""
    return y[inverse].unflatten(0, (-1, top_k)).sum(dim=1)


class _DispatchToExperts(torch.autograd.Function):
    """`_to_expert_order`, whose gradient is `_to_token_order`: gathers both ways. (Indexing's own
    backward would scatter-add into the tokens, with atomics or a sort.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return _to_expert_order(x, order, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _to_token_order(grad, inverse, ctx.top_k), None, None, None


class _CombineFromExperts(torch.autograd.Function):
    """`_to_token_order`, whose gradient is `_to_expert_order`: the adjoint of the dispatch."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return _to_token_order(y, inverse, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return _to_expert_order(grad, order, ctx.top_k), None, None, None


class GroupedExperts(nn.Module):
    """All routed experts of a layer, stacked: relu² MLPs run as two grouped GEMMs.

    The (token, slot) pairs are sorted by expert (a stable argsort of the flat top-k indices), so
    each expert's tokens are contiguous. The router's weight scales each pair's activation before
    the down projection (which is linear), so the combine is a plain sum: the rows go back to
    token order through the inverse permutation and each token adds up its k rows. Gathers only,
    forward and backward (no atomic `index_add_`), and no host sync on the grouped-GEMM path: the
    counts are a compare-and-sum (`count_per_expert`), not `bincount`. The weights are used as
    they come (bf16 under the kit's mixed precision), never cast per call.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        top_k = topk_idx.shape[1]
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        offsets = count_per_expert(flat, self.up_proj.shape[0]).cumsum(0)
        rows = _DispatchToExperts.apply(x, order, inverse, top_k)
        hidden = F.relu(grouped_mm(rows, self.up_proj.transpose(1, 2), offsets)).square()
        hidden = hidden * _DispatchToExperts.apply(topk_weight.reshape(-1, 1), order, inverse, 1).to(hidden.dtype)
        out = grouped_mm(hidden, self.down_proj.transpose(1, 2), offsets)
        return _CombineFromExperts.apply(out, order, inverse, top_k)


class MoE(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = GroupedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = MLP(config.hidden_size, config.moe_shared_expert_intermediate_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        topk_idx, topk_weight = self.gate(tokens)
        routed = self.routed_experts(tokens, topk_idx, topk_weight)
        return routed.view_as(x) + self.shared_experts(x)

    def routed_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """sum_k topk_weight[:, k] * expert_{topk_idx[:, k]}(x), all experts at once."""
        return self.experts(x, topk_idx, topk_weight)
