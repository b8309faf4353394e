"""mamba_ssm's Triton SSD, loaded without the package's CUDA extension and wrapped as a torch op.

The kit needs one kernel of mamba-ssm, the Triton `mamba_chunk_scan_combined`, which builds no
CUDA extension. The package's `__init__` imports one (`selective_scan_cuda`), so a Triton-only
install (`make mamba-ssm`, which sets `MAMBA_SKIP_CUDA_BUILD`: seconds instead of a long nvcc
build) fails `import mamba_ssm`. `load_kernels` imports the SSD's own module with that `__init__`
skipped, and works the same where the full package is built.

`chunk_scan` is the kernel as a `torch.library` custom op with its backward registered: a
compiled block sees one opaque op with declared output shapes, where tracing into the Triton
launches and the package's `autograd.Function` would break the graph.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

INSTALL_HINT = "install it with `make mamba-ssm` (its Triton kernels alone; README.md)"


class KernelUnavailableError(RuntimeError):
    """The scan asked for cannot run here; the message says what to install or set instead."""


class Kernels(NamedTuple):
    """forward(x, dt, A, B, C, chunk_size, D) -> y; backward(dy, x, dt, A, B, C, y, chunk_size, D) ->
    (dx, ddt, dA, dB, dC, dD). `deterministic_mode`: whether this mamba-ssm has one (2.3 and later)."""

    forward: object
    backward: object
    deterministic_mode: bool = False


def import_skipping_package_init(module: str) -> types.ModuleType:
    """Import `module` (a dotted name) without running its top-level package's `__init__`, unless
    that package is imported already. The stand-in package is removed afterwards, so a later
    `import` of the package runs its real `__init__` (and fails or succeeds as it would have)."""
    package = module.partition(".")[0]
    if package in sys.modules:
        return importlib.import_module(module)
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        raise ModuleNotFoundError(f"No module named '{package}'", name=package)
    stand_in = types.ModuleType(package)
    stand_in.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = stand_in
    try:
        return importlib.import_module(module)
    finally:
        if sys.modules.get(package) is stand_in:
            del sys.modules[package]


@functools.cache
def load_kernels() -> tuple[Kernels | None, str]:
    """mamba_ssm's SSD forward and backward, or None and why they did not import.

    Every kernel keeps all its autotune configs, in mamba-ssm's deterministic mode too (which would
    otherwise keep the smallest tiles of each, about 5% of the A2 step: TRITON_CACHE_AUTOTUNING=1 tells
    it so, and has Triton >= 3.4 keep each choice on disk): a run records the tiles it chose with its
    checkpoints (`chosen_tiles`), and a resumed or replayed span takes them again (`use_tiles`)."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    try:
        with warnings.catch_warnings():
            # where Triton < 3.4 cannot cache, mamba-ssm's deterministic mode keeps one config a kernel and says so
            warnings.filterwarnings("ignore", message="Deterministic mode: ")
            ssd = import_skipping_package_init("mamba_ssm.ops.triton.ssd_combined")
    except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
        return None, f"{type(e).__name__}: {e}"
    return kernels_of(ssd), ""


def kernels_of(ssd: types.ModuleType) -> Kernels:
    """The scan's pair from mamba_ssm's `ssd_combined` module, as imported."""

    def forward(x, dt, A, B, C, chunk_size, D):
        return ssd._mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk_size, D=D)[0]

    def backward(dy, x, dt, A, B, C, y, chunk_size, D):
        return ssd._mamba_chunk_scan_combined_bwd(dy, x, dt, A, B, C, y, chunk_size, D=D)[:6]

    # mamba-ssm >= 2.3 (its utils/determinism.py): under torch's deterministic algorithms its backward
    # sums per-tile partials where it added with atomics
    return Kernels(forward, backward, hasattr(ssd, "use_deterministic_mode"))


def why_not_deterministic(loaded: Kernels) -> str:
    """Why `loaded` may give other bits on another run under torch's deterministic algorithms, or ""."""
    if not loaded.deterministic_mode:
        return ("this mamba-ssm has no deterministic backward (it adds with atomics, in no fixed order): "
                "install mamba-ssm >= 2.3 (`make mamba-ssm`)")
    return ""


KERNEL_PACKAGE = "mamba_ssm.ops.triton."
MAX_TILES = 4096  # choices a run may record: about 25 kernels, one key each in practice


def autotuned_kernels() -> dict[str, object]:
    """mamba_ssm's autotuned Triton kernels imported so far, each once, by module and name (the first
    in sorted order where one module imports another's): Triton's `Autotuner`s, each with its
    `configs` and its `cache` of the config chosen for each key (constants, then dtypes)."""
    found = {}
    for name, module in sorted(sys.modules.items()):
        if name.startswith(KERNEL_PACKAGE) and module is not None:
            for attr, value in sorted(vars(module).items()):
                tuned = isinstance(getattr(value, "cache", None), dict) and isinstance(getattr(value, "configs", None),
                                                                                      list)
                if tuned and all(value is not seen for seen in found.values()):
                    found[f"{name[len(KERNEL_PACKAGE):]}.{attr}"] = value
    return found


def chosen_tiles() -> dict[str, list]:
    """Each autotuned kernel's choices so far, {kernel: [[key, index into its configs, the config as
    Triton prints it], ...]}: what a replay needs to sum in the same order. {} before any ran."""
    tiles = {}
    for name, kernel in autotuned_kernels().items():
        chosen = [[list(key), kernel.configs.index(config), str(config)] for key, config in kernel.cache.items()
                  if config in kernel.configs and all(isinstance(part, (int, float, str)) for part in key)]
        if chosen:
            tiles[name] = sorted(chosen, key=repr)
    return tiles


def use_tiles(tiles: object) -> None:
    """Take the choices `chosen_tiles` recorded, so that these kernels do not tune again. Raises
    ValueError (one line) where they name a kernel or a config this install does not have."""
    if not isinstance(tiles, dict) or not all(isinstance(chosen, list) for chosen in tiles.values()) \
            or sum(map(len, tiles.values())) > MAX_TILES:
        raise ValueError(f"kernel_tiles: not a record of chosen_tiles (a mapping of kernels to at most {MAX_TILES} "
                         "[key, index, config] entries in all)")
    kernels = autotuned_kernels()
    entries = [(name, entry) for name, chosen in tiles.items() for entry in chosen]
    for name, entry in entries:
        kernel = kernels.get(name)
        ok = (kernel is not None and isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list)
              and isinstance(entry[1], int) and 0 <= entry[1] < len(kernel.configs)
              and str(kernel.configs[entry[1]]) == entry[2])
        if not ok:
            raise ValueError(f"kernel_tiles: {name} {entry!r:.120} is not a config this mamba-ssm has: "
                             "install the mamba-ssm and Triton the run trained with (its manifest's versions)")
    for name, (key, index, _) in entries:
        kernels[name].cache[tuple(key)] = kernels[name].configs[index]


def kernels() -> Kernels:
    """The kernels the ops run (tests swap in a stand-in)."""
    loaded, why_not = load_kernels()
    if loaded is None:
        raise KernelUnavailableError(f"mamba_ssm's Triton SSD does not import ({why_not}): {INSTALL_HINT}")
    return loaded


@torch.library.custom_op("onenode::mamba_ssm_chunk_scan", mutates_args=())
def _chunk_scan_op(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor) -> Tensor:
    return kernels().forward(x, dt, A, B, C, chunk_size, D).contiguous()


@_chunk_scan_op.register_fake
def _(x, dt, A, B, C, chunk_size, D):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("onenode::mamba_ssm_chunk_scan_backward", mutates_args=())
def _chunk_scan_backward_op(dy: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, y: Tensor,
                            chunk_size: int, D: Tensor) -> list[Tensor]:
    grads = kernels().backward(dy, x, dt, A, B, C, y, chunk_size, D)
    # Each gradient in its input's dtype and layout, as declared below, whatever the kernel returns.
    return [g.to(like.dtype).contiguous() for g, like in zip(grads, (x, dt, A, B, C, D))]


@_chunk_scan_backward_op.register_fake
def _(dy, x, dt, A, B, C, y, chunk_size, D):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, dt, A, B, C, D)]


def _setup_context(ctx, inputs, output):
    x, dt, A, B, C, chunk_size, D = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, output)
    ctx.chunk_size = chunk_size


def _backward(ctx, dy):
    x, dt, A, B, C, D, y = ctx.saved_tensors
    dx, ddt, dA, dB, dC, dD = _chunk_scan_backward_op(dy.contiguous(), x, dt, A, B, C, y, ctx.chunk_size, D)
    return dx, ddt, dA, dB, dC, None, dD


_chunk_scan_op.register_autograd(_backward, setup_context=_setup_context)


def chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
               D: Tensor | None = None) -> Tensor:
    """`ssd_chunked`'s signature and result, computed by mamba_ssm's kernel."""
    if D is None:
        D = x.new_zeros(x.shape[2], dtype=torch.float32)
    return _chunk_scan_op(x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), chunk_size, D)
