"""Run test code against `starter_code/` with some of the reference patches applied.

    tree = patched_tree(["1-moe"])                     # solutions/a1/parts/1-moe.patch, in order
    result = run_in_tree(tree, "test_moe_grouped:compare_with_loop", seed=0)

`patched_tree` builds a copy of the kit's `starter_code/` under `.cache/patched/` (keyed by the
patches' contents, so edits rebuild it) with `git apply`. `run_in_tree` calls a module-level
function of a test module in a fresh interpreter whose `onenode` is that copy (a test process
already imported the kit's own), and returns what it returned, through JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from onenode.data.corpus import cache_lock

KIT_ROOT = Path(__file__).resolve().parents[1]
TESTS = KIT_ROOT / "tests"
PARTS = KIT_ROOT / "solutions" / "a1" / "parts"
FULL_PATCH = KIT_ROOT / "solutions" / "a1" / "submission.patch"


def part_path(name: str) -> Path:
    return FULL_PATCH if name == "submission" else PARTS / f"{name}.patch"


def git_apply(tree: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess:
    """`git apply` in `tree` (not inside any enclosing repository)."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent.resolve()))
    return subprocess.run(["git", "apply", "--whitespace=nowarn", *extra, str(patch.resolve())],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=60)


def patched_tree(parts: list[str]) -> Path:
    """A folder holding `starter_code/` with `parts` applied in order ("submission" = the full patch)."""
    source = KIT_ROOT / "starter_code"
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*.py")):
        digest.update(str(path.relative_to(source)).encode() + path.read_bytes())
    for name in parts:
        digest.update(name.encode() + part_path(name).read_bytes())
    label = "+".join(parts) or "starter"
    tree = KIT_ROOT / ".cache" / "patched" / f"{label}-{digest.hexdigest()[:12]}"
    with cache_lock(f"patched-{label}"):  # test workers running at once build each copy once
        if not (tree / "starter_code").is_dir():
            _build(tree, source, parts)
    return tree


def _build(tree: Path, source: Path, parts: list[str]) -> None:
    for stale in tree.parent.glob(f"{tree.name.rsplit('-', 1)[0]}-*"):  # copies of older sources or patches
        shutil.rmtree(stale, ignore_errors=True)
    staging = tree.with_name(tree.name + ".tmp")
    shutil.copytree(source, staging / "starter_code", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in parts:
        result = git_apply(staging, part_path(name))
        if result.returncode != 0:
            raise RuntimeError(f"{part_path(name).name} does not apply after {parts}: {result.stderr.strip()}")
    staging.rename(tree)


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process whose `onenode` comes from `tree`."""
    path = [str(tree / "starter_code"), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))


_RUNNER = """
import importlib, json, sys
module, function = sys.argv[1].split(":")
kwargs = json.loads(sys.argv[2])
import onenode
assert onenode.__file__.startswith(sys.argv[3]), f"onenode came from {onenode.__file__}"
result = getattr(importlib.import_module(module), function)(**kwargs)
print("RESULT " + json.dumps(result))
"""


def run_in_tree(tree: Path, target: str, timeout: float = 600, **kwargs):
    """`module:function(**kwargs)` from tests/, run with `tree`'s onenode; its JSON-able result."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, target, json.dumps(kwargs), str(tree / "starter_code")],
        env=tree_env(tree), cwd=KIT_ROOT, capture_output=True, text=True, timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{target} in {tree.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])
