"""Bytes that `torch.distributed` collectives move, per family: the evidence for A1 part 2.

The public tests use it, and so does the grader's harness: the grader copies this file from the
kit (never from a submission) beside its harness, so a patched copy cannot change what it counts.
"""

from __future__ import annotations

import inspect
import threading

# Collectives whose bytes are counted: name -> (family, name of the tensor argument that moved).
COLLECTIVES = {
    "all_gather": ("all_gather", "tensor_list"), "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"), "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists"),
    "reduce_scatter": ("reduce_scatter", "input_list"), "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"), "all_to_all_single": ("all_to_all", "input"),
    "all_reduce": ("all_reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
}


class CollectiveCounter:
    """Bytes each rank receives per collective family, counted by wrapping `torch.distributed`.

    A rank of an n-rank group receives (n-1)/n of an all-gather's output, of a reduce-scatter's
    or all-to-all's input; twice that for an all-reduce (ring). So a group of one moves nothing.
    Installed before `onenode` is imported, so module-level `from torch.distributed import ...`
    in the submission gets the wrappers too. Nested calls (one public collective implemented by
    another) count once. The harness's own bookkeeping runs inside `paused()`.
    """

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.bytes: dict[str, int] = {}
        self._local = threading.local()
        for name, (family, arg_name) in COLLECTIVES.items():
            original = getattr(c10d, name, None)
            if original is None or arg_name not in inspect.signature(original).parameters:
                continue
            wrapper = self._wrap(original, family, arg_name)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)

    def _wrap(self, fn, family: str, arg_name: str):
        import torch.distributed as dist

        signature = inspect.signature(fn)
        factor = 2 if family == "all_reduce" else 1

        def counted(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0 and not getattr(self._local, "paused", False):
                bound = signature.bind_partial(*args, **kwargs).arguments
                n = dist.get_world_size(bound.get("group"))
                moved = factor * _nbytes(bound.get(arg_name)) * (n - 1) // n
                self.bytes[family] = self.bytes.get(family, 0) + moved
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__wrapped__ = fn
        return counted

    def take(self) -> dict[str, int]:
        out, self.bytes = self.bytes, {}
        return out

    def paused(self):
        counter = self

        class _Paused:
            def __enter__(self):
                counter._local.paused = True

            def __exit__(self, *exc):
                counter._local.paused = False

        return _Paused()


def _nbytes(obj) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return obj.numel() * obj.element_size() if hasattr(obj, "element_size") else 0
