"""The reference A1 fixes are code in `solutions/a1/onenode/`; the patches are generated from it.

    python solutions/a1/make_patches.py write   # rewrite parts/*.patch and submission.patch from the tree
    python solutions/a1/make_patches.py check   # exit 1 if the stored patches are not what the tree gives
    python solutions/a1/make_patches.py copy /tmp/fixed   # /tmp/fixed/starter_code: the fixed stack, to run

`solutions/a1/onenode/` mirrors `starter_code/onenode/` and holds only the files the fix changes,
each in full. Each part owns its files (`PARTS`; the parts touch disjoint files, so each applies
alone); its patch is `git diff` of those files, starter against tree. `submission.patch` is the
parts concatenated in order, so applying the parts one after the other gives exactly its tree.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KIT_ROOT = HERE.parents[1]
TREE = HERE / "onenode"
PATCHES = HERE / "parts"
FULL = HERE / "submission.patch"
# part -> the files it owns, relative to onenode/ (in the starter and in the tree alike)
PARTS = {
    "1-moe": ["model/moe.py"],
    "2-ep": ["parallel/expert_parallel.py"],
    "3-pp": ["parallel/pipeline.py"],
}


def file_diff(path: str) -> str:
    """`git diff` of one owned file, starter against tree, with a/ b/ paths from the kit root."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a").symlink_to(KIT_ROOT)
        (Path(tmp) / "b" / "starter_code").mkdir(parents=True)
        (Path(tmp) / "b" / "starter_code" / "onenode").symlink_to(TREE)
        name = f"starter_code/onenode/{path}"
        old = f"a/{name}" if (KIT_ROOT / name).exists() else "/dev/null"
        # every option that git config could change is spelled out, so any machine writes the same bytes
        options = ["--no-ext-diff", "--no-color", "--diff-algorithm=myers", "--indent-heuristic", "-U3", "--abbrev=7"]
        result = subprocess.run(["git", "diff", "--no-index", "--no-prefix", *options, old, f"b/{name}"],
                                cwd=tmp, capture_output=True, text=True)
    if result.returncode not in (0, 1):
        sys.exit(f"git diff failed for {path}: {result.stderr.strip()}")
    return result.stdout


def generated() -> dict[Path, str]:
    """Every patch file's text as the tree gives it: the parts, then the full patch."""
    unowned = sorted({str(p.relative_to(TREE)) for p in TREE.rglob("*.py")} - {f for fs in PARTS.values() for f in fs})
    if unowned:
        sys.exit(f"solutions/a1/onenode/{unowned[0]} belongs to no part: add it to PARTS in {Path(__file__).name}")
    parts = {PATCHES / f"{name}.patch": "".join(file_diff(path) for path in files) for name, files in PARTS.items()}
    return {**parts, FULL: "".join(parts.values())}


def write() -> None:
    PATCHES.mkdir(exist_ok=True)
    for patch, text in generated().items():
        patch.write_text(text)
        print(f"{patch.relative_to(KIT_ROOT)}: {text.count('diff --git')} file(s)")


def check() -> int:
    stale = [patch for patch, text in generated().items() if not patch.is_file() or patch.read_text() != text]
    for patch in stale:
        print(f"{patch.relative_to(KIT_ROOT)} is not what solutions/a1/onenode/ gives: "
              f"run python solutions/a1/make_patches.py write")
    return 1 if stale else 0


def copy(dest: Path) -> None:
    """`dest/starter_code`: the starter with the fixed files in place (PYTHONPATH=dest/starter_code runs it)."""
    if (dest / "starter_code").exists():
        sys.exit(f"{dest}/starter_code exists: remove it or pick another folder")
    shutil.copytree(KIT_ROOT / "starter_code", dest / "starter_code",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    shutil.copytree(TREE, dest / "starter_code" / "onenode", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    print(f"{dest}/starter_code: the starter with solutions/a1/onenode/ in place")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("write", help="rewrite parts/*.patch and submission.patch from the tree")
    sub.add_parser("check", help="exit 1 if the stored patches are not what the tree gives")
    sub.add_parser("copy", help="the starter with the fixed files in place, in DEST/starter_code").add_argument(
        "dest", type=Path)
    args = parser.parse_args()
    if args.command == "copy":
        copy(args.dest)
        return 0
    if args.command == "write":
        write()
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
