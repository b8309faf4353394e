"""The FLOP model against `torch.utils.flop_counter.FlopCounterMode` on the torch reference path.

FlopCounterMode counts every GEMM (mm, addmm, bmm, SDPA) as 2*m*n*k, so the model's tensor-core
FLOPs must match it exactly, forward and forward + backward. Two things differ by convention and
are handled explicitly: the counter counts attention as the full (non-causal) square, and on CPU
it sees SDPA only through the math backend (the fused CPU kernel has no FLOP formula). The
depthwise conv is CUDA-core work in the model and is left out of the comparison.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from onenode.flops import FORWARD_BACKWARD, layer_flops, mfu, model_flops
from onenode.model import build_model, get_preset
from onenode.model.nemotron_h import MIXERS

BATCH, SEQ = 2, 40  # 40 is not a multiple of the tiny chunk (16): the padded last chunk counts


def _counted_matmul_flops(fn) -> int:
    """GEMM FLOPs FlopCounterMode sees while `fn` runs (convolutions excluded)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts()["Global"]
    return sum(n for op, n in counts.items() if "convolution" not in str(op))


@pytest.fixture(scope="module")
def tiny():
    return get_preset("tiny")


@pytest.mark.parametrize("kind", ["mamba", "attention", "moe", "mlp"])
def test_layer_matmul_flops_match_flop_counter(tiny, kind):
    torch.manual_seed(0)
    mixer = MIXERS[kind](tiny)
    for p in mixer.parameters():
        torch.nn.init.normal_(p, std=0.1)  # router weights must spread tokens over the experts
    x = torch.randn(BATCH, SEQ, tiny.hidden_size, requires_grad=True)
    expected = layer_flops(tiny, kind, SEQ, BATCH, causal_attention=False).matmul_total

    forward = _counted_matmul_flops(lambda: mixer(x))
    both = _counted_matmul_flops(lambda: mixer(x).square().sum().backward())
    assert forward == expected
    assert both == FORWARD_BACKWARD * expected


def test_attention_counts_half_the_square_when_causal(tiny):
    full = layer_flops(tiny, "attention", SEQ, BATCH, causal_attention=False).matmul
    causal = layer_flops(tiny, "attention", SEQ, BATCH, causal_attention=True).matmul
    assert full["attention_core"] == 4 * BATCH * SEQ**2 * tiny.num_attention_heads * tiny.head_dim
    assert causal["attention_core"] * 2 == full["attention_core"]
    assert {k: v for k, v in causal.items() if k != "attention_core"} == {
        k: v for k, v in full.items() if k != "attention_core"
    }


def test_whole_model_matches_flop_counter(tiny):
    model = build_model(tiny, seed=0)
    ids = torch.randint(0, tiny.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    full = model_flops(tiny, SEQ, BATCH, causal_attention=False)
    causal = model_flops(tiny, SEQ, BATCH)

    forward = _counted_matmul_flops(lambda: model(ids))
    both = _counted_matmul_flops(lambda: model(ids, labels=ids).loss.backward())
    assert forward == full.forward_matmul_flops
    assert both == FORWARD_BACKWARD * full.forward_matmul_flops
    # The causal convention removes exactly half of each attention layer's square.
    removed = sum(layer.matmul.get("attention_core", 0) for layer in full.layers) // 2
    assert causal.forward_matmul_flops == full.forward_matmul_flops - removed
    assert causal.matmul_flops_per_token == pytest.approx(3 * causal.forward_matmul_flops / (BATCH * SEQ))


def test_report_breakdown_is_consistent(tiny):
    report = model_flops(tiny, SEQ, BATCH)
    assert len(report.layers) == tiny.num_hidden_layers + 2  # embeddings and lm_head around the layers
    assert report.layers[0].matmul_total == 0  # a lookup
    per_kind = report.per_kind()
    assert set(per_kind) == set(tiny.layer_kinds) | {"embeddings", "lm_head"}
    assert sum(k["matmul"] for k in per_kind.values()) == report.forward_matmul_flops
    assert sum(k["other"] for k in per_kind.values()) == report.forward_other_flops
    assert 0 < report.other_flops_per_token < report.matmul_flops_per_token
    assert "total" in report.table()
    # MoE counts top-k experts only: more experts at the same top-k change only the router.
    more = model_flops(tiny.replace(n_routed_experts=16, n_group=1), SEQ, BATCH).per_kind()["moe"]["matmul"]
    n_moe = tiny.layer_kinds.count("moe")
    assert more - per_kind["moe"]["matmul"] == n_moe * 2 * BATCH * SEQ * tiny.hidden_size * 8


def test_mfu():
    assert mfu(1000.0, 1e9, n_gpus=2, peak=1e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="n_gpus"):
        mfu(1000.0, 1e9, n_gpus=0)
