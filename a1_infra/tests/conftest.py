"""Public A1 tests: run from the kit root against whatever `starter_code/` holds.

    .venv/bin/python -m pytest a1_infra/tests -q          # all parts
    .venv/bin/python -m pytest a1_infra/tests/test_part1_moe.py -q

The unpatched starter fails them on purpose: each failure says what was expected and what was
measured. The kit's `tests/` folder provides the gloo process runner they share.
"""

import runpy
import sys
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(KIT_ROOT / "tests"))  # dist_utils
runpy.run_path(str(KIT_ROOT / "tests" / "conftest.py"))  # the kit's settings: caches in .cache/, offline hubs
