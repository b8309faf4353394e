"""The causal convolution `benchmarks/automodel_peer.py` gives mamba_ssm's fused scan where
causal-conv1d (an nvcc build) is not installed: on a GPU, Automodel's Mamba layers train through it,
so its forward and its backward must be the package's, through the entry points the scan calls."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

PEER = Path(__file__).resolve().parents[1] / "benchmarks" / "automodel_peer.py"


@pytest.fixture
def stand_in():
    """The stand-in's `cpp_functions`, and sys.modules as it was afterwards."""
    spec = importlib.util.spec_from_file_location("automodel_peer", PEER)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    saved = {name: sys.modules.pop(name) for name in ("causal_conv1d", "causal_conv1d.cpp_functions")
             if name in sys.modules}
    try:
        which = peer.stand_in_causal_conv1d()
        if not which.startswith("stand-in"):
            pytest.skip(f"causal-conv1d is installed here ({which})")
        yield sys.modules["causal_conv1d.cpp_functions"]
    finally:
        for name in ("causal_conv1d", "causal_conv1d.cpp_functions"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _by_definition(x, weight, bias):
    """out[b, c, t] = silu(bias[c] + sum_k weight[c, k] x[b, c, t - (width - 1) + k]), zeros before t = 0."""
    width = weight.shape[1]
    padded = F.pad(x, (width - 1, 0))
    out = sum(weight[:, k, None] * padded[..., k:k + x.shape[-1]] for k in range(width)) + bias[:, None]
    return F.silu(out)


def test_the_stand_in_convolution_and_its_gradients_are_causal_conv1ds(stand_in):
    gen = torch.Generator().manual_seed(0)
    x, weight, bias, dout = (torch.randn(*shape, generator=gen, dtype=torch.float64)
                             for shape in ((2, 6, 10), (6, 4), (6,), (2, 6, 10)))
    out = stand_in.causal_conv1d_fwd_function(x, weight, bias, None, None, None, True)
    torch.testing.assert_close(out, _by_definition(x, weight, bias))
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    expected = torch.autograd.grad(_by_definition(*leaves), leaves, dout)
    dx_given = torch.empty_like(x)  # mamba_ssm hands the scan's gradient buffer in; it is written
    dx, dweight, dbias, dinitial = stand_in.causal_conv1d_bwd_function(x, weight, bias, dout, None, None, None,
                                                                      dx_given, False, True)
    assert dx is dx_given and dinitial is None
    for got, want in zip((dx, dweight, dbias), expected):
        torch.testing.assert_close(got, want)
    with pytest.raises(NotImplementedError, match="whole sequences"):  # packed sequences: not given
        stand_in.causal_conv1d_fwd_function(x, weight, bias, torch.zeros(2, 10, dtype=torch.int32), None, None, True)
