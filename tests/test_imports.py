"""Every module of `grader` and `onenode` imports on its own, and neither package has an import
cycle: none at import time (each module imported alone in a fresh process, as by
`python -c "import X"`) and none in its code at all (a graph of every import inside the package,
those inside functions too: a lazy import that closes a cycle still ties two modules together)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"grader": ROOT / "grader", "onenode": ROOT / "starter_code" / "onenode"}
SEARCH_PATH = [ROOT / "starter_code", ROOT]
# Modules run as scripts, with what they import copied beside them (grader/runner.py's Harness).
BESIDE = {"grader.a1.harness": [ROOT / "a1_infra" / "tests"]}


def modules(package: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package folder `package`."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its code."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module or "") if p)
            # `from pkg import name` imports the submodule pkg.name if there is one, else pkg
            found |= {f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                      for alias in node.names}
    return (found & known.keys()) - {name}


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every group of modules that import each other, directly or around a loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.add(tuple(sorted(group)))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def static_cycles(package: Path) -> set[tuple[str, ...]]:
    known = modules(package)
    return cycles({name: imports(name, path, known) for name, path in known.items()})


# A fresh interpreter per module, without paying for torch each time (seconds, most modules import
# it): this one loads torch, nothing of the kit, then forks a child per module name on stdin, as
# many at a time as there are cores; the child imports that module alone and answers
# "name<TAB>ok" or "name<TAB>the error's last line" in one os.write of under PIPE_BUF bytes, so
# lines from children running at once never interleave (print() may write the text and its newline
# apart: under PYTHONUNBUFFERED it does).
IMPORT_SERVER = """
import importlib, os, sys, traceback
import torch
running = 0
for line in sys.stdin:
    name = line.strip()
    if os.fork() == 0:
        try:
            importlib.import_module(name)
            answer = "ok"
        except BaseException:
            answer = traceback.format_exc().strip().splitlines()[-1]
        os.write(1, f"{name}\t{answer[:2000]}\\n".encode())
        os._exit(0)
    running += 1
    if running >= (os.cpu_count() or 1):
        os.wait()
        running -= 1
while running:
    os.wait()
    running -= 1
"""


def import_alone(names: list[str], search_path: list[Path]) -> dict[str, str]:
    """name -> the error's last line, for each module of `names` that does not import on its own."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, search_path)))
    done = subprocess.run([sys.executable, "-c", IMPORT_SERVER], input="".join(f"{n}\n" for n in names), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    answers = dict(line.split("\t", 1) for line in done.stdout.splitlines() if "\t" in line)
    return {name: answers.get(name, f"no answer: {done.stderr.strip()[-300:]}") for name in names
            if answers.get(name) != "ok"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_in_the_code(package):
    found = static_cycles(PACKAGES[package])
    assert not found, f"modules of {package} that import each other: {sorted(found)}"


@pytest.mark.slow  # about 20 s: a fork and a fresh import per module
def test_every_module_imports_on_its_own():
    names = [name for package in PACKAGES.values() for name in modules(package) if name not in BESIDE]
    failed = import_alone(names, SEARCH_PATH)
    for name, beside in BESIDE.items():
        failed.update(import_alone([name], SEARCH_PATH + beside))
    assert not failed, f"modules that do not import on their own: {failed}"


def test_the_checks_find_a_cycle(tmp_path):
    """A package whose modules import each other, one of them only inside a function."""
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import B\nA = 1\n")
    (package / "b.py").write_text("B = 2\n\n\ndef f():\n    from loop import a\n    return a.A\n")
    assert static_cycles(package) == {("loop.a", "loop.b")}
    assert import_alone(["loop.a", "loop.b"], [tmp_path]) == {}  # the lazy import does not fail at import time
    (package / "b.py").write_text("from loop.a import A\nB = 2\n")
    assert "partially initialized module" in import_alone(["loop.b", "loop.a"], [tmp_path])["loop.a"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(name: str, path: Path, known: dict[str, Path]) -> list[str]:
    """`module._name` uses in module `name` of another kit module's private names (from-imports
    of them, or attributes read through an imported module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    aliases: dict[str, str] = {}  # local name -> the kit module it is bound to
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in known})
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                if f"{module}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif module in known and module != name and _private(alias.name):
                    found.append(f"{module}.{alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _private(node.attr) and aliases[node.value.id] != name):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    """A private name stays inside its module: what another module needs is public, named for what
    it is (benchmarks' probes included: they set options rather than patch internals)."""
    known = {**modules(PACKAGES["grader"]), **modules(PACKAGES["onenode"])}
    users = dict(known)
    users.update({f"benchmarks.{p.stem}": p for p in sorted((ROOT / "benchmarks").glob("*.py"))})
    uses = {name: private_uses(name, path, known) for name, path in users.items()}
    assert not {name: found for name, found in uses.items() if found}


def test_private_uses_sees_both_forms(tmp_path):
    """The check above finds a from-import of a private name and an attribute read through a module."""
    source = tmp_path / "probe.py"
    source.write_text("from onenode.parallel import fsdp\nfrom onenode.model.hf_io import _x\nfsdp._layers\n")
    known = modules(PACKAGES["onenode"])
    assert sorted(private_uses("benchmarks.probe", source, known)) == ["onenode.model.hf_io._x",
                                                                       "onenode.parallel.fsdp._layers"]
