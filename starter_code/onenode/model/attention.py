"""Causal grouped-query attention without any positional embedding (NemotronH has no RoPE:
its Mamba layers carry the order of the tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import NemotronHConfig


class Attention(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # A bool fixed here: compiled as `num_kv_heads != num_heads`, a recompile that makes the
        # head counts symbolic turns it into a SymBool, which SDPA rejects (a graph break).
        self.grouped_query = self.num_kv_heads != self.num_heads
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
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.grouped_query
        )
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))
