"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) through torchft: replica groups that train apart
and meet every H steps (`parallel.diloco` in a recipe; `pip install 'onenode[diloco]'`).

Each replica group is a job of its own (one process, or a torchrun world whose ranks shard the model
with FSDP as usual) and trains on its own slice of the data with the kit's step: the inner optimizer
(AdamW) on its own gradients, nothing reduced between the groups. After every H-th step torchft's
`DiLoCo` takes the outer step: it all-reduces the pseudo-gradient (the parameters at the last sync
minus the parameters now, averaged over the groups), puts the last sync's parameters back and steps
them with the outer optimizer, Nesterov SGD (the paper: lr 0.7, momentum 0.9). The parameters it
steps are the float32 masters (one process's, or FSDP's shards), so the outer step is float32 whatever
the compute precision. Every group then holds the same model. A sync moves the parameters' bytes once
(float32); DDP moves as many every step.

Why torchft: its `Manager` gives the groups a quorum through a lighthouse (`torchft_lighthouse
--min_replicas R`), so a group that dies is waited for at the next sync and rejoins (from its own
checkpoint, the kit's; a group behind the others is healed from a live one's state), which a static
torch.distributed world cannot do. It runs here on CPUs with gloo (torchft 0.2.0, torch 2.13).

What the kit adds around it:
- torchft counts inner steps, and syncs, in step hooks of the inner optimizer; the kit's fused update
  (`train/master_update.py`) calls no optimizer's `step`, so DiLoCo hooks `_InnerSteps`, whose step
  runs the kit's whole step (update and balancing);
- the routers' balancing biases are buffers, not parameters: averaged over the groups at each sync,
  so every group holds the same model;
- one process in bf16 casts its masters into copies once per step: a sync wrote the masters, so the
  next forward refreshes the copies (the version check sees the outer SGD's writes; torch's fused
  kernels on CUDA count none, so the sync marks them itself);
- what a checkpoint (at a sync) needs besides the model and the inner optimizer: the outer momentum
  and torchft's step count (`state_dict`). torchft's DiLoCo is made at the first step, so that it
  takes its copy of the last sync's parameters from what a resumed run loaded.

Launch: one job per group, each with REPLICA_GROUP_ID=r (0 .. R-1) and TORCHFT_LIGHTHOUSE=http://HOST:PORT
of one running lighthouse (across nodes, one group per node: cluster/train_diloco.sh, which starts the
lighthouse on group 0's node; tests/test_diloco_launch.py). Composes with one process per group
(tested: tests/test_diloco.py, float32 and bf16). FSDP or expert parallelism within a group should
compose as torchft means it to (each rank all-reduces its own shards with the same rank of the other
groups, so every group needs the same layout; a group's ranks find each other through torchrun's
store), untested here. Pipeline stages do not (the recipe refuses pp > 1).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
from torch.distributed.tensor import DTensor

from . import ParallelModel

REPLICA_ENV = "REPLICA_GROUP_ID"  # torchft's launcher's name for it
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# How long the groups wait at a sync for one that is missing (torchft's advice for DiLoCo: about an hour;
# a dead group restarts from its checkpoint in that time). TORCHFT_QUORUM_TIMEOUT_SEC overrides it.
QUORUM_TIMEOUT = timedelta(hours=1)


def replica_group(replicas: int) -> int:
    """This job's replica group, from REPLICA_GROUP_ID (and a lighthouse to meet the others at); a
    ValueError of one line that says how to launch when either is missing."""
    text = os.environ.get(REPLICA_ENV, "")
    if not text.isdigit() or int(text) >= replicas or not os.environ.get(LIGHTHOUSE_ENV):
        raise ValueError(f"parallel.diloco with {replicas} replica groups: launch each group's job with "
                         f"{REPLICA_ENV}=0..{replicas - 1} and {LIGHTHOUSE_ENV}=http://HOST:PORT of a running "
                         f"`torchft_lighthouse --min_replicas {replicas}` ({REPLICA_ENV}={text or 'unset'}, "
                         f"{LIGHTHOUSE_ENV}={os.environ.get(LIGHTHOUSE_ENV) or 'unset'})")
    return int(text)


def store_host(addr: str) -> str:
    """The host the other groups reach this group's store at (torchft hands the first group's to every
    group, whose gloo/NCCL group over the replicas meets there): torchrun on one node and a process
    on its own name theirs localhost, which on another node is that node, so this machine's name
    (what torchft advertises its manager at) stands in for it. The store listens on every address.
    A machine that cannot resolve its own name keeps localhost: only groups on it can meet."""
    if addr not in ("localhost", "127.0.0.1", "::1"):
        return addr
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return addr
    return host


def outer_optimizer(params: Iterable[torch.Tensor], outer_lr: float, outer_momentum: float) -> torch.optim.SGD:
    """DiLoCo's outer optimizer over `params`: Nesterov SGD (plain SGD without momentum)."""
    return torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)


def outer_momentum(optimizer: torch.optim.SGD, named_params: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """The outer momentum by parameter name (this rank's shards), as a checkpoint keeps it."""
    momentum = {}
    for name, param in named_params:
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        if buffer is not None:
            momentum[name] = buffer.to_local() if isinstance(buffer, DTensor) else buffer
    return momentum


def load_outer_momentum(optimizer: torch.optim.SGD, named_params: Iterable[tuple[str, torch.Tensor]],
                        momentum: dict) -> None:
    """The outer momentum a checkpoint keeps (`outer_momentum`), into `optimizer`."""
    for name, param in named_params:
        buffer = momentum.get(name)
        if buffer is None:
            continue
        buffer = buffer.to(param.device)
        if isinstance(param, DTensor):
            buffer = DTensor.from_local(buffer, param.device_mesh, param.placements, shape=param.shape,
                                        stride=param.stride())
        optimizer.state[param]["momentum_buffer"] = buffer


@torch.no_grad()
def outer_step(optimizer: torch.optim.SGD, params: dict[str, torch.Tensor], synced: dict[str, torch.Tensor],
               trained: list[dict[str, torch.Tensor]]) -> None:
    """The sync torchft's `DiLoCo` takes, by hand for one process that holds every group's result (the
    replay of a DiLoCo run, `verify/diloco_replay.py`): the pseudo-gradient (`synced`, the parameters
    at the last sync, minus each group's `trained` ones) summed in group order and divided by the
    groups, the parameters put back at `synced`, and `optimizer`'s step on it."""
    for name, param in params.items():
        mean = synced[name] - trained[0][name]
        for group in trained[1:]:
            mean += synced[name] - group[name]
        mean /= len(trained)
        param.copy_(synced[name])
        param.grad = mean
    optimizer.step()
    optimizer.zero_grad()


class _InnerSteps(torch.optim.Optimizer):
    """What torchft's DiLoCo hooks: each `step(closure)` is one inner step of the kit, run by the closure
    between the step hooks (torchft's pre-hook holds back its state transfers while the weights change;
    its post-hook counts the step and syncs)."""

    def __init__(self):
        super().__init__([torch.zeros(1, requires_grad=True)], {})

    def step(self, closure: Callable[[], dict]) -> dict:
        return closure()


class ReplicaGroups:
    """This group's part in a DiLoCo run: torchft's Manager (the quorum, the all-reduce over groups),
    the outer optimizer over this rank's parameters, and the step that syncs every `inner_steps`.

    `state_dict` / `load_state_dict` give torchft the model and inner optimizer, for healing a group
    that comes back behind the others; `buffers` are averaged over the groups at each sync."""

    def __init__(self, parallel: ParallelModel, *, replicas: int, replica: int, inner_steps: int, outer_lr: float,
                 outer_momentum: float, rank: int, world: int, state_dict: Callable[[], dict],
                 load_state_dict: Callable[[dict], None], buffers: Iterable[torch.Tensor] = ()):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.parallel, self.replicas, self.replica, self.inner_steps = parallel, replicas, replica, inner_steps
        self.buffers = list(buffers)
        params = list(parallel.parameters())
        self.outer_optimizer = outer_optimizer(params, outer_lr, outer_momentum)
        self.steps = 0  # inner steps this process has taken (or resumed at)
        self._clock = _InnerSteps()
        self._diloco = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # torchrun's store for this group
            self._store = None
            store_addr, store_port = store_host(os.environ["MASTER_ADDR"]), int(os.environ["MASTER_PORT"])
        else:  # one process on its own: a store of its own
            self._store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = store_host("localhost"), self._store.port
        on_gpu = params[0].device.type == "cuda"
        pg = ProcessGroupNCCL() if on_gpu else ProcessGroupGloo()
        self.manager = Manager(pg=pg, min_replica_size=replicas, use_async_quorum=False, init_sync=False,
                               load_state_dict=load_state_dict, state_dict=state_dict, replica_id=str(replica),
                               rank=rank, world_size=world, store_addr=store_addr, store_port=store_port,
                               quorum_timeout=QUORUM_TIMEOUT)

    def step(self, inner_step: Callable[[], dict]) -> dict:
        """One inner step (`inner_step` runs it); on every `inner_steps`-th, the sync after it."""
        if self._diloco is None:
            from torchft.local_sgd import DiLoCo

            self._diloco = DiLoCo(self.manager, list(self.parallel.stage_modules), self._clock, self.outer_optimizer,
                                  sync_every=self.inner_steps).__enter__()
        out = self._clock.step(inner_step)
        self.steps += 1
        if self.steps % self.inner_steps == 0:
            self._synced()
        return out

    @torch.no_grad()
    def _synced(self) -> None:
        """After torchft's outer step: the buffers averaged, one process's bf16 copies refreshed."""
        works = [self.manager.allreduce(buffer) for buffer in self.buffers]
        for work in works:
            work.wait()
        if self.parallel.master_weights is not None:
            self.parallel.master_weights.masters_changed()

    def sum_over_groups(self, value: float) -> float:
        """`value` summed over the replica groups (every group calls it at the same point, after a sync)."""
        total = torch.tensor([value], dtype=torch.float64)
        self.manager.allreduce(total, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return float(total.item())

    def state_dict(self) -> dict:
        """What a checkpoint at a sync keeps besides the model and the inner optimizer: the outer momentum
        (this rank's shards) and torchft's step count. At a sync the last sync's parameters are the model's."""
        if self.steps % self.inner_steps:
            raise ValueError(f"DiLoCo checkpoints fall on syncs: step {self.steps} is not a multiple of "
                             f"parallel.diloco.inner_steps {self.inner_steps}")
        momentum = outer_momentum(self.outer_optimizer, self.parallel.named_parameters())
        return {"outer_momentum": momentum, "manager": self.manager.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the sync a checkpoint was taken at (before the first step)."""
        if self._diloco is not None:
            raise RuntimeError("ReplicaGroups.load_state_dict: load before the first step")
        load_outer_momentum(self.outer_optimizer, self.parallel.named_parameters(), state["outer_momentum"])
        self.manager.load_state_dict(state["manager"])
        self.steps = state["steps"]

    def close(self) -> None:
        """Leave the quorum (the other groups have synced for the last time)."""
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
