"""Test setup shared by every test: caches stay in the build tree, torch stays small and quiet."""

import os
from pathlib import Path

import pytest

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


ALL_CPUS = sorted(os.sched_getaffinity(0))


def _pin_this_worker() -> None:
    """Under pytest-xdist (`make test`: a worker per CPU, a file per worker), each worker on CPUs of
    its own: the grader pins a child to the first CPUs it may use, so without this every worker's
    gradings would share CPU 0 and time each other, while the other CPUs idle. Tests marked `dist`
    (several processes each) get every CPU back while they run (`_every_cpu_for_dist_tests`)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2 or len(ALL_CPUS) < count:
        return
    share = len(ALL_CPUS) // count
    mine = ALL_CPUS[int(worker.removeprefix("gw")) * share:][:share]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # torch's threads, here and in what the tests start


_pin_this_worker()


@pytest.fixture(autouse=True)
def _every_cpu_for_dist_tests(request):
    """A test of several processes (marked `dist`) runs on every CPU, not its worker's share."""
    if request.node.get_closest_marker("dist") is None or os.sched_getaffinity(0) == set(ALL_CPUS):
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def pytest_collection_modifyitems(items):
    """The files holding slow tests first: pytest-xdist hands out files in this order, so the long
    ones start at once instead of ending the run alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file's own order kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ONENODE_REQUIRE_SANDBOX=1 (CI: .ci/run), a sandbox test that skips because this machine
    lacks bubblewrap, root or its namespaces fails instead: CI must not pass on guarantees it never
    tested."""
    report = (yield).get_result()
    if report.skipped and os.environ.get("ONENODE_REQUIRE_SANDBOX") == "1" and item.path.name == "test_sandbox.py":
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome, report.longrepr = "failed", f"ONENODE_REQUIRE_SANDBOX=1, and the sandbox test skipped: {reason}"
