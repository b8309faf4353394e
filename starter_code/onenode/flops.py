"""A FLOP model of NemotronH that keeps tensor-core matmul FLOPs apart from everything else.

MFU is only honest if the numerator counts work the GPU's tensor cores can do. In a hybrid
model a large share of the time goes to things that are not matmuls (the Mamba2 conv and
recurrences, elementwise gates, norms, the softmax), so this model reports two numbers:

* `matmul` FLOPs: every GEMM, counted as 2*m*n*k, exactly as `torch.utils.flop_counter`
  counts the torch reference path (`tests/test_flops.py` checks it per layer kind and for a
  whole model). MFU uses these only.
* `other` FLOPs: an estimate of the CUDA-core work (about one FLOP per add or multiply, a few
  per exp/sigmoid/SiLU), so you can see where it is large; it is not part of MFU.

Conventions (say them when you quote a number):

* backward = 2x forward for every matmul (one GEMM for the input gradient, one for the weight
  gradient); forward + backward = 3x forward. Activation-checkpointing recompute is NOT counted
  (this is model FLOPs utilisation, not hardware FLOPs utilisation).
* Attention core: causal, so half of the full 4*s^2*d per layer and sequence (Megatron's
  convention). `torch.utils.flop_counter` counts the full square (and 2.5x forward for the SDPA
  backward, because flash attention recomputes the scores); `causal_attention=False` gives the
  full square for comparing.
* MoE: per token only the router, the top-k routed experts and the shared expert.
* Embedding lookup: zero FLOPs. The lm_head is a full matmul over the vocabulary.
* Mamba2's SSD is counted as the chunked algorithm computes it (chunk length Q, the sequence
  padded to a multiple of Q): per chunk, C B^T per group, the masked (C B^T) x per head, the chunk
  states B^T x and the state read-out C h per head, and the torch path's carry of states across
  chunks, one (c+1) x (c+1) matmul per sequence (mamba_ssm does that carry as a scan instead; it
  is about 1% of a Mamba layer at 4096 tokens). Per token that is about d_in(2Q + 4N) + 2GQN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .model.config import NemotronHConfig

H100_H200_BF16_PEAK = 989e12  # dense bf16 tensor-core peak of H100 SXM and H200 (datasheet)
FORWARD_BACKWARD = 3  # matmul FLOPs of forward + backward / forward


@dataclass
class LayerFlops:
    """Forward FLOPs of one layer (or of the embeddings / head) for a whole batch, by item."""

    name: str
    kind: str
    matmul: dict[str, int] = field(default_factory=dict)
    other: dict[str, int] = field(default_factory=dict)

    @property
    def matmul_total(self) -> int:
        return sum(self.matmul.values())

    @property
    def other_total(self) -> int:
        return sum(self.other.values())


@dataclass
class FlopReport:
    """Forward FLOPs of every layer for `batch` sequences of `seq_len` tokens, and derived figures."""

    config_name: str
    seq_len: int
    batch: int
    causal_attention: bool
    layers: list[LayerFlops]

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch

    @property
    def forward_matmul_flops(self) -> int:
        return sum(layer.matmul_total for layer in self.layers)

    @property
    def forward_other_flops(self) -> int:
        return sum(layer.other_total for layer in self.layers)

    @property
    def matmul_flops_per_token(self) -> float:
        """Tensor-core FLOPs per token, forward + backward: the numerator of MFU."""
        return FORWARD_BACKWARD * self.forward_matmul_flops / self.tokens

    @property
    def other_flops_per_token(self) -> float:
        """Estimated CUDA-core FLOPs per token, forward + backward (same 3x convention)."""
        return FORWARD_BACKWARD * self.forward_other_flops / self.tokens

    def per_kind(self) -> dict[str, dict[str, int]]:
        """Forward FLOPs summed by layer kind: {kind: {"matmul": ..., "other": ...}}."""
        out: dict[str, dict[str, int]] = {}
        for layer in self.layers:
            entry = out.setdefault(layer.kind, {"matmul": 0, "other": 0})
            entry["matmul"] += layer.matmul_total
            entry["other"] += layer.other_total
        return out

    def to_dict(self) -> dict:
        return {
            "config": self.config_name, "seq_len": self.seq_len, "batch": self.batch,
            "causal_attention": self.causal_attention,
            "matmul_flops_per_token": self.matmul_flops_per_token,
            "other_flops_per_token": self.other_flops_per_token,
            "forward_matmul_flops": self.forward_matmul_flops,
            "forward_other_flops": self.forward_other_flops,
            "per_kind_forward": self.per_kind(),
            "per_layer_forward": [
                {"name": layer.name, "kind": layer.kind, "matmul": layer.matmul, "other": layer.other}
                for layer in self.layers
            ],
        }

    def table(self) -> str:
        """Per kind: GFLOP per token (forward + backward), matmul and other, and the matmul share."""
        total = self.forward_matmul_flops
        scale = FORWARD_BACKWARD / self.tokens / 1e9
        attention = "causal-half" if self.causal_attention else "full-square"
        lines = [f"{self.config_name} at {self.seq_len} tokens: GFLOP per token, forward + backward, "
                 f"{attention} attention",
                 f"{'kind':<10} {'layers':>6} {'matmul':>8} {'share':>6} {'other':>8}"]
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        for kind, f in self.per_kind().items():
            lines.append(f"{kind:<10} {counts[kind]:>6} {f['matmul'] * scale:>8.3f} "
                         f"{f['matmul'] / total:>6.1%} {f['other'] * scale:>8.4f}")
        lines.append(f"{'total':<10} {len(self.layers):>6} {self.matmul_flops_per_token / 1e9:>8.3f} "
                     f"{1:>6.0%} {self.other_flops_per_token / 1e9:>8.4f}")
        return "\n".join(lines)


# -- one layer of each kind (forward, whole batch) ------------------------------------------------
# Constants for the `other` estimate: FLOPs per element of a few elementwise functions.
_EXP = 4  # exp, sigmoid, softplus: a handful of CUDA-core instructions, call it 4
_SILU = _EXP + 2  # x * sigmoid(x)
_RMSNORM = 4  # square, mean, scale by rsqrt, weight multiply


def mamba_flops(config: NemotronHConfig, seq_len: int, batch: int) -> tuple[dict[str, int], dict[str, int]]:
    """Mamba2 mixer. d_in = heads * head_dim, G groups of B and C with state N, chunk Q."""
    h, d_in, heads = config.hidden_size, config.mamba_inner_size, config.mamba_num_heads
    G, N, Q, K = config.n_groups, config.ssm_state_size, config.chunk_size, config.conv_kernel
    conv_dim = config.mamba_conv_dim
    tokens = batch * seq_len
    nc = math.ceil(seq_len / Q)  # chunks per sequence, the last one zero-padded
    chunks = batch * nc
    matmul = {
        # in_proj: h -> [z (d_in), xBC (d_in + 2GN), dt (heads)]
        "in_proj": 2 * tokens * h * (2 * d_in + 2 * G * N + heads),
        # per chunk and group: scores = C B^T, [Q, N] x [N, Q]
        "ssd_scores": 2 * chunks * G * Q * Q * N,
        # per chunk and head: y = (scores * decay) x, [Q, Q] x [Q, head_dim]
        "ssd_intra_chunk": 2 * chunks * Q * Q * d_in,
        # per chunk and head: chunk state = B^T (decay * dt * x), [N, Q] x [Q, head_dim]
        "ssd_chunk_states": 2 * chunks * Q * N * d_in,
        # per sequence: states entering each chunk = decay [c+1, c+1] x states [c+1, head_dim * N]
        "ssd_state_passing": 2 * batch * (nc + 1) ** 2 * d_in * N,
        # per chunk and head: y += C h, [Q, N] x [N, head_dim]
        "ssd_state_output": 2 * chunks * Q * N * d_in,
        "out_proj": 2 * tokens * d_in * h,
    }
    padded = chunks * Q
    other = {
        "conv1d": 2 * tokens * K * conv_dim,  # depthwise: K multiply-adds per channel
        "conv_silu": _SILU * tokens * conv_dim,
        "dt_softplus": (_EXP + 1) * tokens * heads,
        # decay masks exp(segsum): Q x Q per chunk and head (cumsum, exp), times the scores
        "ssd_decay_mask": (2 + _EXP + 1) * chunks * heads * Q * Q,
        # dt * x, the decays of states in and out (exp + multiply), D skip: per element of x
        "ssd_elementwise": (1 + 2 * (_EXP + 1) + 2) * padded * d_in,
        "gated_norm": (_SILU + 1 + _RMSNORM) * tokens * d_in,
    }
    return matmul, other


def attention_flops(config: NemotronHConfig, seq_len: int, batch: int,
                    causal: bool = True) -> tuple[dict[str, int], dict[str, int]]:
    """GQA attention without positional embedding. d = q_heads * head_dim."""
    h, hd = config.hidden_size, config.head_dim
    d_q, d_kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    tokens = batch * seq_len
    # Full square: QK^T and PV, 2 s^2 d each; the causal mask needs only the lower half.
    core = 4 * batch * seq_len * seq_len * d_q
    scores = batch * config.num_attention_heads * seq_len * seq_len
    if causal:
        core, scores = core // 2, scores // 2
    matmul = {
        "q_proj": 2 * tokens * h * d_q,
        "kv_proj": 2 * 2 * tokens * h * d_kv,
        "attention_core": core,
        "o_proj": 2 * tokens * d_q * h,
    }
    other = {"softmax": (_EXP + 4) * scores}  # scale, max, subtract, exp, sum, divide
    return matmul, other


def mlp_flops(config: NemotronHConfig, seq_len: int, batch: int) -> tuple[dict[str, int], dict[str, int]]:
    """Dense squared-ReLU MLP, not gated: two matmuls (a gated MLP would have three)."""
    tokens, h, inner = batch * seq_len, config.hidden_size, config.intermediate_size
    return {"up_proj": 2 * tokens * h * inner, "down_proj": 2 * tokens * inner * h}, {"relu2": 2 * tokens * inner}


def moe_flops(config: NemotronHConfig, seq_len: int, batch: int) -> tuple[dict[str, int], dict[str, int]]:
    """Router over all experts, the top-k routed experts and the shared expert, per token."""
    tokens, h, E, k = batch * seq_len, config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    inner, shared = config.moe_intermediate_size, config.moe_shared_expert_intermediate_size
    matmul = {
        "router": 2 * tokens * h * E,
        "routed_experts": 2 * 2 * tokens * k * h * inner,
        "shared_expert": 2 * 2 * tokens * h * shared,
    }
    other = {
        "router_sigmoid_topk": (_EXP + 2) * tokens * E,  # sigmoid, bias add, top-k selection
        "relu2": 2 * tokens * (k * inner + shared),
        "combine": 2 * tokens * k * h + tokens * h,  # weight, sum over k, add the shared expert
    }
    return matmul, other


_LAYER_FLOPS = {"mamba": mamba_flops, "attention": attention_flops, "mlp": mlp_flops, "moe": moe_flops}


def layer_flops(config: NemotronHConfig, kind: str, seq_len: int, batch: int = 1,
                causal_attention: bool = True) -> LayerFlops:
    """Forward FLOPs of one mixer of `kind` plus its pre-norm and residual add."""
    if kind not in _LAYER_FLOPS:
        raise ValueError(f"unknown layer kind {kind!r}: use one of {', '.join(_LAYER_FLOPS)}")
    kwargs = {"causal": causal_attention} if kind == "attention" else {}
    matmul, other = _LAYER_FLOPS[kind](config, seq_len, batch, **kwargs)
    other["norm_residual"] = (_RMSNORM + 1) * batch * seq_len * config.hidden_size
    return LayerFlops(name=kind, kind=kind, matmul=matmul, other=other)


def model_flops(config: NemotronHConfig, seq_len: int, batch: int = 1,
                causal_attention: bool = True) -> FlopReport:
    """Forward FLOPs of the whole causal LM, per layer, for `batch` sequences of `seq_len`."""
    if seq_len < 1 or batch < 1:
        raise ValueError(f"seq_len and batch must be positive, got seq_len={seq_len}, batch={batch}")
    tokens, h, V = batch * seq_len, config.hidden_size, config.vocab_size
    layers = [LayerFlops(name="embeddings", kind="embeddings")]  # a lookup: no FLOPs
    for i, kind in enumerate(config.layer_kinds):
        layer = layer_flops(config, kind, seq_len, batch, causal_attention)
        layer.name = f"layers.{i}"
        layers.append(layer)
    layers.append(LayerFlops(
        name="lm_head", kind="lm_head",
        matmul={"lm_head": 2 * tokens * h * V},
        # final norm; log-softmax and the loss over the vocabulary
        other={"norm_f": _RMSNORM * tokens * h, "cross_entropy": (_EXP + 3) * tokens * V},
    ))
    return FlopReport(config_name=config.name, seq_len=seq_len, batch=batch,
                      causal_attention=causal_attention, layers=layers)


def mfu(tokens_per_s: float, flops_per_token: float, n_gpus: int = 1, peak: float = H100_H200_BF16_PEAK) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over `n_gpus * peak` (a fraction, not a percent).

    Pass `FlopReport.matmul_flops_per_token` and the total tokens/s of all GPUs.
    """
    if n_gpus < 1 or peak <= 0:
        raise ValueError(f"mfu needs n_gpus >= 1 and a positive peak, got {n_gpus} and {peak}")
    return tokens_per_s * flops_per_token / (n_gpus * peak)
