"""The chunked SSD scan equals the step-by-step recurrence, in float64, for any length."""

import pytest
import torch
from kit_scripts import load_script

from onenode.model.mamba2 import select_ssd, ssd_chunked, ssd_naive

CHUNK = 8


def _inputs(t, groups=2, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, p, n = 2, 3, 5
    kw = dict(dtype=torch.float64, generator=g)
    return dict(
        x=torch.randn(b, t, heads, p, **kw),
        dt=torch.rand(b, t, heads, **kw) * 0.5,
        A=-torch.rand(heads, **kw) * 4,
        B=torch.randn(b, t, groups, n, **kw),
        C=torch.randn(b, t, groups, n, **kw),
    )


@pytest.mark.parametrize("t", [1, 5, CHUNK, 3 * CHUNK, 2 * CHUNK + 3])
@pytest.mark.parametrize("groups", [1, 2])
def test_chunked_equals_recurrence(t, groups):
    inp = _inputs(t, groups)
    D = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(ssd_chunked(**inp, chunk_size=CHUNK, D=D), ssd_naive(**inp, D=D), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ssd_chunked(**inp, chunk_size=CHUNK), ssd_naive(**inp), rtol=1e-10, atol=1e-10)


def test_chunked_gradients_equal_recurrence():
    inp = {k: v.requires_grad_() for k, v in _inputs(2 * CHUNK + 3, seed=1).items()}
    weight = torch.randn(2, 2 * CHUNK + 3, 4, 3, dtype=torch.float64)
    grads = [torch.autograd.grad((f() * weight).sum(), list(inp.values())) for f in (
        lambda: ssd_chunked(**inp, chunk_size=CHUNK), lambda: ssd_naive(**inp))]
    for chunked, naive in zip(*grads):
        torch.testing.assert_close(chunked, naive, rtol=1e-9, atol=1e-9)


def test_float32_inputs_compute_in_float32():
    inp = {k: v.float() for k, v in _inputs(11).items()}
    y = ssd_chunked(**inp, chunk_size=CHUNK)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ssd_naive(**inp), rtol=1e-4, atol=1e-4)


def test_bfloat16_inputs_multiply_in_bfloat16_and_stay_close():
    """On bf16 inputs the four chunk products take bf16 operands (tensor cores on a GPU), and only
    the small carry of states across chunks multiplies in float32; the result is float32 and within
    bf16 rounding of the float64 recurrence."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                self.seen.append("@".join(str(a.dtype).removeprefix("torch.") for a in args[:2]))
            return func(*args, **(kwargs or {}))

    inp = _inputs(3 * CHUNK + 5, seed=2)
    want = ssd_naive(**inp)
    with MatmulDtypes() as mode:
        y = ssd_chunked(**{k: v.to(torch.bfloat16) if k in "xBC" else v.float() for k, v in inp.items()},
                        chunk_size=CHUNK)
    assert sorted(mode.seen) == ["bfloat16@bfloat16"] * 4 + ["float32@float32"] and y.dtype == torch.float32
    assert (y.double() - want).abs().max() < 2e-2 * want.abs().max()


def test_forced_mamba_ssm_kernel_on_cpu_is_a_clear_error(capsys):
    with pytest.raises(RuntimeError, match="mamba_kernel='torch'"):
        select_ssd("mamba_ssm")
    assert select_ssd("auto") is ssd_chunked
    from onenode.cli import main

    assert main(["bench", "--preset", "tiny", "--seq-len", "16", "--steps", "1", "--warmup", "0", "--quiet",
                 "--mamba-kernel", "mamba_ssm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onenode bench: mamba_kernel='mamba_ssm'")
    assert "make mamba-ssm" in err[0] and "mamba_kernel='torch'" in err[0]


def test_causal_conv_equals_the_depthwise_conv1d():
    """The shifted multiply-adds compute nn.Conv1d's depthwise causal conv (first t outputs)."""
    from onenode.model.mamba2 import CausalConv1d

    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3, dtype=torch.float64)
    ours = CausalConv1d(6, 4).double()
    ours.load_state_dict(conv.state_dict())
    for t in (1, 3, 9):
        x = torch.randn(2, t, 6, dtype=torch.float64, generator=gen)
        torch.testing.assert_close(ours(x), conv(x.transpose(1, 2))[..., :t].transpose(1, 2))


def test_the_probes_carry_by_recurrence_is_the_kits_carry():
    """benchmarks/ssd_probe.py's states carried by a recurrence over the chunks (also the step
    probe `ssd-carry-recurrence`) are `carry_across_chunks`' in float64, and the scan through it is
    the step-by-step recurrence: the probes time the same scan."""
    from onenode.model import mamba2

    probe = load_script("benchmarks/ssd_probe.py")
    g = torch.Generator().manual_seed(0)
    states = torch.randn(2, 5, 2, 3, 4, 6, dtype=torch.float64, generator=g)
    logdecay = -torch.rand(2, 2, 3, 5, dtype=torch.float64, generator=g) * 3
    torch.testing.assert_close(probe.carry_by_recurrence(states, logdecay),
                               mamba2.carry_across_chunks(states, logdecay), rtol=1e-12, atol=1e-12)
    inp = _inputs(3 * CHUNK + 2)
    recurrence = probe.with_mamba2(ssd_chunked, carry_across_chunks=probe.carry_by_recurrence)
    torch.testing.assert_close(recurrence(**inp, chunk_size=CHUNK), ssd_naive(**inp), rtol=1e-10, atol=1e-10)


def test_the_probes_carry_on_bf16_operands_is_the_kits_carry_to_bf16_rounding():
    """benchmarks/ssd_probe.py's carry on bf16 operands (also the step probe `ssd-carry-bf16`) gives
    `carry_across_chunks`' states to bf16 rounding when the states are bf16 values (as the scan's
    chunk products make them), in float32; the scan through it stays within the probe's bound of the
    float64 scan on bf16 inputs."""
    from onenode.model import mamba2

    probe = load_script("benchmarks/ssd_probe.py")
    g = torch.Generator().manual_seed(0)
    states = torch.randn(2, 5, 2, 3, 4, 6, generator=g).bfloat16().float()
    logdecay = -torch.rand(2, 2, 3, 5, generator=g) * 3
    got = probe.carry_on_bf16(states, logdecay)
    want = mamba2.carry_across_chunks(states.double(), logdecay.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    padded = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # the product itself took bf16 operands
    decay = torch.exp(mamba2.segment_sum(torch.nn.functional.pad(logdecay, (1, 0))))
    on_bf16 = torch.einsum("bgrzc,bcgrpn->bzgrpn", decay.bfloat16(), padded.bfloat16())[:, :-1]
    assert torch.equal(got, on_bf16.float()) and not torch.equal(got, mamba2.carry_across_chunks(states, logdecay))
    tensors, chunk, _ = probe.inputs("tiny", 2, 3 * 64 + 5, torch.device("cpu"))
    low = {k: v.bfloat16() if k in ("x", "B", "C") else v for k, v in tensors.items()}
    reference = ssd_chunked(**{k: v.double() for k, v in low.items()}, chunk_size=chunk)
    scan = probe.with_mamba2(ssd_chunked, carry_across_chunks=probe.carry_on_bf16)
    assert probe.relative_error(scan(**low, chunk_size=chunk), reference) < probe.MAX_RELATIVE_ERROR / 4


def test_decays_within_a_chunk_from_one_cumulative_sum_are_the_segment_sums():
    """The decays inside a chunk, exp(a_cum[l] - a_cum[s]), are exp(segment_sum) (the exact sum of
    each segment) in float64, zero above the diagonal; in float32 over a chunk of 256 steps whose sum
    reaches -512 they stay within float32's rounding of the exponent."""
    from onenode.model import mamba2

    a = -torch.rand(2, 3, 4, 5, CHUNK, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    got = mamba2.decay_within_chunks(a.cumsum(dim=-1))
    torch.testing.assert_close(got, torch.exp(mamba2.segment_sum(a)), rtol=1e-12, atol=1e-12)
    assert torch.equal(got.triu(1), torch.zeros_like(got))
    long = -torch.rand(4, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 4
    exact = torch.exp(mamba2.segment_sum(long))
    single = mamba2.decay_within_chunks(long.float().cumsum(dim=-1)).double()
    torch.testing.assert_close(single, exact, rtol=1e-4, atol=1e-6)
