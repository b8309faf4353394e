"""Muon for the hidden matrices, AdamW for everything else, behind one optimizer-like object.

Muon (Keller Jordan; Moonshot's "Muon is scalable for LLM training") orthogonalises each 2-D
update with a few Newton-Schulz steps. It is meant for hidden-layer matrices only: embeddings,
the LM head, the router, norms, 1-D tensors (A_log, D, dt_bias, biases) and N-D tensors (the
Mamba conv kernel, stacked 3-D experts) stay on AdamW.

`Muon` here is `torch.optim.Muon` (torch >= 2.9) with one change for FSDP2: a sharded matrix's
momentum is gathered and orthogonalised whole, then each rank keeps its rows. torch's own step runs
Newton-Schulz as DTensor matmuls, which add up in another order than one process does; in bfloat16
that difference flips routing decisions and the runs drift apart. Gathering makes every layout take
the step one process takes (it is also what the orthogonalisation needs: the whole matrix).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .master_update import AdamWCompactMoments
from .offload import AdamWOffloaded
from .weight_decay import param_groups

# Parameter names that stay on AdamW whatever their shape: token-level lookups and the router,
# whose rows are per-class scores rather than a hidden linear map.
_ADAMW_ONLY = ("embeddings.", "lm_head.", "gate.weight")


def is_muon_param(name: str, param: nn.Parameter) -> bool:
    return param.ndim == 2 and not any(key in name for key in _ADAMW_ONLY)


class OptimizerList:
    """Several optimizers stepped as one (the trainer, clipping and schedules see one object).

    `optimizers` is what `torch.distributed.checkpoint.state_dict.get_state_dict` takes.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state: dict) -> None:
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(state[str(i)])


def orthogonalize(matrix: torch.Tensor, steps: int, coefficients: tuple[float, float, float], eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Newton-Schulz quintic iteration towards U V^T of `matrix` (in bfloat16 by default, as torch and
    Keller Jordan do: the iteration tolerates its rounding, and tensor cores run it fast)."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_lr_scale(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """What Muon multiplies the learning rate by for a matrix of `shape` (torch.optim.Muon's rule)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))  # Keller Jordan's original scaling


class Muon(torch.optim.Muon):
    """`torch.optim.Muon`, orthogonalising each sharded matrix whole (see the module docstring).

    `ns_precision="float32"` runs Newton-Schulz in float32: slower, but two layouts then agree to
    float32 rounding (in bfloat16 a one-ulp difference in a gradient can flip a routing decision).
    """

    def __init__(self, params, ns_precision: str = "bfloat16", **options):
        super().__init__(params, **options)
        self.defaults["ns_precision"] = ns_precision
        for group in self.param_groups:
            group.setdefault("ns_precision", ns_precision)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                sharded = isinstance(update, DTensor)
                whole = update.full_tensor() if sharded else update
                update = orthogonalize(whole, group["ns_steps"], group["ns_coefficients"], group["eps"],
                                       getattr(torch, group["ns_precision"]))
                if sharded:  # this rank's rows, cut locally (no scatter: every rank holds the whole)
                    update = distribute_tensor(update, param.device_mesh, param.placements, src_data_rank=None)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-group["lr"] * muon_lr_scale(group["adjust_lr_fn"], param.shape))
        return loss


def build_muon(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr_fn: str = "match_rms_adamw",
    ns_precision: str = "bfloat16",
    moments: str = "float32",
) -> OptimizerList:
    """Muon on the 2-D hidden matrices, AdamW (decay on matrices only) on the rest, one lr."""
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    muon = [param for name, param in named if is_muon_param(name, param)]
    rest = [(name, param) for name, param in named if not is_muon_param(name, param)]
    optimizers = []
    if muon:
        optimizers.append(Muon(
            muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_precision=ns_precision,
        ))
    optimizers.append(build_adamw(rest, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, moments=moments))
    return OptimizerList(optimizers)


# optimizer.moments -> the dtype AdamW stores its moments in (None: the parameters'; uint8: int8's 8-bit
# codes with a scale a block, `master_update`'s docstring)
MOMENTS = {"float32": None, "bfloat16": torch.bfloat16, "int8": torch.uint8}


def build_adamw(named_parameters: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float,
                betas: tuple[float, float], eps: float, moments: str = "float32",
                offload_to: torch.device | None = None) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only. On CUDA its fused kernel (a few launches
    per step, DTensor parameters from FSDP2 and EP included). On CPU the foreach one, but a loop
    over the parameters where they are DTensors: DTensor works out the sharding of a foreach op
    over many differently sharded tensors once per process, a cost in the first step that a short
    CPU run does not win back from the foreach kernels. `moments: bfloat16` stores both moments in
    bfloat16 (`master_update.AdamWCompactMoments`: the kit's own update, compiled on a GPU). With
    `offload_to` (the device the step computes on) the parameters and the state are in host memory
    (`offload.AdamWOffloaded`: the same update, streamed through that device)."""
    groups = param_groups(named_parameters, weight_decay)
    if offload_to is not None:
        return AdamWOffloaded(groups, device=offload_to, moments_dtype=MOMENTS[moments] or torch.float32, lr=lr,
                              betas=betas, eps=eps)
    params = [p for group in groups for p in group["params"]]
    cuda = all(p.device.type == "cuda" for p in params)
    if MOMENTS[moments] is not None:
        return AdamWCompactMoments(groups, moments_dtype=MOMENTS[moments], on_device=cuda, lr=lr, betas=betas,
                                   eps=eps)
    foreach = not cuda and not any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=cuda, foreach=foreach)


def optimizers_of(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside `optimizer` (itself when it is one)."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerList) else [optimizer]
