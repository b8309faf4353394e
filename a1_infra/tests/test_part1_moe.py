"""A1 part 1: the MoE layer's routed experts run as a few fused operations, not one expert at a time.

What is measured: the outputs and gradients against the MoE's definition, expert by expert (the
experts are read through `onenode.adapters`); the aten operations one MoE forward+backward
dispatches (a `TorchDispatchMode` sees every one, whatever the device), as the number of experts
grows; and which of them make the host wait for the device.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onenode.adapters import routed_expert_grads, routed_expert_weights

# Operations that make the host wait for the device (on CUDA): reading a value (`.item()`,
# `.tolist()`, `if tensor:`), or an output whose size depends on the data.
HOST_SYNCS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
              "aten._unique2", "aten.unique_consecutive", "aten.bincount"}
TOKENS = 64


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def moe_layer(num_experts: int):
    """The MoE layer of a one-layer model, top-2, no group-limited routing, fixed weights."""
    from onenode.model import build_model, get_preset

    config = get_preset("tiny", hybrid_override_pattern="E", n_routed_experts=num_experts,
                        num_experts_per_tok=2, n_group=1, topk_group=1)
    return build_model(config, seed=0).backbone.layers[0].mixer


def count_ops(num_experts: int, backward: bool = True) -> Counter:
    moe = moe_layer(num_experts)
    x = torch.randn(TOKENS, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(0), requires_grad=True)
    with OpCounter() as counter:
        y = moe(x)
        if backward:
            y.square().mean().backward()
    return counter.ops


def by_definition(moe, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_k w_k * down_e(relu(up_e(x))^2) + shared_experts(x), with e the k-th expert chosen."""
    idx, weight = moe.gate(x)
    hidden = torch.relu(torch.einsum("th,tkih->tki", x, up[idx])).square()
    return torch.einsum("tki,tkhi,tk->th", hidden, down[idx], weight) + moe.shared_experts(x)


def _worst(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_moe_matches_the_definition():
    moe = moe_layer(8)
    x = torch.randn(TOKENS, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = by_definition(moe, x, *routed_expert_weights(moe))
        got = moe(x)
    err = _worst(got, expected)
    assert err < 1e-5, f"MoE output differs from the definition by {err:.3g} (max abs, relative); expected < 1e-5"


def test_moe_gradients_match_the_definition():
    """The input's and every expert's gradients, expert by expert (read through onenode.adapters)."""
    moe = moe_layer(8)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(TOKENS, moe.gate.weight.shape[1], generator=gen, requires_grad=True)
    grad_out = torch.randn(x.shape, generator=gen)
    moe(x).backward(grad_out)
    got = [x.grad, *routed_expert_grads(moe)]
    up, down = (w.detach().clone().requires_grad_(True) for w in routed_expert_weights(moe))
    x_def = x.detach().clone().requires_grad_(True)
    by_definition(moe, x_def, up, down).backward(grad_out)
    for name, mine, expected in zip(("input", "up", "down"), got, (x_def.grad, up.grad, down.grad)):
        assert mine is not None and mine.shape == expected.shape, (
            f"{name} gradient: shape {None if mine is None else tuple(mine.shape)}, expected {tuple(expected.shape)}")
        if name == "input":
            err = _worst(mine, expected)
            assert err < 1e-5, f"input gradient differs from the definition's by {err:.3g}; expected < 1e-5"
            continue
        errors = [_worst(mine[j], expected[j]) if expected[j].abs().max() > 0 else mine[j].abs().max().item()
                  for j in range(expected.shape[0])]
        wrong = [j for j, e in enumerate(errors) if e > 1e-5]
        assert not wrong, (f"{name}-projection gradients of experts {wrong} differ from the definition's "
                           f"(worst {max(errors):.3g}); expected < 1e-5 for every expert")


def test_moe_op_count_does_not_grow_with_experts():
    few, many = count_ops(8), count_ops(32)
    n_few, n_many = sum(few.values()), sum(many.values())
    grown = {op: many[op] - few[op] for op in many if many[op] > few[op]}
    top = ", ".join(f"{op} +{n}" for op, n in sorted(grown.items(), key=lambda kv: -kv[1])[:4])
    assert n_many <= n_few + 4, (
        f"one MoE forward+backward dispatched {n_few} aten ops with 8 experts and {n_many} with 32 "
        f"(grew: {top}): the work the routed experts launch grows with the number of experts. Expected "
        f"the same count whatever the number of experts."
    )


def test_moe_forward_has_no_host_sync():
    ops = count_ops(32, backward=False)
    syncs = {op: n for op, n in ops.items() if op in HOST_SYNCS}
    assert not syncs, (
        f"one MoE forward made {sum(syncs.values())} host syncs ({', '.join(f'{op} x{n}' for op, n in syncs.items())}) "
        f"with 32 experts: each makes the CPU wait for the GPU, which then idles while the next kernels are "
        f"launched. Expected 0."
    )
