"""NemotronH in plain PyTorch: config and presets, the model, deterministic building."""

from .config import PRESETS, NemotronHConfig, get_preset
from .loss import cross_entropy_loss, linear_cross_entropy
from .nemotron_h import NemotronHForCausalLM, build_model, count_parameters, routed_expert_parameters

__all__ = ["NemotronHConfig", "get_preset", "PRESETS", "build_model", "NemotronHForCausalLM", "count_parameters",
           "routed_expert_parameters", "cross_entropy_loss", "linear_cross_entropy"]
