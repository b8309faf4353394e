"""NemotronH: pre-norm residual blocks around four kinds of mixer, a backbone and a causal LM head.

Module names follow NVIDIA's remote code (`backbone.embeddings`, `backbone.layers.{i}.norm`,
`backbone.layers.{i}.mixer`, `backbone.norm_f`, `lm_head`). Every layer has the same call
signature, `layer(hidden_states) -> hidden_states`, so pipeline stages and activation
checkpointing can treat the layers as a plain list.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from . import hf_io
from .attention import Attention, causal_block_mask
from .config import NemotronHConfig
from .loss import linear_cross_entropy
from .mamba2 import Mamba2Mixer
from .mlp import MLP
from .moe import MoE, TopKRouter
from .norms import GatedRMSNorm, RMSNorm


def _dense_mlp(config: NemotronHConfig) -> MLP:
    return MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)


MIXERS = {"mamba": Mamba2Mixer, "attention": Attention, "moe": MoE, "mlp": _dense_mlp}


class Block(nn.Module):
    """`x + mixer(norm(x))`. With `residual_in_fp32` the residual stream is kept in float32."""

    def __init__(self, config: NemotronHConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_kinds[layer_idx]
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = MIXERS[self.kind](config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        return residual + self.mixer(self.norm(hidden_states.to(self.norm.weight.dtype)))


class NemotronHModel(nn.Module):
    """The backbone: embeddings, the layers, the final norm (no head)."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attends_with_flex = config.attention_kernel == "flex" and "attention" in config.layer_kinds

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.attends_with_flex:  # the causal mask made here, eager (made in a compiled layer, it recompiles)
            causal_block_mask(input_ids.shape[1], input_ids.device)
        hidden_states = self.embeddings(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm_f(hidden_states)


class CausalLMOutput(NamedTuple):
    """A NamedTuple, not a dataclass: FSDP2 finds the output tensors with pytree to hook the
    root's pre-backward unshard on them, and pytree walks tuples but not plain dataclasses."""

    logits: torch.Tensor | None  # [B, T, V], in the model's dtype; with labels only when asked for
    loss: torch.Tensor | None = None  # scalar float32, when labels were given


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = config
        self.backbone = NemotronHModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if self.lm_head.weight.device.type != "meta":
            self.init_weights(seed=0)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> NemotronHForCausalLM:
        """A model from a checkpoint folder (config.json + safetensors) in either layout, transformers'
        or NVIDIA's remote code. `dtype=None` keeps the checkpoint's; the router stays float32."""
        config, state_dict = hf_io.read_checkpoint(path)
        if dtype is None:
            dtype = next((v.dtype for k, v in state_dict.items() if k.endswith("embeddings.weight")), torch.float32)
        model = build_model(config, device="meta", dtype=dtype)
        model.to_empty(device=device)
        model.tie_weights()
        model.load_state_dict(hf_io.adapt_state_dict(state_dict, model))
        return model

    def save_pretrained(self, path: str | Path) -> Path:
        """config.json + model.safetensors in the transformers-native layout, which
        `transformers.AutoModelForCausalLM.from_pretrained(path)` loads (same logits)."""
        return hf_io.save_pretrained(self, path)

    def tie_weights(self) -> None:
        """Share the embedding with the head when the config says so (again after `to_empty`,
        which gives every module its own new tensors)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                return_logits: bool = False) -> CausalLMOutput:
        """input_ids [B, T] -> logits [B, T, V]. With `labels` (shifted targets, see `model/loss.py`)
        the mean loss instead, fused with the head a chunk of tokens at a time so the batch's logits
        never exist (`linear_cross_entropy`); `return_logits=True` computes them too."""
        hidden_states = self.backbone(input_ids).to(self.lm_head.weight.dtype)
        loss = None if labels is None else linear_cross_entropy(hidden_states, self.lm_head.weight, labels)
        logits = self.lm_head(hidden_states) if labels is None or return_logits else None
        return CausalLMOutput(logits=logits, loss=loss)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter and buffer from its own generator, seeded by (seed, name).

        A tensor's values depend only on the seed, its fully qualified name and the device type,
        so a part of the model (a pipeline stage, a shard of experts) initialises exactly as the
        full model would. The scheme is transformers' NemotronH `_init_weights`.
        """
        # Mamba's out_proj writes into the residual stream: GPT-2's 1/sqrt(depth) rescale.
        rescaled = {m.out_proj for m in self.modules() if isinstance(m, Mamba2Mixer)}
        seen = set()  # a tied head is initialised once, as the embedding
        for module_name, module in self.named_modules():
            tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, tensor in tensors:
                if tensor.device.type == "meta" or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                fqn = f"{module_name}.{name}" if module_name else name
                gen = _generator(seed, fqn, tensor.device)
                _init_tensor(module, name, tensor, gen, self.config, rescale=module in rescaled)


def _generator(seed: int, fqn: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _init_tensor(module: nn.Module, name: str, tensor: torch.Tensor, gen: torch.Generator,
                 config: NemotronHConfig, rescale: bool) -> None:
    std = config.initializer_range
    if isinstance(module, (RMSNorm, GatedRMSNorm)):
        tensor.fill_(1.0)
    elif isinstance(module, TopKRouter) and name == "e_score_correction_bias":
        tensor.zero_()
    elif isinstance(module, Mamba2Mixer) and name in ("A_log", "D", "dt_bias"):
        h = tensor.numel()
        if name == "A_log":  # A = -(1, 2, ..., h): heads decay at different rates
            values = torch.log(torch.arange(1, h + 1, dtype=torch.float32))
        elif name == "D":
            values = torch.ones(h)
        else:  # softplus(dt_bias) is log-uniform in [time_step_min, time_step_max], floored
            lo, hi = math.log(config.time_step_min), math.log(config.time_step_max)
            u = torch.rand(h, generator=gen, device=tensor.device)
            dt = torch.exp(u * (hi - lo) + lo).clamp(min=config.time_step_floor)
            values = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        tensor.copy_(values)
    elif name == "bias":
        tensor.zero_()
    elif rescale and config.rescale_prenorm_residual:  # torch's default Linear init, / sqrt(layers)
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=gen)
        tensor.div_(math.sqrt(config.num_hidden_layers))
    else:  # Linear, Conv1d, Embedding, router and expert weights (also stacked 3-D experts)
        tensor.normal_(0.0, std, generator=gen)


def build_model(config: NemotronHConfig, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> NemotronHForCausalLM:
    """A NemotronH causal LM with deterministic weights (see `init_weights`).

    Built on the meta device first, so nothing is allocated twice; `device="meta"` returns that
    description as is (a 30B model costs no memory). The router stays in float32 whatever `dtype`.
    """
    with torch.device("meta"):
        model = NemotronHForCausalLM(config)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.float()
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def _routed_expert_numel(model: nn.Module) -> int:
    return sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())


def count_parameters(config: NemotronHConfig) -> tuple[int, int]:
    """(total, active per token) parameters, counted on the model built on the meta device.

    Active is everything a token touches: every parameter but, in each MoE layer, the routed
    experts it is not sent to (all but `num_experts_per_tok` of `n_routed_experts`, equal in size).
    """
    model = build_model(config, device="meta")
    total = sum(p.numel() for p in model.parameters())
    idle = config.n_routed_experts - config.num_experts_per_tok
    return total, total - _routed_expert_numel(model) * idle // config.n_routed_experts


def routed_expert_parameters(config: NemotronHConfig) -> int:
    """Parameters of every MoE layer's routed experts, all of them, counted on the meta-device model."""
    return _routed_expert_numel(build_model(config, device="meta"))
