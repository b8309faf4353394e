"""Parallelism applied from outside to a plain model (torchtitan style).

    dims = ParallelDims(dp=4, ep=2)           # under torchrun with 4 processes
    model = parallelize(model, dims)          # expert parallelism, then FSDP2; in place

`parallelize` builds the (pp, dp_mod_ep, ep) device mesh (see `mesh.py`); a caller that needs the
mesh itself builds it with `dims.build_mesh(device_type)` and passes it in.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .expert_parallel import apply_expert_parallel
from .fsdp import apply_fsdp
from .mesh import ParallelDims, dp_mesh

__all__ = ["ParallelDims", "dp_mesh", "parallelize", "shard_data_parallel", "apply_expert_parallel", "apply_fsdp"]

logger = logging.getLogger(__name__)


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def shard_data_parallel(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, *,
                        param_dtype: torch.dtype | None = None) -> nn.Module:
    """Expert parallelism over mesh["ep"], then FSDP over `dp_mesh(mesh)`: a model or a pipeline stage."""
    expert_layers = []
    if dims.ep > 1:
        logger.info("expert parallelism on: ep=%d, dp=%d", dims.ep, dims.dp)
        expert_layers = apply_expert_parallel(model, mesh["ep"])
    if dims.dp > 1:
        apply_fsdp(model, dp_mesh(mesh), expert_layers=expert_layers, expert_mesh=mesh["dp_mod_ep"],
                   param_dtype=param_dtype)
    if expert_layers:
        # The experts' gradients differ across the EP group: the global gradient norm sums them there.
        model.expert_grad_norm_group = (mesh["dp_mod_ep"], mesh["ep"].get_group())
    return model


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None = None, *,
                param_dtype: torch.dtype | None = None, **pipeline_options) -> nn.Module:
    """`model` laid out as `dims` over the initialised process group; the unchanged model when
    the layout is a single process. With pp > 1 the result is a pipeline runner, and
    `pipeline_options` (schedule, microbatches, ...) go to `pipeline.pipeline_parallelize`."""
    if pipeline_options and dims.pp == 1:
        raise ValueError(f"pipeline options {sorted(pipeline_options)} need pp > 1: drop them or set pp")
    if dims.world_size == 1:
        return model
    mesh = mesh if mesh is not None else dims.build_mesh(_device_type(model))
    if dims.pp > 1:
        from .pipeline import pipeline_parallelize

        return pipeline_parallelize(model, dims, mesh, param_dtype=param_dtype, **pipeline_options)
    return shard_data_parallel(model, dims, mesh, param_dtype=param_dtype)
