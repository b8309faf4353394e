"""Mixed precision in one process, without FSDP: the numbers of FSDP2's mixed precision on a mesh of
one rank (`fsdp.py`), without its gather and reduce copies; its hooks only swap tensors.

The module's parameters are the float32 masters whenever no forward runs: the optimizer, state dicts
and checkpoints see only them. Each layer, and the root for what no layer holds, is a unit, as in
FSDP: around its forward the unit swaps in `param_dtype` copies of its parameters, refreshed from
the masters when these have changed (an optimizer step, a loaded checkpoint) and kept at fixed
addresses, which CUDA graphs need. An activation-checkpointed layer recomputes on them too (the hooks
sit on the layer inside the checkpoint). As backward produces each copy's gradient it is added to
its master's in float32 and freed, as FSDP reduces in float32 (`train/master_update.py` then
updates the masters from those and writes the copies in one pass); or, for a step of one
micro-batch, left on the copy, where that pass reads it in bf16 (`MasterWeights.defer_grads`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..model.moe import TopKRouter
from .fsdp import decoder_layers, stores_mixed_dtypes


def _add_grad_to(master: nn.Parameter, weights: MasterWeights):
    """The hook that moves a copy's gradient into its master's, in the master's dtype; while
    `weights.defer_grads` is set it leaves the gradient on the copy, for a fused update to read."""
    def add(copy: torch.Tensor) -> None:
        if weights.defer_grads:
            return
        grad, copy.grad = copy.grad, None
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)
    return add


class CastUnit:
    """The `param_dtype` copies of some of a module's float32 parameters, swapped in around the
    forward of the module the unit hooks."""

    def __init__(self, slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]]):
        self.slots = slots  # owner, name, master, copy
        pairs = {id(master): (master, copy) for _, _, master, copy in slots}  # a tied parameter once
        self.masters = [master for master, _ in pairs.values()]
        self.copies = [copy for _, copy in pairs.values()]
        self.copied_versions: list[int] | None = None

    @torch.no_grad()
    def swap_in(self, *unused) -> None:
        versions = [m._version for m in self.masters]
        if versions != self.copied_versions:
            torch._foreach_copy_(self.copies, self.masters)
            self.copied_versions = versions
        for owner, name, _, copy in self.slots:
            owner._parameters[name] = copy

    def swap_out(self, *unused) -> None:
        for owner, name, master, _ in self.slots:
            owner._parameters[name] = master

    def hook(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.swap_in)
        module.register_forward_hook(self.swap_out, always_call=True)


class MasterWeights:
    """A module's float32 masters and their `param_dtype` copies, over all its units.

    `defer_grads`: a backward leaves each gradient on its copy (in `param_dtype`) instead of adding
    it to the master. A training step of one micro-batch sets it, so that the optimizer reads the
    bf16 gradients and writes the copies in the pass that updates the masters (`train/step.py`):
    the float32 gradients cost a read and a write of every parameter. With several micro-batches the
    gradients add up in float32, on the masters, and the same pass reads them there.
    """

    def __init__(self):
        self.units: list[CastUnit] = []
        self.copy_of: dict[int, nn.Parameter] = {}  # id(master) -> its copy
        self.defer_grads = False

    @contextlib.contextmanager
    def deferring_grads(self):
        """Within: backward leaves the gradients on the copies (none left over from before)."""
        self.drop_copy_grads()
        self.defer_grads = True
        try:
            yield
        finally:
            self.defer_grads = False

    def drop_copy_grads(self) -> None:
        for copy in self.copy_of.values():
            copy.grad = None

    def masters_changed(self) -> None:
        """The masters were updated: the next forward of each unit refreshes its copies. The
        optimizer `train/step.build_optimizer` builds over them calls it after each step: a master's
        version counter misses the steps of torch's fused optimizer kernels (AdamW's on CUDA writes
        the parameters without counting a version); the version check sees other writes."""
        for unit in self.units:
            unit.copied_versions = None

    def copies_written(self) -> None:
        """The copies hold the masters as they are now: the next forward need not refresh them."""
        for unit in self.units:
            unit.copied_versions = [m._version for m in unit.masters]


def apply_mixed_precision(module: nn.Module, param_dtype: torch.dtype) -> MasterWeights:
    """Run `module` in `param_dtype` over its float32 masters, in place: one unit per layer, one for
    the root; the routers of a layer built in mixed dtypes stay as stored (as `fsdp.apply_fsdp`
    keeps them). Returns the masters and their copies."""
    kept = {id(p) for layer in decoder_layers(module) if stores_mixed_dtypes(layer)
            for m in layer.modules() if isinstance(m, TopKRouter) for p in m.parameters()}
    weights = MasterWeights()

    def slots_of(modules) -> list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]]:
        slots = []
        for owner in modules:
            for name, master in owner._parameters.items():
                if master is None or master.dtype != torch.float32 or id(master) in kept:
                    continue
                if id(master) not in weights.copy_of:
                    copy = nn.Parameter(torch.empty_like(master, dtype=param_dtype), requires_grad=master.requires_grad)
                    if master.requires_grad:
                        copy.register_post_accumulate_grad_hook(_add_grad_to(master, weights))
                    weights.copy_of[id(master)] = copy
                slots.append((owner, name, master, weights.copy_of[id(master)]))
        return slots

    units, in_layers = [], set()
    for layer in decoder_layers(module):
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)  # where a recompute calls forward
        in_layers.update(id(m) for m in layer.modules())
        units.append((inner, CastUnit(slots_of(layer.modules()))))
    units.append((module, CastUnit(slots_of(m for m in module.modules() if id(m) not in in_layers))))
    for hooked, unit in units:
        unit.hook(hooked)
    weights.units = [unit for _, unit in units]
    return weights
