"""The Mamba2 mixer and its chunked SSD scan, in plain PyTorch.

Shapes used throughout: b = batch, t = time, h = SSM heads, p = head dim, g = groups (heads in
one group share B and C), n = state size, c = chunk index, l and s = positions in a chunk.

`ssd_chunked` is a standalone function of tensors only, so it can be `torch.compile`d or swapped
for a kernel. With `config.mamba_kernel="mamba_ssm"` (decided once when the mixer is built) the
mixer runs mamba_ssm's Triton SSD instead: `mamba_ssm_scan.py` loads it without the package's CUDA
extension and wraps it as an op that `torch.compile` does not break on; it is only ever tried
lazily and never breaks `import onenode`. Everything a mixer runs per call is plain tensor code:
a compiled block is one graph, and the conv, SiLU, gates and norms fuse into a few kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import mamba_ssm_scan
from .config import NemotronHConfig
from .norms import GatedRMSNorm


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """`out[..., i, j] = a[..., j+1] + ... + a[..., i]` for i >= j, -inf above the diagonal.

    exp() of it is the decay from position j to position i. Built from a masked cumsum rather than
    a difference of cumsums, which loses precision when the sums get large: across chunks they
    run over the whole sequence (`carry_across_chunks`, a [c+1, c+1] matrix, cheap either way).
    """
    T = a.size(-1)
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    a = a[..., None].expand(*a.shape, T).masked_fill(~torch.tril(ones, diagonal=-1), 0)  # [..., k, j] = a[k]
    return a.cumsum(dim=-2).masked_fill(~torch.tril(ones), -torch.inf)


def decay_within_chunks(a_cum: torch.Tensor) -> torch.Tensor:
    """[..., l, s]: the decay from position s to position l of each chunk (0 for s > l), from the
    cumulative dt A of each chunk (`a_cum`, [..., l]): exp(a_cum[l] - a_cum[s]), pointwise, as
    mamba_ssm's kernels compute it. `segment_sum` sums each [l, s] segment instead, a scan per
    element of an [l, s] matrix: exact, but the A2 baseline's deterministic step took 5% longer
    with it on an H100 (benchmarks/results/2026-12-06-h100-accumulation-replay-decay-difference/). Within a chunk the
    sums stay small, and the digits float32's difference loses the bf16 product that follows loses
    anyway."""
    causal = torch.ones(a_cum.size(-1), a_cum.size(-1), dtype=torch.bool, device=a_cum.device).tril()
    return torch.exp((a_cum[..., :, None] - a_cum[..., None, :]).masked_fill(~causal, -torch.inf))


def carry_across_chunks(chunk_states: torch.Tensor, chunk_logdecay: torch.Tensor) -> torch.Tensor:
    """The state entering each chunk: the sum of every earlier chunk's own state (`chunk_states`
    [b, c, g, r, p, n]), decayed over the chunks in between (`chunk_logdecay` [b, g, r, c], each
    chunk's summed dt A), as one product with the [c+1, c+1] matrix of decays: [b, c, g, r, p, n]."""
    chunk_states = torch.cat([torch.zeros_like(chunk_states[:, :1]), chunk_states], dim=1)
    chunk_decay = torch.exp(segment_sum(F.pad(chunk_logdecay, (1, 0))))  # [b, g, r, c+1, c+1]
    return torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, chunk_states)[:, :-1]


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SSD scan `state_t = exp(dt_t A) state_{t-1} + dt_t B_t x_t`, `y_t = C_t state_t + D x_t`.

    x [b, t, h, p], dt [b, t, h] (already softplus-ed and clamped), A [h] (negative),
    B and C [b, t, g, n], D [h]. Any t: the time axis is zero-padded to a multiple of the chunk
    (zero dt = no input and no decay, and padding sits after every real step, so it changes
    nothing). Computes and returns float32 (float64 if x is float64): [b, t, h, p]. With bfloat16
    or float16 inputs the chunk products take bf16/fp16 operands with float32 accumulation (tensor
    cores, as mamba_ssm's kernels do); decays, cumulative sums and the states carried across chunks
    stay in float32.

    Within a chunk the scan is a masked attention-like matmul (C B^T with the decay mask); across
    chunks only the [h, p, n] states are carried, by a small recurrence over the chunks.
    """
    b, t, h, p = x.shape
    g, n = B.shape[-2:]
    dtype = torch.promote_types(x.dtype, torch.float32)
    operands = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else dtype  # of the chunk products
    pad = (-t) % chunk_size
    x, dt = (F.pad(v.to(dtype), (0, 0) * (v.dim() - 2) + (0, pad)) for v in (x, dt))
    B, C = (F.pad(v.to(operands), (0, 0, 0, 0, 0, pad)) for v in (B, C))
    nc = (t + pad) // chunk_size

    # Heads split as (g, r): head i reads the B and C of group i // r, as repeat_interleave would.
    xg = x.view(b, nc, chunk_size, g, h // g, p)
    dtx = xg * dt.view(b, nc, chunk_size, g, h // g, 1)
    Bc = B.view(b, nc, chunk_size, g, n)
    Cc = C.view(b, nc, chunk_size, g, n)
    a = (dt * A.to(dtype)).view(b, nc, chunk_size, g, h // g).permute(0, 3, 4, 1, 2)  # [b, g, r, c, l]
    a_cum = a.cumsum(dim=-1)

    # 1. Within each chunk: y_l = sum_{s<=l} (C_l . B_s) decay(s->l) dt_s x_s.
    scores = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)
    weights = scores[:, :, None] * decay_within_chunks(a_cum)  # [b, g, r, c, l, s], float32
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", weights.to(operands), dtx.to(operands)).to(dtype)

    # 2. The state each chunk leaves behind, from its own inputs only.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum).permute(0, 3, 4, 1, 2)  # [b, c, l, g, r]
    chunk_states = torch.einsum("bclgn,bclgrp->bcgrpn", Bc, (dtx * decay_to_end[..., None]).to(operands))

    # 3. Carry the states across chunks.
    start_states = carry_across_chunks(chunk_states.to(dtype), a_cum[..., -1])

    # 4. What the incoming state contributes inside each chunk.
    decay_from_start = torch.exp(a_cum).permute(0, 3, 4, 1, 2)  # [b, c, l, g, r]
    carried = torch.einsum("bclgn,bcgrpn->bclgrp", Cc, start_states.to(operands)).to(dtype)
    y = y + carried * decay_from_start[..., None]

    y = y.reshape(b, nc * chunk_size, h, p)[:, :t]
    if D is not None:
        y = y + x[:, :t] * D.to(dtype)[:, None]
    return y


def ssd_naive(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same scan one time step at a time: slow, obviously right, for tests only."""
    b, t, h, p = x.shape
    g = B.shape[2]
    B = B.repeat_interleave(h // g, dim=2)
    C = C.repeat_interleave(h // g, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for i in range(t):
        decay = torch.exp(dt[:, i] * A)[:, :, None, None]
        state = state * decay + (dt[:, i, :, None] * x[:, i])[..., None] * B[:, i, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, i]))
    y = torch.stack(ys, dim=1)
    return y + x * D[:, None] if D is not None else y


def select_ssd(kernel: str) -> Callable:
    """The scan for `config.mamba_kernel`: "torch"; "mamba_ssm" (an error where it does not import,
    no GPU is present, or torch's deterministic algorithms are on and its kernels would not give the
    same bits on every run); "auto" (mamba_ssm's where it could be chosen, else torch). Called once
    per mixer, when it is built; mamba_ssm's kernel then needs CUDA tensors."""
    if kernel == "torch":
        return ssd_chunked
    loaded, why_not = mamba_ssm_scan.load_kernels()
    if loaded is not None and torch.are_deterministic_algorithms_enabled():
        why_not = mamba_ssm_scan.why_not_deterministic(loaded)
        if why_not and kernel == "mamba_ssm":
            raise mamba_ssm_scan.KernelUnavailableError(
                f"mamba_kernel='mamba_ssm' under deterministic kernels: {why_not}; or set mamba_kernel='torch'")
        loaded = None if why_not else loaded
    if kernel == "mamba_ssm":
        if loaded is None:
            raise mamba_ssm_scan.KernelUnavailableError(
                f"mamba_kernel='mamba_ssm' but mamba_ssm's Triton SSD does not import ({why_not}): "
                f"{mamba_ssm_scan.INSTALL_HINT}, or set mamba_kernel='torch'"
            )
        if not torch.cuda.is_available():
            raise mamba_ssm_scan.KernelUnavailableError(
                "mamba_kernel='mamba_ssm' needs a GPU, none is present: set mamba_kernel='torch'"
            )
    if loaded is None or not torch.cuda.is_available():
        return ssd_chunked
    return mamba_ssm_scan.chunk_scan


class CausalConv1d(nn.Module):
    """Mamba2's depthwise causal conv over time, on [b, t, channels], as `kernel` shifted
    multiply-adds accumulated in float32, then cast back to the input's dtype.

    The parameters and the result are those of `nn.Conv1d(c, c, k, groups=c, padding=k-1)` cut to
    the first t outputs (`weight` [c, 1, k], `bias` [c]: the checkpoint layout), but there is no
    convolution kernel: torch.compile fuses the taps with the SiLU after them into one pass (the
    generic depthwise kernel is slow), and the channels stay last (no transposes).
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.register_parameter("bias", nn.Parameter(torch.empty(channels)) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, t = self.weight.shape[-1], x.shape[1]
        taps = self.weight[:, 0].float()  # [c, k]
        padded = F.pad(x, (0, 0, k - 1, 0))  # k - 1 zeros before the first step
        y = padded[:, :t].float() * taps[:, 0]
        for i in range(1, k):
            y = y + padded[:, i:i + t].float() * taps[:, i]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> [z, xBC, dt]; causal depthwise conv + SiLU on xBC; SSD; gated norm; out_proj."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.n_groups
        self.state_size = config.ssm_state_size
        self.inner_size = config.mamba_inner_size
        self.conv_dim = config.mamba_conv_dim
        self.in_proj = nn.Linear(
            config.hidden_size, self.inner_size + self.conv_dim + self.num_heads, bias=config.mamba_proj_bias
        )
        self.conv1d = CausalConv1d(self.conv_dim, config.conv_kernel, bias=config.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(self.inner_size, self.inner_size // self.n_groups, eps=config.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner_size, config.hidden_size, bias=config.mamba_proj_bias)
        self.ssd = select_ssd(config.mamba_kernel)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden_states.shape
        gs = self.n_groups * self.state_size
        z, xBC, dt = self.in_proj(hidden_states).split([self.inner_size, self.conv_dim, self.num_heads], dim=-1)
        xBC = F.silu(self.conv1d(xBC))
        x, B, C = xBC.split([self.inner_size, gs, gs], dim=-1)
        # dt in float32 (the reference computes the softplus in the activation dtype).
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.config.time_step_limit)
        A = -torch.exp(self.A_log.float())
        y = self.ssd(
            x.reshape(b, t, self.num_heads, self.head_dim), dt, A,
            B.reshape(b, t, self.n_groups, self.state_size), C.reshape(b, t, self.n_groups, self.state_size),
            self.config.chunk_size, D=self.D,
        )
        y = self.norm(y.reshape(b, t, self.inner_size), z)
        return self.out_proj(y.to(hidden_states.dtype))
