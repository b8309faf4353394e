"""Causal grouped-query attention without any positional embedding (NemotronH has no RoPE:
its Mamba layers carry the order of the tokens).

Two kernels (`NemotronHConfig.attention_kernel`): torch's SDPA (cuDNN's or flash attention on a
GPU), the default; or FlexAttention, inductor's Triton template over a causal block mask. Under
torch's deterministic algorithms SDPA leaves cuDNN out and takes flash attention's deterministic
backward, which took twice cuDNN's time on one H100 (the A2 step 5.4% slower in the mode:
benchmarks/results/2026-12-07-h100-update-overlap/); FlexAttention's backward writes each query
block's dQ from one program and loops over the heads a KV head serves, with no atomics, so it is
deterministic as it is; its tiles come from inductor's table for the shape and GPU (it tries others
only under max-autotune, which the kit never sets), so a replay compiles the same kernels. It is
fast only compiled (the layers' `train.compile`, or its own compile here when they are not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import NemotronHConfig

_BLOCK_MASKS: dict[tuple[int, str], object] = {}  # (sequence length, device) -> the causal BlockMask
_compiled_flex = None  # torch.compile(flex_attention), made at the first call outside a compiled layer on a GPU


def _causal(batch, head, query, key):
    return query >= key


def causal_block_mask(seq: int, device: torch.device):
    """The causal mask over `seq` tokens as FlexAttention's blocks, made once per length and
    device (inside a compiled layer dynamo reads it as an input, or traces its making once)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (seq, str(device))
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        mask = _BLOCK_MASKS[key] = create_block_mask(_causal, None, None, seq, seq, device=device)
    return mask


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouped_query: bool) -> torch.Tensor:
    """Causal attention by FlexAttention: compiled by the layer that calls it where that layer is
    compiled, else by a compile of its own (eager it would run the unfused reference)."""
    global _compiled_flex
    from torch.nn.attention import flex_attention as flex

    run = flex.flex_attention
    if not torch.compiler.is_compiling() and q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex.flex_attention)
        run = _compiled_flex
    return run(q, k, v, block_mask=causal_block_mask(q.shape[-2], q.device), enable_gqa=grouped_query)


class Attention(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # A bool fixed here: compiled as `num_kv_heads != num_heads`, a recompile that makes the
        # head counts symbolic turns it into a SymBool, which SDPA rejects (a graph break).
        self.grouped_query = self.num_kv_heads != self.num_heads
        self.flex = config.attention_kernel == "flex"
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # [B, T, heads * head_dim] -> [B, heads, T, head_dim], the layout SDPA expects.
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.flex:
            y = flex_attention(q, k, v, self.grouped_query)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped_query)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))
