"""Test setup shared by every test: caches stay in the build tree, torch stays small and quiet."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CACHE = ROOT / ".cache"
for var, sub in {
    "HF_HOME": "hf", "XDG_CACHE_HOME": "xdg", "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton", "MPLCONFIGDIR": "matplotlib", "IPYTHONDIR": "ipython",
    "JUPYTER_CONFIG_DIR": "jupyter/config", "JUPYTER_DATA_DIR": "jupyter/data",
    "JUPYTER_RUNTIME_DIR": "jupyter/runtime", "ONENODE_CACHE": "onenode",
}.items():
    os.environ.setdefault(var, str(_CACHE / sub))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
