"""mamba_ssm's SSD as the kit loads and wraps it (`model/mamba_ssm_scan.py`), checked on CPU.

The Triton kernels need a GPU; here a stand-in pair computed with `ssd_chunked` takes their place,
so what is tested is the kit's own part: the import that skips the package's `__init__`, the op's
gradients, and that `torch.compile(fullgraph=True)` traces through the op without a break.
"""

import concurrent.futures
import json
import sys
import types

import pytest
import torch

from onenode.model import mamba_ssm_scan
from onenode.model.mamba2 import select_ssd, ssd_chunked

CHUNK = 8


def _inputs(t=2 * CHUNK + 3, heads=4, groups=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw = dict(dtype=torch.float64, generator=g)
    return dict(x=torch.randn(2, t, heads, 3, **kw), dt=torch.rand(2, t, heads, **kw) * 0.5,
                A=-torch.rand(heads, **kw) * 4, B=torch.randn(2, t, groups, 5, **kw),
                C=torch.randn(2, t, groups, 5, **kw), D=torch.randn(heads, **kw))


def _stand_in_forward(x, dt, A, B, C, chunk_size, D):
    return ssd_chunked(x, dt, A, B, C, chunk_size, D=D).to(x.dtype)


def _stand_in_backward(dy, x, dt, A, B, C, y, chunk_size, D):
    """Autograd through `ssd_chunked`, on a thread of its own: an op's body runs below autograd's
    dispatch keys (thread-local), where no tensor records a graph."""

    def grads():
        leaves = [t.detach().requires_grad_() for t in (x, dt, A, B, C, D)]
        return torch.autograd.grad(ssd_chunked(*leaves[:5], chunk_size, D=leaves[5]), leaves, dy)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(grads).result()


@pytest.fixture
def stand_in_kernels(monkeypatch):
    monkeypatch.setattr(mamba_ssm_scan, "kernels",
                        lambda: mamba_ssm_scan.Kernels(_stand_in_forward, _stand_in_backward))


def _value_and_grads(scan, inputs):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    y = scan(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], CHUNK, D=leaves["D"])
    weight = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    return y.detach(), torch.autograd.grad((y * weight).sum(), list(leaves.values()))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_op_has_the_scans_values_and_gradients(stand_in_kernels, compiled):
    # aot_eager: dynamo and the op's declared shapes, as inductor sees them, without C++ codegen
    scan = torch.compile(mamba_ssm_scan.chunk_scan, fullgraph=True, backend="aot_eager") if compiled \
        else mamba_ssm_scan.chunk_scan
    inputs = _inputs()
    want_y, want_grads = _value_and_grads(ssd_chunked, inputs)
    got_y, got_grads = _value_and_grads(scan, inputs)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    for name, got, want in zip(inputs, got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"d{name}: {m}")


def test_the_ops_pass_torch_library_checks(stand_in_kernels):
    """Schema, fake (meta) outputs against the real ones, autograd registration, traced dispatch:
    for the scan and for its backward."""
    inputs = _inputs(t=CHUNK + 1)
    x, dt, A, B, C, D = (inputs[k] for k in "x dt A B C D".split())
    y = _stand_in_forward(x, dt, A, B, C, CHUNK, D)
    checks = {
        "forward": (torch.ops.onenode.mamba_ssm_chunk_scan.default,
                    (*(t.clone().requires_grad_() for t in (x, dt, A, B, C)), CHUNK, D.clone().requires_grad_())),
        "backward": (torch.ops.onenode.mamba_ssm_chunk_scan_backward.default,
                     (torch.randn_like(y), x, dt, A, B, C, y, CHUNK, D)),
    }
    for name, (op, args) in checks.items():
        results = torch.library.opcheck(op, args, raise_exception=False)
        assert set(results) >= {"test_schema", "test_faketensor", "test_autograd_registration"}, (name, results)
        assert all(outcome == "SUCCESS" for outcome in results.values()), (name, results)


def _fake_package(root, name: str) -> None:
    """A package laid out as mamba-ssm is, whose `__init__` needs a CUDA extension that is absent."""
    kernel_dir = root / name / "ops" / "triton"
    kernel_dir.mkdir(parents=True)
    (root / name / "__init__.py").write_text("import selective_scan_cuda_absent_here\n")
    (root / name / "ops" / "__init__.py").write_text("")
    (kernel_dir / "__init__.py").write_text("")
    (kernel_dir / "ssd_combined.py").write_text(f"from {name}.ops.triton import __name__ as PARENT\n")


def test_a_triton_only_install_imports_without_the_packages_init(tmp_path, monkeypatch):
    name = "onenode_test_fake_mamba"
    _fake_package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ModuleNotFoundError, match="selective_scan_cuda"):
            __import__(f"{name}.ops.triton.ssd_combined")
        module = mamba_ssm_scan.import_skipping_package_init(f"{name}.ops.triton.ssd_combined")
        assert module.PARENT == f"{name}.ops.triton"
        with pytest.raises(ModuleNotFoundError, match="selective_scan_cuda"):  # the real __init__ again
            __import__(name)
    finally:
        for key in [k for k in sys.modules if k.partition(".")[0] == name]:
            del sys.modules[key]


def test_a_missing_package_is_a_clear_error_that_says_how_to_install():
    with pytest.raises(ModuleNotFoundError, match="onenode_no_such_package"):
        mamba_ssm_scan.import_skipping_package_init("onenode_no_such_package.ops")
    if mamba_ssm_scan.load_kernels()[0] is None:
        with pytest.raises(RuntimeError, match="make mamba-ssm"):
            select_ssd("mamba_ssm")
        with pytest.raises(mamba_ssm_scan.KernelUnavailableError, match="make mamba-ssm"):
            mamba_ssm_scan.chunk_scan(*(_inputs()[k] for k in "x dt A B C".split()), CHUNK)


def test_the_default_scan_is_torchs_whatever_is_installed():
    from onenode.model import get_preset
    from onenode.model.mamba2 import Mamba2Mixer

    assert Mamba2Mixer(get_preset("tiny")).ssd is ssd_chunked


def _module(**names):
    return types.SimpleNamespace(_mamba_chunk_scan_combined_fwd=None, _mamba_chunk_scan_combined_bwd=None, **names)


def test_the_kernels_know_whether_mamba_ssm_has_a_deterministic_mode():
    assert not mamba_ssm_scan.kernels_of(_module()).deterministic_mode  # mamba-ssm before 2.3
    assert mamba_ssm_scan.kernels_of(_module(use_deterministic_mode=lambda: False)).deterministic_mode


@pytest.fixture
def deterministic_algorithms():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_a_mamba_ssm_without_a_deterministic_mode_is_refused_under_deterministic_kernels(
        monkeypatch, deterministic_algorithms):
    loaded = mamba_ssm_scan.Kernels(_stand_in_forward, _stand_in_backward, deterministic_mode=False)
    monkeypatch.setattr(mamba_ssm_scan, "load_kernels", lambda: (loaded, ""))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(mamba_ssm_scan.KernelUnavailableError, match="mamba-ssm >= 2.3") as info:
        select_ssd("mamba_ssm")
    assert "mamba_kernel='torch'" in str(info.value) and "\n" not in str(info.value)
    assert select_ssd("auto") is ssd_chunked
    monkeypatch.setattr(mamba_ssm_scan, "load_kernels", lambda: (loaded._replace(deterministic_mode=True), ""))
    assert select_ssd("mamba_ssm") is mamba_ssm_scan.chunk_scan
    assert select_ssd("auto") is mamba_ssm_scan.chunk_scan


class _Config:
    def __init__(self, block: int):
        self.block = block

    def __str__(self):
        return f"BLOCK_SIZE_M: {self.block}, num_warps: 4"


class _Autotuner:
    """What the kit reads of Triton's `Autotuner`: its configs and the choice cached for each key."""

    def __init__(self):
        self.configs = [_Config(32), _Config(64), _Config(128)]
        self.cache = {}


@pytest.fixture
def tuned_kernels(monkeypatch):
    """Two autotuned kernels in a module of mamba_ssm's kernel package, one of them tuned."""
    module = types.ModuleType(mamba_ssm_scan.KERNEL_PACKAGE + "onenode_test_kernels")
    module.scan_fwd, module.state_bwd, module.not_a_kernel = _Autotuner(), _Autotuner(), {"cache": {}}
    module.scan_fwd.cache[(128, 64, "torch.bfloat16")] = module.scan_fwd.configs[2]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    importer = types.ModuleType(mamba_ssm_scan.KERNEL_PACKAGE + "onenode_test_z_importer")
    importer.scan_fwd_imported = module.scan_fwd  # `from .onenode_test_kernels import scan_fwd`: one kernel, once
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    return module


def test_the_tiles_a_run_chose_are_taken_again_after_a_json_round_trip(tuned_kernels):
    tiles = json.loads(json.dumps(mamba_ssm_scan.chosen_tiles()))
    assert tiles == {"onenode_test_kernels.scan_fwd": [[[128, 64, "torch.bfloat16"], 2, str(_Config(128))]]}
    tuned_kernels.scan_fwd.cache.clear()
    mamba_ssm_scan.use_tiles(tiles)
    assert tuned_kernels.scan_fwd.cache == {(128, 64, "torch.bfloat16"): tuned_kernels.scan_fwd.configs[2]}
    assert tuned_kernels.state_bwd.cache == {}


@pytest.mark.parametrize("tiles, why", [
    ([], "not a record of chosen_tiles"),
    ({"onenode_test_kernels.scan_fwd": "all"}, "not a record of chosen_tiles"),
    ({"onenode_test_kernels.scan_fwd": [[[1], 0, "x"]] * (mamba_ssm_scan.MAX_TILES + 1)}, "at most"),
    ({"onenode_test_kernels.elsewhere": [[[128], 0, str(_Config(32))]]}, "not a config this mamba-ssm has"),
    ({"onenode_test_kernels.scan_fwd": [[[128], 3, str(_Config(32))]]}, "not a config this mamba-ssm has"),
    ({"onenode_test_kernels.scan_fwd": [[[128], 0, str(_Config(64))]]}, "not a config this mamba-ssm has"),
    ({"onenode_test_kernels.scan_fwd": [[128, 0, str(_Config(32))]]}, "not a config this mamba-ssm has"),
])
def test_tiles_this_install_does_not_have_are_refused_in_one_line_and_none_is_taken(tuned_kernels, tiles, why):
    good = [[[256], 1, str(_Config(64))]]
    record = {"onenode_test_kernels.state_bwd": good, **tiles} if isinstance(tiles, dict) else tiles
    with pytest.raises(ValueError, match=why) as info:
        mamba_ssm_scan.use_tiles(record)
    assert "\n" not in str(info.value) and tuned_kernels.state_bwd.cache == {}


def test_tiles_round_trip_through_tritons_own_autotuner(monkeypatch):
    """The same with a kernel as `triton.autotune` builds it (tuning needs a GPU: its cache is set by
    hand, keyed as Triton keys it, the `key` arguments' values then each tensor argument's dtype)."""
    triton = pytest.importorskip("triton", reason="make setup installs triton")

    @triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
                     key=["n"])
    @triton.jit
    def double(x_ptr, y_ptr, n, BLOCK: triton.language.constexpr):
        offsets = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
        triton.language.store(y_ptr + offsets, triton.language.load(x_ptr + offsets, mask=offsets < n) * 2,
                              mask=offsets < n)

    module = types.ModuleType(mamba_ssm_scan.KERNEL_PACKAGE + "onenode_test_triton")
    module.double = double
    monkeypatch.setitem(sys.modules, module.__name__, module)
    key = (100, "torch.float32", "torch.float32")
    double.cache[key] = double.configs[1]
    tiles = json.loads(json.dumps(mamba_ssm_scan.chosen_tiles()))
    assert tiles == {"onenode_test_triton.double": [[list(key), 1, str(double.configs[1])]]}
    assert "BLOCK: 32" in tiles["onenode_test_triton.double"][0][2]
    double.cache.clear()
    mamba_ssm_scan.use_tiles(tiles)
    assert double.cache == {key: double.configs[1]}
