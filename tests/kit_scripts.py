"""The kit's scripts (benchmarks/, cluster/, solutions/), loaded as modules for their tests."""

import importlib.util
import types
from pathlib import Path

KIT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> types.ModuleType:
    """The script at `relative` (from the kit's root) as a fresh module, its `__main__` block not run."""
    path = KIT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
