"""What is applied to every layer before the model is sharded (torchtitan's order: activation
checkpointing, then compile, then expert parallelism and FSDP)."""

from __future__ import annotations

from torch import nn


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each layer's activations in backward instead of storing them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.backbone.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_compile(model: nn.Module, mode: str) -> None:
    """`torch.compile` per layer, as torchtitan does (one small graph per block, reused).

    "mixers" compiles every Mamba2, attention and dense MLP mixer and leaves MoE mixers eager:
    the routed experts have data-dependent shapes (tokens per expert), and the starter's
    per-expert loop would unroll into one graph break per expert. "blocks" compiles every block,
    MoE included: for an MoE whose routed path is compile-friendly.
    """
    for layer in model.backbone.layers:
        if mode == "blocks":
            layer.compile()
        elif getattr(layer, "kind", None) != "moe":
            layer.mixer.compile()
