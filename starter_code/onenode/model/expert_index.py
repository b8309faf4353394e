"""A router's expert indices read as compare-and-reduce: per-token weights, per-expert counts.

The indexed forms (`gather`, `index_add_`, `scatter_add_`) scatter-add somewhere, forward or
backward: with atomics, or under deterministic algorithms (the A2 graded runs) with an index sort
and a pass that adds up each run of equal indices one element at a time. With 64 experts a run is
thousands of elements long: one such count per MoE layer and micro-batch was 9.4% of the A2
baseline's deterministic step on one H100. Comparing every index with every expert and reducing
is exact, the same bits in both modes, and one fused pass under torch.compile. The [indices,
experts] comparison is small beside the tokens' activations (a byte per pair).
"""

from __future__ import annotations

import torch


def gather_columns(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`x.gather(1, idx)` for x [N, E] and idx [N, k] naming k distinct columns a row, as a masked
    sum over the E columns (exact: one term of each sum is not zero). Its backward is elementwise,
    where gather's scatter-adds."""
    picked = idx[:, :, None] == torch.arange(x.shape[1], device=x.device)
    return torch.where(picked, x[:, None, :], 0.0).sum(dim=-1)


def count_per_expert(idx: torch.Tensor, num_experts: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[num_experts] in `dtype`: how many entries of `idx` (any shape, values in [0, num_experts))
    name each expert, as `torch.bincount(idx.flatten(), minlength=num_experts)` counts them, with no
    host sync (bincount reads the largest index to size its result) and no scatter-add."""
    hits = idx.reshape(-1, 1) == torch.arange(num_experts, device=idx.device)
    return hits.sum(dim=0, dtype=dtype)
