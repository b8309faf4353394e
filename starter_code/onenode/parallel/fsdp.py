"""FSDP2 (`fully_shard`) applied per layer, then to the root, torchtitan style; also the kit's
mixed precision over several ranks (one process gets the same numbers from `mixed_precision.py`;
a pipeline stage alone on its dp mesh still gets FSDP on a mesh of one).

Parameters stay as built (float32: the master copy the optimizer updates). With `param_dtype`
(bf16) each unit's mixed-precision policy casts its parameters once when it gathers them for the
forward, and gradients are reduced in float32, so no layer needs autocast and no weight is cast at
every use. A unit on a mesh of one rank keeps its gathered parameters from forward to backward:
resharding there would free nothing worth having and cast them again.

Experts that expert parallelism made local are sharded on their own first, over the ranks that
hold the same experts ("dp_mod_ep"), so the layer's FSDP group leaves them out. Their gradients
are divided by the whole dp size: each one already sums the contributions of the EP group
(the all_to_all backward brings them), and FSDP sums the rest, so the result is the mean over
every data-parallel rank, like the dense parameters.

`UNITS` is how the parameters are grouped into units: the kit's grouping unless a benchmark sets
another (`benchmarks/step_probes.py one-unit`, `router-own-unit`) to time it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..model.moe import TopKRouter
from .mesh import ParallelDims, dp_mesh


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the first list of modules named `layers` (this kit's `backbone.layers`, a
    pipeline stage's, transformers' `model.layers`); none for a model without one."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return list(module.children())
    return []


def stores_mixed_dtypes(layer: nn.Module) -> bool:
    """Whether `layer` stores parameters of more than one dtype: routers are built float32, in a
    model built bf16 too (`build_model(dtype=...)`). FSDP2 wants one stored dtype per unit, so such
    a layer leaves its routers to units of their own. Under the kit's training precision (float32
    masters, a bf16 `param_dtype`) a layer is one dtype: its router is gathered bf16 with it and
    computes in float32 from that copy, as Megatron and torchtitan do. A unit of its own would put
    FSDP's hooks inside the compiled block, two graph breaks per MoE block."""
    return len({p.dtype for p in layer.parameters()}) > 1


@dataclass(frozen=True)
class Units:
    """How `apply_fsdp` groups a model's parameters into FSDP units."""

    per_layer: bool = True  # a unit per decoder layer, then the root; False: the whole model one unit
    routers_apart: bool = False  # every router a unit of its own, as stored; False: only where needed


UNITS = Units()  # the grouping `apply_fsdp` uses


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    expert_layers: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> nn.Module:
    """Shard `model` in place over `dp_mesh`, the local experts of `expert_layers` over
    `expert_mesh`; each unit gathers its parameters as `param_dtype` (None: as stored)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    as_stored = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)

    def shard(module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy = policy,
              reshard_after_forward: bool | None = None) -> None:
        if reshard_after_forward is None:
            reshard_after_forward = mesh.size() > 1
        fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)

    for layer in expert_layers:
        experts = layer.experts
        # A ModuleList has no forward of its own to hook: shard each expert it holds.
        for unit in experts if isinstance(experts, nn.ModuleList) else [experts]:
            shard(unit, expert_mesh)
            unit.set_gradient_divide_factor(float(dp_mesh.size()))
            if expert_mesh.size() > 1:  # sum, then divide: gloo has no PREMUL_SUM (one rank just divides)
                unit.set_force_sum_reduction_for_comms(True)
    for layer in decoder_layers(model) if UNITS.per_layer else []:
        if UNITS.routers_apart or stores_mixed_dtypes(layer):
            for module in layer.modules():
                if isinstance(module, TopKRouter):
                    shard(module, dp_mesh, as_stored)
        shard(layer, dp_mesh)
    # The root (embeddings, norm_f, lm_head) is needed again as soon as the forward ends.
    shard(model, dp_mesh, reshard_after_forward=False)
    return model


def apply_fsdp_on_one_rank(model: nn.Module, param_dtype: torch.dtype | None) -> DeviceMesh:
    """`apply_fsdp` over a process group of this process alone (joined here unless one exists):
    the layout several ranks get, where one process can test it or time it against
    `mixed_precision.py` (`benchmarks/step_probes.py fsdp-one-rank`). Returns the dp mesh."""
    device_type = next(model.parameters()).device.type
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = dp_mesh(ParallelDims().build_mesh(device_type))
    apply_fsdp(model, mesh, param_dtype=param_dtype)
    return mesh
