"""The fused update's Triton kernel (`train/adamw_kernel.py`), run by Triton's interpreter on a CPU
(and compiled on a GPU, where there is one), against `master_update._adamw`: the update a CPU runs
and inductor compiles.

Triton's interpreter casts float32 to bfloat16 by dropping bits (3.6's `cast_impl`); a GPU rounds to
the nearest even, as torch does. So on a CPU a bf16 copy may sit one bf16 step toward zero from its
master's rounding; on a GPU it must be that rounding exactly."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton", reason="the kernel's tests run Triton's interpreter: make setup installs triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from onenode.model import build_model, get_preset  # noqa: E402
from onenode.parallel import ParallelDims, parallelize  # noqa: E402
from onenode.train import adamw_kernel, adamw_triton, master_update  # noqa: E402
from onenode.train.step import build_optimizer  # noqa: E402

KIT_BLOCK, KIT_STEP = adamw_kernel.BLOCK, adamw_kernel.STEP  # the module's own (the tests run smaller ones)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="the compiled kernel runs on a GPU"))]


def _decorated_again() -> None:
    """`adamw_triton` imported again: `triton.jit` reads TRITON_INTERPRET when it decorates."""
    from onenode.train import adamw_triton

    importlib.reload(adamw_triton)
    adamw_kernel._cache.clear()


@pytest.fixture(autouse=True)
def interpreter(monkeypatch, request):
    """Triton's interpreter for the kernel on CPU tensors, a GPU's compiler for the `cuda` cases
    (and after the test, neither set); blocks of 128 elements updated 32 at a time, so a tensor
    spans several blocks and a block several steps."""
    callspec = getattr(request.node, "callspec", None)
    if (callspec.params.get("device") if callspec else "cpu") != "cuda":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(adamw_kernel, "BLOCK", 128)
    monkeypatch.setattr(adamw_kernel, "STEP", 32)
    _decorated_again()
    yield
    monkeypatch.undo()
    _decorated_again()


def _assert_copy_holds(copy: torch.Tensor, master: torch.Tensor) -> None:
    """The bf16 copy is its master rounded to the nearest (a GPU), or cut toward zero by at most
    one bf16 step (Triton's interpreter: the module docstring)."""
    if copy.is_cuda:
        assert torch.equal(copy, master.bfloat16())
        return
    cut = torch.where(master.bfloat16().float().abs() > master.abs(),
                      torch.nextafter(master.bfloat16(), torch.zeros_like(master.bfloat16())), master.bfloat16())
    assert torch.equal(copy, master.bfloat16()) or torch.equal(copy, cut)


# (gradient dtype, has a bf16 copy): one micro-batch's on the copies, a router's, several added up on the masters
GRADIENT_KINDS = [(torch.bfloat16, True), (torch.float32, False), (torch.float32, True)]


def _members(gen: torch.Generator, moments: torch.dtype, device: str = "cpu"):
    """Parameters of every kind the kit's model has: bf16 gradients and copies, float32 gradients
    and no copy (a router), float32 gradients and copies (several micro-batches' added up on the
    masters), sizes below, at and past a block, and one of a single element."""
    members = []
    for i, numel in enumerate([1, 31, 32, 33, 127, 128, 129, 300, 3 * 128, 7]):
        grad_dtype, has_copy = GRADIENT_KINDS[i % 3]
        param = torch.randn(numel, generator=gen)
        members.append({"param": param, "grad": (torch.randn(numel, generator=gen) * 0.1).to(grad_dtype),
                        "exp_avg": (torch.randn(numel, generator=gen) * 0.01).to(moments),
                        "exp_avg_sq": (torch.rand(numel, generator=gen) * 1e-4).to(moments),
                        "step": torch.tensor(float(i % 3)),  # parameters at different step counts
                        "copy": param.bfloat16() if has_copy else None})
    return [{k: None if v is None else v.to(device) for k, v in m.items()} for m in members]


def _run(update, members, lr=3e-3, coef=0.7):
    """`update` on clones of `members`, with their int8 scales and the codebooks where they have them."""
    cloned = [{k: None if v is None else v.clone() for k, v in m.items()} for m in members]
    columns = [[m[k] for m in cloned] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "step", "copy")]
    device = members[0]["param"].device
    int8 = ([[(m["exp_avg_scale"], m["exp_avg_sq_scale"]) for m in cloned], master_update.int8_codebooks(device)]
            if "exp_avg_scale" in cloned[0] else [])
    update(*columns, torch.tensor(lr, device=device), torch.tensor(coef, device=device), 0.9, 0.95, 1e-8, 0.1, *int8)
    return cloned


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_the_kernel_is_the_update_a_cpu_runs(moments, device):
    """Two steps of the kernel and of `_adamw` from the same state: masters, moments and step counts
    agree to float32 rounding, the copies hold the masters, and every element moved (a block the
    kernel missed would not)."""
    members = _members(torch.Generator().manual_seed(0), moments, device)
    kernel, reference = members, members
    for _ in range(2):
        kernel, reference = _run(adamw_kernel.adamw, kernel), _run(master_update._adamw, reference)
    for start, got, want in zip(members, kernel, reference):
        assert torch.equal(got["step"], want["step"]) and float(got["step"]) == float(start["step"]) + 2
        assert (got["param"] != start["param"]).all()
        # bf16 moments carry 8 bits: the interpreter's cut (module docstring) moves the second step by ~1%
        rounding = 1e-2 if moments == torch.bfloat16 else 1e-6
        moved = float((want["param"] - start["param"]).abs().max())
        assert torch.allclose(got["param"], want["param"], rtol=1e-6, atol=rounding * moved)
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[key].dtype == moments  # relative to the largest: lerp cancels
            bf16_steps = 2 ** -6 if moments == torch.bfloat16 else 0  # two bf16 steps: each step's rounding
            assert torch.allclose(got[key].float(), want[key].float(), rtol=bf16_steps,
                                  atol=rounding * float(want[key].float().abs().max())), key
        if start["copy"] is not None:
            _assert_copy_holds(got["copy"], got["param"])


def test_the_tables_follow_the_tensors():
    """A launch over new tensors at other addresses updates those, not the ones of the last launch:
    the tables are looked up by address and size."""
    gen = torch.Generator().manual_seed(1)
    first, second = _members(gen, torch.float32), _members(gen, torch.float32)
    updated_first = _run(adamw_kernel.adamw, first)
    updated_second = _run(adamw_kernel.adamw, second)
    reference = _run(master_update._adamw, second)
    for got, want in zip(updated_second, reference):
        assert torch.allclose(got["param"], want["param"], rtol=1e-6, atol=1e-7)
    assert not torch.equal(updated_first[0]["param"], updated_second[0]["param"])


def test_the_offsets_are_each_tensors_distance_from_its_roles_first():
    """`_offsets`' table, computed over all tensors at once: each tensor's elements from its role's
    first tensor (before it too), in units of the largest power of two up to 16 dividing a role's
    offsets; a tensor that starts inside an element of its role's first is refused in one line."""
    floats, halves = torch.zeros(4096), torch.zeros(4096, dtype=torch.bfloat16)
    starts = [[800, 16, 1600, 3200], [64, 0, 96, 32], [100, 102, 96, 98]]  # roles: float32, float32, bf16
    rows = [[pool[s:s + 8] for s in role] for pool, role in zip((floats, floats, halves), starts)]
    adamw_kernel._cache.clear()
    offsets = adamw_kernel._offsets(rows)
    assert offsets.align == (16, 16, 2)
    want = [[(s - role[0]) // align for s in role] for role, align in zip(starts, (16, 16, 2))]
    assert offsets.table.tolist() == [list(column) for column in zip(*want)]
    buffer = bytearray(64)
    aligned, one_byte_in = (torch.frombuffer(buffer, dtype=torch.bfloat16, count=8, offset=k) for k in (0, 1))
    with pytest.raises(ValueError, match="whole element"):
        adamw_kernel._offsets([[aligned, one_byte_in]])


def test_the_kit_step_through_the_kernel_matches_the_cpu_step(monkeypatch):
    """`clip_and_update` with `KernelUpdate` (a GPU's update) on the tiny model in bf16: one launch
    per parameter group and kind of parameter (a group is one call, not chunks), and the
    masters agree with the CPU's `_adamw` to float32 rounding after three steps."""
    monkeypatch.setattr(adamw_kernel, "BLOCK", 4096)  # the interpreter runs each step in Python
    monkeypatch.setattr(adamw_kernel, "STEP", 4096)
    config = get_preset("tiny")
    launches = []
    launch = adamw_kernel._launch
    monkeypatch.setattr(adamw_kernel, "_launch", lambda columns, *rest: launches.append(len(columns[0]))
                        or launch(columns, *rest))

    def train(update):
        parallel = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=torch.bfloat16)
        optimizer = build_optimizer(parallel, lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            for master in parallel.parameters():
                holder = parallel.master_weights.copy_of.get(id(master), master)
                holder.grad = torch.randn(master.shape, generator=gen).mul_(0.1).to(holder.dtype)
            master_update.clip_and_update(parallel.master_weights, optimizer, 0.5, update=update)
        return parallel, optimizer

    kernel, optimizer = train(master_update.KernelUpdate())
    reference, _ = train(master_update.ChunkedUpdate(master_update._adamw))
    for (name, got), want in zip(kernel.named_parameters(), reference.parameters()):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), name
    kinds = {(index, id(param) in kernel.master_weights.copy_of)
             for index, group in enumerate(optimizer.param_groups) for param in group["params"]}
    chunks = sum(-(-len(group["params"]) // master_update.CHUNK) for group in optimizer.param_groups)
    assert len(launches) == 3 * len(kinds) < 3 * chunks, (launches, kinds, chunks)
    assert sum(launches) == 3 * sum(len(group["params"]) for group in optimizer.param_groups)


def test_the_kernel_leaves_strided_tensors_to_the_compiled_update(monkeypatch):
    """Tensors that are not contiguous are not the kernels': `KernelUpdate` puts the members they
    take (float moments and int8 codes) in one call of `adamw_kernel.adamw`, and hands the others to
    the compiled `_adamw` in chunks of `CHUNK`."""
    compiled = object()
    monkeypatch.setattr(master_update, "compiled_update", lambda: compiled)
    monkeypatch.setattr(master_update, "CHUNK", 2)

    def member(moments: torch.dtype, strided: bool = False):
        param = torch.randn(8, 4).t() if strided else torch.randn(4, 8)
        state = {"exp_avg": torch.zeros(4, 8, dtype=moments), "exp_avg_sq": torch.zeros(4, 8, dtype=moments),
                 "step": torch.tensor(0.0)}
        return param, param.bfloat16(), state, None

    taken = [member(torch.float32) for _ in range(3)] + [member(torch.uint8) for _ in range(2)]
    others = [member(torch.float32, strided=True) for _ in range(2)] + [member(torch.uint8, strided=True)]
    calls = master_update.KernelUpdate().calls(others[:2] + taken + others[2:])
    assert [(run, len(members)) for run, members, _ in calls] == [(adamw_kernel.adamw, 5), (compiled, 2), (compiled, 1)]
    assert [id(m[0]) for m in calls[0][1]] == [id(m[0]) for m in taken]
    assert {id(m[0]) for _, members, _ in calls[1:] for m in members} == {id(m[0]) for m in others}


def _int8_members(gen: torch.Generator, device: str = "cpu"):
    """Parameters with int8 moments, of row lengths below, at and past a block (`INT8_BLOCK`, 256),
    of two and three dimensions, of each of `GRADIENT_KINDS`; their moments
    the codes of random values (`_encode`), at different step counts."""
    book_m, book_v = master_update.int8_codebooks(torch.device("cpu"))
    members = []
    for i, shape in enumerate([(3, 5), (2, 256), (3, 300), (2, 2, 513), (1, 7), (5, 1024)]):
        grad_dtype, has_copy = GRADIENT_KINDS[i % 3]
        param = torch.randn(shape, generator=gen)
        state = {"param": param, "grad": (torch.randn(shape, generator=gen) * 0.1).to(grad_dtype),
                 "step": torch.tensor(float(1 + i % 3)), "copy": param.bfloat16() if has_copy else None}
        for key, book, values, toward_zero in (("exp_avg", book_m, torch.randn(shape, generator=gen) * 0.01, True),
                                               ("exp_avg_sq", book_v, torch.rand(shape, generator=gen) * 1e-4, False)):
            codes, scale = torch.empty(shape, dtype=torch.uint8), master_update._zero_scales(param)
            master_update._encode(values, codes, scale, book, toward_zero=toward_zero)
            state[key], state[key + "_scale"] = codes, scale
        members.append(state)
    return [{k: None if v is None else v.to(device) for k, v in m.items()} for m in members]


@pytest.mark.parametrize("device", DEVICES)
def test_the_int8_kernel_is_the_update_a_cpu_runs(device, monkeypatch):
    """Three steps of the int8 kernel and of `_adamw` from the same codes: the masters agree to
    float32 rounding, the scales too, each code is the reference's or next to it (a value on a code's
    boundary may round either way), nearly all are equal; the copies hold the masters, every element
    moved, and a tensor's padding outside its rows is never written."""
    monkeypatch.setattr(adamw_kernel, "INT8_BLOCKS", 4)  # a tensor spans several programs,
    monkeypatch.setattr(adamw_kernel, "INT8_TILE", 2)  # each in two tiles
    members = _int8_members(torch.Generator().manual_seed(0), device)
    kernel, reference = members, members
    for _ in range(3):
        kernel, reference = _run(adamw_kernel.adamw, kernel), _run(master_update._adamw, reference)
    differing = 0
    for start, got, want in zip(members, kernel, reference):
        assert torch.equal(got["step"], want["step"])
        assert (got["param"] != start["param"]).all()
        assert torch.allclose(got["param"], want["param"], rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[key].dtype == torch.uint8 and got[key].shape == start[key].shape
            assert torch.allclose(got[key + "_scale"], want[key + "_scale"], rtol=1e-5, atol=0), key
            step = (got[key].int() - want[key].int()).abs()
            assert int(step.max()) <= 1, key
            differing += int(step.sum())
        if start["copy"] is not None:
            _assert_copy_holds(got["copy"], got["param"])
    assert differing <= sum(m["param"].numel() for m in members) // 100, differing


@pytest.mark.parametrize("signed", [True, False])
def test_the_int8_kernels_codes_are_bucketize(signed):
    """`adamw_triton.codes_below`, the map's formula and two gathers, is torch.bucketize's index on
    every value of the map, on the floats next to each, on values between, on 0 and +-1 and on values
    far below the map's smallest: where the formula lands one off (a value on a boundary), the
    gathers must settle it."""
    @triton.jit
    def codes_of(x_ptr, out_ptr, book, n, SIGNED: tl.constexpr, WIDTH: tl.constexpr):
        at = tl.program_id(0) * WIDTH + tl.arange(0, WIDTH)
        x = tl.load(x_ptr + at, mask=at < n, other=0.0)
        tl.store(out_ptr + at, adamw_triton.codes_below(x, book, SIGNED), mask=at < n)

    book = master_update.int8_codebooks(torch.device("cpu"))[0 if signed else 1]
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([book, torch.nextafter(book, torch.full_like(book, 2.0)),
                   torch.nextafter(book, torch.full_like(book, -2.0)), (book[1:] + book[:-1]) / 2,
                   torch.tensor([0.0, 1.0, -1.0, 1e-9, -1e-9, 1e-30, 0.1, 1e-6, 1e-7]),
                   torch.rand(4096, generator=gen) ** 12, torch.rand(1024, generator=gen)])
    x = x.clamp(-1.0, 1.0) if signed else x.abs().clamp(max=1.0)
    got = torch.empty(x.shape, dtype=torch.int32)
    codes_of[(-(-len(x) // 256),)](x, got, book, len(x), SIGNED=signed, WIDTH=256)
    want = torch.bucketize(x, book, out_int32=True)
    assert torch.equal(got, want), (x[got != want], got[got != want], want[got != want])


def test_the_int8_kernel_writes_only_its_tensors(monkeypatch):
    """Tensors with int8 moments laid out in one buffer per role, each followed by elements no tensor
    owns: a launch over them updates each tensor as `_adamw` does and leaves the elements between
    untouched (a block past a row's end, or a program past a tensor's last block, would write them)."""
    monkeypatch.setattr(adamw_kernel, "INT8_BLOCKS", 4)
    members = [{**m, "grad": m["grad"].bfloat16()} for m in _int8_members(torch.Generator().manual_seed(3))]
    gap, buffers = 9, {}
    for key in ("param", "grad", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        first = members[0][key]
        buffer = torch.full((sum(m[key].numel() + gap for m in members),), 77, dtype=first.dtype)
        at = 0
        for m in members:
            m[key] = buffer[at:at + m[key].numel()].view(m[key].shape).copy_(m[key])
            at += m[key].numel() + gap
        buffers[key] = buffer
    want = _run(master_update._adamw, members)
    columns = [[m[k] for m in members] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "step", "copy")]
    adamw_kernel.adamw(*columns, torch.tensor(3e-3), torch.tensor(0.7), 0.9, 0.95, 1e-8, 0.1,
                       [(m["exp_avg_scale"], m["exp_avg_sq_scale"]) for m in members],
                       master_update.int8_codebooks(torch.device("cpu")))
    for got, reference in zip(members, want):
        assert torch.allclose(got["param"], reference["param"], rtol=1e-6, atol=1e-7)
    for key, buffer in buffers.items():
        owned = torch.zeros(buffer.shape, dtype=torch.bool)
        at = 0
        for m in members:
            owned[at:at + m[key].numel()] = True
            at += m[key].numel() + gap
        assert (buffer[~owned] == 77).all(), key


def test_a_gpu_launcher_binds_the_kernels_arguments(monkeypatch):
    """The arguments `adamw` launches the kernel with, bound as a GPU's launcher binds them
    (Triton's binder for an H100/H200 target; the interpreter skips it): each argument takes a
    type Triton can specialize. An argument named `params` failed every GPU launch."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as e:
        pytest.skip(f"this Triton's launcher is laid out otherwise: {e}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _decorated_again()
    kernel = adamw_kernel._kernel()
    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32)))
    bound = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **options: bound.append(binder(*args, **options))

    monkeypatch.setattr(adamw_kernel, "_kernel", lambda: Launcher())
    members = _members(torch.Generator().manual_seed(2), torch.bfloat16)
    _run(adamw_kernel.adamw, members)
    assert len(bound) == len(GRADIENT_KINDS)  # a launch a kind
    for _, specialization, options in bound:
        assert options["num_warps"] == adamw_kernel.NUM_WARPS and len(specialization) == len(kernel.params)
        assert ("constexpr", adamw_kernel.BLOCK) in specialization


def test_the_kernel_compiles_for_a_hopper_gpu_with_few_registers_and_vector_loads(monkeypatch):
    """The kernel compiled for sm_90 on this CPU (Triton ships its compiler and ptxas), for every
    kind of parameter: it compiles, spills nothing, loads and stores a whole block in 16-byte
    vectors, and takes few registers, so several programs share an SM (one program an SM, at 214
    registers, ran the update 40% slower than inductor's on one H200). The int8 kernel, bound by its
    arithmetic rather than its loads, must compile without spills and load and store in vectors too."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "adamw_kernel_ptx.py"
    spec = importlib.util.spec_from_file_location("adamw_kernel_ptx", path)
    ptx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ptx)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _decorated_again()
    try:
        rows = [ptx.facts(kind, KIT_BLOCK, KIT_STEP, adamw_kernel.NUM_WARPS) for kind in ptx.KINDS]
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"this Triton compiles otherwise or ships no ptxas: {e}")
    for row in rows:
        assert not row["spills"] and row["registers"] <= 64, row
        assert row["vector_loads"] >= 3 and row["vector_stores"] >= 3, row
    int8 = ptx.facts("int8", adamw_kernel.INT8_BLOCKS, adamw_kernel.INT8_TILE, adamw_kernel.INT8_NUM_WARPS)
    assert not int8["spills"] and int8["vector_loads"] >= 3 and int8["vector_stores"] >= 3, int8  # int8's kernel
