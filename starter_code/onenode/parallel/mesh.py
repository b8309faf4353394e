"""The parallel layout: `ParallelDims(dp, ep, pp)` and the device mesh it describes.

torchtitan's convention: expert parallelism borrows ranks from data parallelism. The world is
`pp * dp` ranks; the `dp` ranks of a pipeline stage split into `dp // ep` groups of `ep`
consecutive ranks. Dense parameters are sharded (FSDP) over all `dp` ranks; the routed experts
are split over `ep` (each rank holds E / ep of them) and sharded over the remaining `dp // ep`.

Mesh dimensions, slowest to fastest: "pp", "dp_mod_ep", "ep"; `dp_mesh(mesh)` is ("dp_mod_ep",
"ep") flattened. A rank's coordinates are therefore `rank = pp_index * dp + dp_index`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_mod_ep", "ep")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1  # data parallel degree (FSDP), per pipeline stage
    ep: int = 1  # expert parallel degree: a divisor of dp
    pp: int = 1  # pipeline stages

    def __post_init__(self):
        for name in ("dp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims: {name}={value!r}, use a positive integer")
        if self.dp % self.ep:
            raise ValueError(
                f"ParallelDims: ep={self.ep} must divide dp={self.dp} (expert parallelism borrows data-parallel ranks)"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def dp_mod_ep(self) -> int:
        """How many ranks hold the same experts: their expert shards are sharded again over these."""
        return self.dp // self.ep

    @classmethod
    def for_world(cls, world_size: int, ep: int = 1, pp: int = 1) -> ParallelDims:
        """The layout that uses every rank for data parallelism except those `pp` takes."""
        if world_size % pp:
            raise ValueError(f"ParallelDims: pp={pp} must divide the world size {world_size}")
        return cls(dp=world_size // pp, ep=ep, pp=pp)

    def build_mesh(self, device_type: str = "cuda") -> DeviceMesh:
        """The (pp, dp_mod_ep, ep) mesh over the initialised process group."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh: torch.distributed is not initialised: launch with torchrun")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"{self} needs {self.world_size} processes (dp * pp), the job has {dist.get_world_size()}: "
                f"change dp/pp or the number of processes"
            )
        return init_device_mesh(device_type, (self.pp, self.dp_mod_ep, self.ep), mesh_dim_names=MESH_DIMS)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel ranks of this rank's pipeline stage, as one dimension named "dp"."""
    return mesh["dp_mod_ep", "ep"]._flatten("dp")
