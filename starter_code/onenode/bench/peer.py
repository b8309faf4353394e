"""The peer a student would try first: transformers' own NemotronH, with this kit's weights, behind
this kit's call."""

from __future__ import annotations

import torch

from ..model import cross_entropy_loss
from ..model.nemotron_h import CausalLMOutput


class TransformersPeer(torch.nn.Module):
    """A transformers causal LM behind this kit's call: `peer(input_ids, labels)` with the labels
    already shifted (transformers would shift them again), the loss the kit's plain one over the
    model's logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        logits = self.model(input_ids).logits
        return CausalLMOutput(logits=logits, loss=None if labels is None else cross_entropy_loss(logits, labels))


def build_transformers_peer(model: torch.nn.Module, experts_implementation: str) -> TransformersPeer:
    """transformers' own `NemotronHForCausalLM` with the same config and the same weights.

    This is the peer a student would try first; its MoE runs `experts_implementation`
    (`grouped_mm` by default in transformers, `eager` for the per-expert loop).
    """
    try:
        import transformers
    except ImportError:
        raise SystemExit("--impl transformers needs transformers >= 5.3: pip install 'transformers>=5.3'") from None
    from ..model.hf_io import adapt_state_dict

    device = next(model.parameters()).device
    hf_config = transformers.NemotronHConfig(
        **model.config.to_hf_dict() | {"use_cache": False},  # training: no inference cache
        experts_implementation=experts_implementation, attn_implementation="sdpa")
    with torch.device(device):
        peer = transformers.NemotronHForCausalLM(hf_config)
    peer.load_state_dict(adapt_state_dict(model.state_dict(), peer), strict=True)
    return TransformersPeer(peer)
