"""Parallelism applied from outside to a plain model (torchtitan style).

    dims = ParallelDims(dp=4, ep=2)           # under torchrun with 4 processes
    parallel = parallelize(model, dims)       # expert parallelism, then FSDP2; in place
    train_step(parallel, optimizer, input_ids, labels)

`parallelize` is the one place that lays a model out for training, in one order: each layer
compiled, then activation-checkpointed (`compile_and_checkpoint.py` says why in that order), then
expert parallelism, pipeline stages and FSDP. It builds the (pp, dp_mod_ep, ep) device mesh (see
`mesh.py`) and returns a `ParallelModel`: what this rank holds and the meshes its training step
reduces over. The model itself carries no parallel state. Training runs get here through
`onenode.train.assembly.assemble`, which reads all of it from a Recipe.

Precision is decided here too, with the same numbers on one GPU and on many: with
`param_dtype=bf16` the parameters stay float32 (the master copy the optimizer updates) and each
layer computes on bf16 copies made once per step, its gradients added up in float32. Over several
ranks FSDP2 gathers those copies (`fsdp.py`); one process keeps them at fixed addresses with no FSDP
(`mixed_precision.py`: no gather or reduce copies, and CUDA graphs can replay). No
training step runs under autocast.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..model.loss import cross_entropy_loss
from .compile_and_checkpoint import prepare_layers, uses_cuda_graphs
from .expert_parallel import apply_expert_parallel
from .fsdp import apply_fsdp
from .mesh import ParallelDims, dp_mesh
from .mixed_precision import MasterWeights, apply_mixed_precision
from .pipeline import PipelineRunner, build_pipeline

__all__ = ["ParallelDims", "ParallelModel", "dp_mesh", "parallelize", "apply_expert_and_data_parallel",
           "apply_expert_parallel", "apply_fsdp", "uses_cuda_graphs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelModel:
    """A model laid out over the process group: what this rank holds, and the meshes the training
    step needs (None where the layout has no such dimension).

    With pp = 1 `model` is the whole model, sharded in place; with pp > 1 `pipeline` holds this
    rank's stages and their schedule instead. `pp_mesh`: each rank holds other parameters, so
    gradient norms add up over it. `ep_mesh` is set only when the routed experts are split over it:
    each rank holds other experts, so their gradient norms add up there. `dp_mesh`: the ranks that
    see different data (loss means, router loads, data shards). `master_weights`: one process in
    bf16, the float32 masters' copies (`mixed_precision.py`), which the training step's fused update
    writes. Its parameters and modules iterate like a model's, for optimizers, load balancing and
    checks.
    """

    model: nn.Module | None = None
    pipeline: PipelineRunner | None = None
    dp_mesh: DeviceMesh | None = None
    pp_mesh: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None
    master_weights: MasterWeights | None = None

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's modules: its pipeline stages, or the whole model as the one stage."""
        return self.pipeline.stage_modules if self.pipeline is not None else [self.model]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for module in self.stage_modules:
            yield from module.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        for module in self.stage_modules:
            yield from module.named_modules()


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def _mixed_precision(param_dtype: torch.dtype | None) -> bool:
    return param_dtype is not None and param_dtype != torch.float32


def apply_expert_and_data_parallel(module: nn.Module, dims: ParallelDims, mesh: DeviceMesh, *,
                        param_dtype: torch.dtype | None = None) -> bool:
    """Expert parallelism over mesh["ep"], then FSDP over `dp_mesh(mesh)` (also on one rank when
    `param_dtype` asks for mixed precision), in place: a model or a pipeline stage. True when
    expert parallelism split the routed experts of `module`."""
    expert_layers = []
    if dims.ep > 1:
        logger.info("expert parallelism on: ep=%d, dp=%d", dims.ep, dims.dp)
        expert_layers = apply_expert_parallel(module, mesh["ep"])
    if dims.dp > 1 or _mixed_precision(param_dtype):
        apply_fsdp(module, dp_mesh(mesh), expert_layers=expert_layers, expert_mesh=mesh["dp_mod_ep"],
                   param_dtype=param_dtype)
    return bool(expert_layers)


def parallelize(model: nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype | None = None,
                compile: str = "off", activation_checkpointing: bool = False, cuda_graphs: bool = False,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss,
                **pipeline_options) -> ParallelModel:
    """`model` laid out as `dims` over the process group, computing in `param_dtype` (None: as built).

    First each layer is prepared (`compile`: off, mixers or blocks; `activation_checkpointing`;
    `cuda_graphs`: the compiled layers replayed as CUDA graphs, one process on a GPU only). With
    pp > 1 the model is then split into pipeline stages over mesh["pp"], the last computing
    `loss_fn(logits, labels)`, and each stage is sharded over its dp ranks; `pipeline_options` go
    to `pipeline.build_pipeline` (schedule, microbatches: by default pp, ...). Over several ranks a
    bf16 `param_dtype` is FSDP's mixed-precision policy; one process casts with `mixed_precision.py`
    and joins no process group. One process in float32 keeps the model as it is.
    """
    if pipeline_options and dims.pp == 1:
        raise ValueError(f"pipeline options {sorted(pipeline_options)} need pp > 1: drop them or set pp")
    if cuda_graphs and (dims.world_size > 1 or _device_type(model) != "cuda"):
        raise ValueError("CUDA graphs replay compiled layers in one process on a GPU (under FSDP they would be "
                         "recorded again every step): turn them off, or run one process on a CUDA device")
    prepare_layers(model, compile=compile, activation_checkpointing=activation_checkpointing,
                   compile_mode="reduce-overhead" if cuda_graphs else None)
    if dims.world_size == 1:
        weights = apply_mixed_precision(model, param_dtype) if _mixed_precision(param_dtype) else None
        return ParallelModel(model, master_weights=weights)
    mesh = dims.build_mesh(_device_type(model))
    data_mesh = dp_mesh(mesh)
    if dims.pp == 1:
        experts_split = apply_expert_and_data_parallel(model, dims, mesh, param_dtype=param_dtype)
        return ParallelModel(model, dp_mesh=data_mesh, ep_mesh=mesh["ep"] if experts_split else None)

    experts_split = []

    def shard_stage(stage: nn.Module) -> nn.Module:
        experts_split.append(apply_expert_and_data_parallel(stage, dims, mesh, param_dtype=param_dtype))
        return stage

    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    microbatches = pipeline_options.pop("microbatches", None) or dims.pp
    pipeline = build_pipeline(model, mesh["pp"], microbatches=microbatches, device=device, loss_fn=loss_fn,
                              parallelize_fn=shard_stage, **pipeline_options)
    return ParallelModel(pipeline=pipeline, dp_mesh=data_mesh, pp_mesh=mesh["pp"],
                         ep_mesh=mesh["ep"] if any(experts_split) else None)
