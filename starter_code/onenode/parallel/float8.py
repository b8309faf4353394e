"""Float8 training of chosen linear layers (`train.float8`), with torchao's `Float8Linear`.

Each chosen `nn.Linear` becomes a `Float8Linear` with torchao's rowwise recipe: its input, weight
and output gradient are cast to float8 (e4m3) with one scale per row, computed from the tensor
itself every step (no history to carry or checkpoint), and the three matmuls of forward and backward
run on Hopper's float8 tensor cores (`torch._scaled_mm`), the result in bf16. Everything else stays
as the kit has it: the float32 masters and their bf16 copies (`mixed_precision.py`, FSDP2), the
optimizer, the parameters' names and shapes, so checkpoints and exports do not change. It is applied
to the plain model, before compile and sharding, as torchtitan's float8 converter is.

The layers go by kind, so that each is kept only where it pays and the loss stays with bf16's
(`FLOAT8_KINDS`): the Mamba2 projections, attention's, the dense MLPs (shared experts and MLP
layers) and the routed experts where they are `nn.Linear`s (the starter's loop over experts; grouped
experts hold stacked weights that `Float8Linear` does not take). A layer whose sizes are not
multiples of 16 (float8 GEMMs need them) stays bf16 and is named in the summary. MFU still counts
against the bf16 peak: the FLOPs per token do not change.
"""

from __future__ import annotations

import logging

from torch import nn

from ..model.attention import Attention
from ..model.mamba2 import Mamba2Mixer
from ..model.mlp import MLP

FLOAT8_KINDS = ("mamba", "attention", "mlp", "experts")
MISSING = "train.float8 casts matmuls with torchao: pip install 'onenode[float8]' (or set train.float8: [])"


def _kind(name: str, owner: nn.Module) -> str | None:
    """The `FLOAT8_KINDS` entry of a linear layer owned by `owner` at `name`, None for the rest
    (the LM head, whose matmuls run inside the fused loss, and the routers)."""
    if isinstance(owner, Mamba2Mixer):
        return "mamba"
    if isinstance(owner, Attention):
        return "attention"
    if isinstance(owner, MLP):
        return "experts" if ".experts." in f".{name}." else "mlp"
    return None


def _torchao_float8():
    """torchao's float8 classes, imported without its warnings about the compiled kernels of its other
    recipes (which float8 training does not use) that a CPU, or a torch it was not built for, lacks."""
    quieted = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quieted]
    for log in quieted:
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        raise ImportError(MISSING) from None
    finally:
        for log, level in zip(quieted, levels):
            log.setLevel(level)
    return Float8Linear, Float8LinearConfig


def apply_float8(model: nn.Module, kinds: list[str]) -> dict[str, list[str]]:
    """Swap the `kinds` of `model`'s linear layers for torchao's rowwise `Float8Linear`, in place.
    Returns the names converted and those kept bf16 for their sizes, per kind."""
    unknown = sorted(set(kinds) - set(FLOAT8_KINDS))
    if unknown:
        raise ValueError(f"train.float8: {unknown} are not layer kinds; choose from {list(FLOAT8_KINDS)}")
    Float8Linear, Float8LinearConfig = _torchao_float8()
    config = Float8LinearConfig.from_recipe_name("rowwise")
    converted: dict[str, list[str]] = {}
    kept: dict[str, list[str]] = {}
    for owner_name, owner in list(model.named_modules()):
        for child_name, child in list(owner.named_children()):
            name = f"{owner_name}.{child_name}" if owner_name else child_name
            kind = _kind(name, owner) if type(child) is nn.Linear else None
            if kind not in kinds:
                continue
            if child.in_features % 16 or child.out_features % 16:
                kept.setdefault(kind, []).append(name)
                continue
            setattr(owner, child_name, Float8Linear.from_float(child, config=config))
            converted.setdefault(kind, []).append(name)
    return {"converted": converted, "kept_bf16": kept}


def summary(result: dict[str, dict[str, list[str]]]) -> str:
    """One line: how many layers of each kind run in float8, and which kept bf16 for their sizes."""
    parts = [f"{kind} {len(names)}" for kind, names in result["converted"].items()]
    line = "float8 (rowwise): " + (", ".join(parts) or "no layer") + " converted"
    kept = [f"{kind}: {len(names)} ({names[0].rsplit('.', 1)[-1]}...)" for kind, names in result["kept_bf16"].items()]
    return line + ("; kept bf16, sizes not multiples of 16: " + ", ".join(kept) if kept else "")
