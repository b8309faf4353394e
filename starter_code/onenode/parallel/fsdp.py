"""FSDP2 (`fully_shard`) applied per layer, then to the root, torchtitan style.

Experts that expert parallelism made local are sharded on their own first, over the ranks that
hold the same experts ("dp_mod_ep"), so the layer's FSDP group leaves them out. Their gradients
are divided by the whole dp size: each one already sums the contributions of the EP group
(the all_to_all backward brings them), and FSDP sums the rest, so the result is the mean over
every data-parallel rank, like the dense parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def _layers(model: nn.Module) -> list[nn.Module]:
    backbone = getattr(model, "backbone", None)
    layers = getattr(backbone, "layers", None)
    return list(layers.children()) if layers is not None else []


def _shard_other_dtypes(layer: nn.Module, mesh: DeviceMesh, options: dict) -> None:
    """FSDP2 gathers a unit's parameters into one buffer of one dtype: a module whose parameters
    are all of another dtype than the layer's bulk (the float32 router of a bfloat16 model) gets
    a unit of its own first."""
    sizes: dict[torch.dtype, int] = {}
    for param in layer.parameters():
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    if len(sizes) < 2:
        return
    bulk = max(sizes, key=sizes.get)
    for module in layer.modules():
        own = list(module.parameters(recurse=False))
        if own and all(param.dtype != bulk for param in own):
            fully_shard(module, mesh=mesh, **options)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    expert_layers: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `model` in place over `dp_mesh`; the local experts of `expert_layers` over `expert_mesh`."""
    options = dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        reshard_after_forward=reshard_after_forward,
    )
    for layer in expert_layers:
        experts = layer.experts
        # A ModuleList has no forward of its own to hook: shard each expert it holds.
        for unit in experts if isinstance(experts, nn.ModuleList) else [experts]:
            fully_shard(unit, mesh=expert_mesh, **options)
            unit.set_gradient_divide_factor(float(dp_mesh.size()))
            if expert_mesh.size() > 1:  # sum, then divide: gloo has no PREMUL_SUM (one rank just divides)
                unit.set_force_sum_reduction_for_comms(True)
    for layer in _layers(model):
        _shard_other_dtypes(layer, dp_mesh, options)
        fully_shard(layer, mesh=dp_mesh, **options)
    # The root (embeddings, norm_f, lm_head) is needed again as soon as the forward ends.
    fully_shard(model, mesh=dp_mesh, **(options | {"reshard_after_forward": False}))
    return model
