"""A1 part 1: the MoE layer's routed experts run as a few fused operations, not one expert at a time.

What is measured: the aten operations one MoE forward+backward dispatches (a `TorchDispatchMode`
sees every one, whatever the device), and which of them make the host wait for the device.
A fused MoE (tokens sorted by expert, one grouped GEMM per projection, results added back per
token) dispatches the same number of operations for 8 experts as for 32, and none of them waits.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def expert_weights(moe) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [E, I, H], down [E, H, I]) whatever the layout: one module per expert, or stacked."""
    experts, hidden = moe.experts, moe.gate.weight.shape[1]
    if isinstance(experts, torch.nn.ModuleList):
        return (torch.stack([e.up_proj.weight for e in experts]), torch.stack([e.down_proj.weight for e in experts]))
    up, down = experts.up_proj, experts.down_proj
    return (up if up.shape[-1] == hidden else up.mT), (down if down.shape[1] == hidden else down.mT)


def test_moe_matches_the_definition():
    """Whatever the implementation: sum_k w_k * down_e(relu(up_e(x))^2) + shared_experts(x)."""
    moe = moe_layer(8)
    x = torch.randn(TOKENS, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        idx, weight = moe.gate(x)
        up, down = expert_weights(moe)
        hidden = torch.relu(torch.einsum("th,tkih->tki", x, up[idx])).square()
        expected = torch.einsum("tki,tkhi,tk->th", hidden, down[idx], weight) + moe.shared_experts(x)
        got = moe(x)
    err = (got - expected).abs().max().item()
    assert err < 1e-4, f"MoE output differs from the definition by {err:.3g} (max abs); expected < 1e-4"


def test_moe_op_count_does_not_grow_with_experts():
    few, many = count_ops(8), count_ops(32)
    n_few, n_many = sum(few.values()), sum(many.values())
    grown = {op: many[op] - few[op] for op in many if many[op] > few[op]}
    top = ", ".join(f"{op} +{n}" for op, n in sorted(grown.items(), key=lambda kv: -kv[1])[:4])
    assert n_many <= n_few + 4, (
        f"one MoE forward+backward dispatched {n_few} aten ops with 8 experts and {n_many} with 32 "
        f"(grew: {top}): the work the routed experts launch grows with the number of experts. Expected "
        f"the same count whatever the number of experts: profile the MoE layer and look at how many "
        f"kernels each expert costs."
    )


def test_moe_forward_has_no_host_sync():
    ops = count_ops(32, backward=False)
    syncs = {op: n for op, n in ops.items() if op in HOST_SYNCS}
    assert not syncs, (
        f"one MoE forward made {sum(syncs.values())} host syncs ({', '.join(f'{op} x{n}' for op, n in syncs.items())}) "
        f"with 32 experts: each makes the CPU wait for the GPU, which then idles while the next kernels are "
        f"launched. Expected 0: keep data-dependent sizes on the device (counts with scatter_add_ or "
        f"histc, offsets with cumsum) and let a grouped GEMM read them."
    )
