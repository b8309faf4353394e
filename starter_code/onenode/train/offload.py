"""`optimizer.state: cpu`: AdamW's float32 masters and both moments in pinned host memory, the bf16
copies and their gradients on the GPU; each step streams the state through the GPU a chunk at a
time and updates it there with the kit's fused update.

On one H200 a model's size is bounded by what a parameter costs on the GPU: 16 bytes in bf16 with
AdamW (float32 master, two float32 moments, the bf16 copy) plus its bf16 gradient. Here the GPU
keeps the copy and its gradient, 4 bytes; the 12 bytes of state (8 with `optimizer.moments:
bfloat16`) live in host memory, page-locked in 1 GiB blocks (`HostMemory`; torch's pinned allocator
would round each tensor up to a power of two). `group6-7b` (7.0B parameters) needs 84 GB of it.

The step (`AdamWOffloaded.update_groups`), call by call (as `master_update.update_on` cuts each
group, each call cut again to at most `CHUNK_BYTES` of state): an upload stream copies the call's
masters, moments and step counts to the GPU, the compute stream runs the update on them (it also
writes the bf16 copies), a download stream copies them back. Chunk i+1's upload overlaps chunk i's
update and chunk i-1's download, host-to-device and device-to-host at once on their own copy
engines; the host waits for chunk i-2's download before it allocates chunk i, so at most two chunks
of state are on the GPU (the largest chunk is group6-7b's embedding or LM head: 2 GB).

Why the kit's own and not torchao's `CPUOffloadOptimizer` (torchao 0.18):
- torchao keeps each parameter on the GPU and a host copy of it, and steps the host copies with
  torch's CPU AdamW. The kit's parameters are the float32 masters (the bf16 copies are what the GPU
  computes with), so the masters would stay on the GPU (4 bytes a parameter: 28 GB of group6-7b)
  and their float32 gradients go to the host; here the GPU keeps only bf16.
- Its update is torch's AdamW after torch's clip, not the kit's fused step (the clip from the bf16
  gradients, AdamW and the bf16 copies written in one pass), so an offloaded run would not take a
  non-offloaded run's numbers. Here it does, bit for bit (the same `_adamw` on the same state
  objects), so checkpoints, resume and A2's replay read and continue it unchanged; torchao's state
  dict is an inner optimizer's over its host copies, which DCP's `get_state_dict` cannot name by
  the model's parameters.
- It is not on the GPU image; this needs nothing but torch.
What it costs: the host link carries the state, 12 bytes a parameter each way a step (8 with
bfloat16 moments, about 6 with int8's codes and block scales, streamed alike), where torchao moves a
gradient down and a parameter up (4 bytes each way) and does the arithmetic on the host. On a
GH200's NVLink-C2C (about 450 GB/s each way) the state of group6-7b moves in about 0.2 s; on an
H200's PCIe Gen5 (about 55 GB/s each way) in about 1.5 s, overlapped with the update only (the clip
needs every gradient first), where torchao's transfers take about 0.5 s and overlap the backward,
and its host step reads and writes 28 bytes a parameter (torch's fused CPU AdamW: 0.8 G parameters a
second on one core of the machine this was written on, so about 9 core-seconds for 7B, bound by the
host's memory bandwidth across cores). Which is faster on an H200 host is for its record
(benchmarks/README.md) to say.

On a CPU the device is the CPU: the masters stay where they are, and the same loop copies each
chunk's state to new tensors and back, plainly and without streams, which is what the tests run.
"""

from __future__ import annotations

import contextlib

import torch

from ..parallel.mixed_precision import MasterWeights
from .master_update import AdamWCompactMoments, cut, graphs_allowed, run_call, update_on

CHUNK_BYTES = 1 << 29  # 512 MiB: a chunk's state at most, unless one parameter alone holds more
# Pinned host memory in blocks of 1 GiB, each tensor a slice of one: torch's pinned allocator rounds
# every allocation up to a power of two (up to twice the state's bytes), a block it rounds nothing off
BLOCK_BYTES = 1 << 30
ALIGN = 512  # bytes: each slice starts aligned, as an allocation would


class HostMemory:
    """Host tensors for the masters and the state: on a GPU machine page-locked (copies to and from
    the GPU that do not wait, on their own copy engines), carved out of `BLOCK_BYTES` blocks; on a
    CPU plain tensors. A slice is never given back: the state is made once and loaded in place."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.blocks: list[list] = []  # [block, bytes used]

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of `tensor`."""
        return self.empty_like(tensor).copy_(tensor)

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if not self.pinned or nbytes > BLOCK_BYTES:
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pinned)
        block = next((b for b in self.blocks if b[1] + nbytes <= BLOCK_BYTES), None)
        if block is None:
            block = [torch.empty(BLOCK_BYTES, dtype=torch.uint8, pin_memory=True), 0]
            self.blocks.append(block)
        start = block[1]
        block[1] += -(-nbytes // ALIGN) * ALIGN
        return block[0][start:start + nbytes].view(tensor.dtype).view(tensor.shape)


def offload_masters(weights: MasterWeights) -> torch.device:
    """Move every float32 master that has a bf16 copy into host memory (`HostMemory`), in place
    (the same Parameter objects: the optimizer, state dicts and hooks keep them); returns the copies'
    device, where the step computes. On a CPU nothing moves."""
    device = next(iter(weights.copy_of.values())).device
    host = HostMemory(pinned=device.type == "cuda")
    masters = {id(master): master for unit in weights.units for master in unit.masters}
    for master in masters.values():
        if master.device.type != "cpu":
            master.data = host.copy_of(master.detach())
    return device


class AdamWOffloaded(AdamWCompactMoments):
    """AdamW on parameters in host memory, its state there too (`HostMemory`: pinned when `device`
    is a GPU), stepped on `device` a chunk at a time (see the module docstring). Its moments are
    float32 or `moments_dtype`; its numbers are `AdamWCompactMoments`' (torch's AdamW for float32
    moments). Parameters on a GPU (none, from `offload_masters`) keep their state there."""

    def __init__(self, params, device: torch.device | str, moments_dtype: torch.dtype = torch.float32, **options):
        super().__init__(params, moments_dtype=moments_dtype, on_device=False, **options)
        self.device = torch.device(device)
        self.host = HostMemory(pinned=self.device.type == "cuda")
        self._copy_streams = None

    def place_state(self, state: dict) -> None:
        """A parameter's new host state tensors moved into `self.host` (pinned on a GPU machine)."""
        if self.host.pinned:
            for key, value in state.items():
                if value.device.type == "cpu" and not value.is_pinned():
                    state[key] = self.host.copy_of(value)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (each state tensor cast to its parameter's dtype and device, then the moments
        back to theirs by `AdamWCompactMoments`' hook), each tensor copied into the one it replaces,
        where there was one: a resumed run holds its state in the memory it had, pinned, not twice."""
        held = {param: dict(state) for param, state in self.state.items()}
        super().load_state_dict(state_dict)
        for param, state in self.state.items():  # the moments' dtypes already back (`_cast_loaded_moments`)
            for key, value in state.items():
                old = held.get(param, {}).get(key)
                if old is not None and (old.shape, old.dtype, old.device) == (value.shape, value.dtype, value.device):
                    state[key] = old.copy_(value)
            self.place_state(state)

    def update_groups(self, groups: list[tuple], coef: torch.Tensor, update=None) -> None:
        """`master_update.apply_update` with each call's host tensors copied to the device and back."""
        cuda = self.device.type == "cuda"
        calls = [piece for call in cut(groups, update or update_on(self.device)) for piece in _bounded(call)]
        if not calls:
            return
        compute = torch.cuda.current_stream(self.device) if cuda else None
        if cuda and self._copy_streams is None:
            self._copy_streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        uploads, downloads = self._copy_streams if cuda else (None, None)
        if cuda:  # the host state is written on the GPU by the downloads alone: the first uploads overlap the backward
            uploads.wait_stream(downloads)
        coef = coef.to(self.device)
        downloaded = []  # per chunk: the event after its download (GPU)
        with graphs_allowed(calls):
            for index, (run, members, _, lr, hyper) in enumerate(calls):
                if cuda and index >= 2:  # chunk index-2's staging freed: two chunks on the GPU at most
                    downloaded[index - 2].synchronize()
                with _on(uploads):
                    staged, back = _upload(members, self.device, cuda, streams=(compute, downloads))
                    if cuda:
                        compute.wait_stream(uploads)
                run_call(run, staged, lr.to(self.device), coef, hyper)
                with _on(downloads):
                    if cuda:
                        downloads.wait_stream(compute)
                    for host, device_tensor in back:
                        host.copy_(device_tensor, non_blocking=cuda)
                    if cuda:
                        downloaded.append(downloads.record_event())
        if cuda:  # what follows the step (the next forward, a checkpoint) sees the state written back
            compute.wait_stream(downloads)


def _on(stream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _state_bytes(member) -> int:
    param, _, state, _ = member
    return sum(t.numel() * t.element_size() for t in (param, state["exp_avg"], state["exp_avg_sq"]))


def _bounded(call: tuple) -> list[tuple]:
    """A call cut into calls of at most `CHUNK_BYTES` of state each (one parameter at least)."""
    run, members, signatures, lr, hyper = call
    pieces, start, size = [], 0, 0
    for i, member in enumerate(members):
        if i > start and size + _state_bytes(member) > CHUNK_BYTES:
            pieces.append((run, members[start:i], signatures[start:i], lr, hyper))
            start, size = i, 0
        size += _state_bytes(member)
    pieces.append((run, members[start:], signatures[start:], lr, hyper))
    return pieces


def _upload(members: list, device: torch.device, cuda: bool, streams: tuple) -> tuple[list, list]:
    """The call's members (param, grad, state, copy) with their tensors on `device` (a host tensor
    copied to a new one, even where the device is the CPU; a GPU tensor itself), and the (host,
    device) pairs the update writes, to copy back. On a GPU a new tensor is recorded on `streams`
    (compute, downloads), which use it after the upload stream that made it."""
    back = []

    def staged(tensor: torch.Tensor, written: bool) -> torch.Tensor:
        if tensor.device.type != "cpu":
            return tensor
        on_device = torch.empty_like(tensor, device=device)
        on_device.copy_(tensor, non_blocking=cuda)
        if cuda:
            for stream in streams:
                on_device.record_stream(stream)
        if written:
            back.append((tensor, on_device))
        return on_device

    # the state: moments, step count, int8 scales
    return [(staged(param, True), staged(grad, False), {key: staged(value, True) for key, value in state.items()}, copy)
            for param, grad, state, copy in members], back
