"""Edit the reference A1 fixes as code, keep them as patches.

    python solutions/a1/make_patches.py checkout /tmp/sol   # /tmp/sol/starter_code = starter + every part
    ... edit /tmp/sol/starter_code/onenode/... ...
    python solutions/a1/make_patches.py diff /tmp/sol       # rewrite parts/*.patch and submission.patch
    python solutions/a1/make_patches.py join                # submission.patch from parts/*.patch only

Each part owns the files its patch touches now (parts touch disjoint files); a part that should
own a new file: `diff /tmp/sol --add 2-ep:onenode/parallel/new_file.py`; `--parts 1-moe` rewrites
only that part. A part whose diff comes out empty is left alone (the edited tree lacks it). The full
`submission.patch` is the parts concatenated in order, so applying the parts one after the other
gives exactly the full patch's tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KIT_ROOT = HERE.parents[1]
PARTS = HERE / "parts"
FULL = HERE / "submission.patch"
_TARGET = re.compile(r"^\+\+\+ b/(starter_code/\S+)$", re.MULTILINE)


def parts() -> list[Path]:
    return sorted(PARTS.glob("*.patch"))


def owned_files(patch: Path) -> list[str]:
    """The files (relative to the kit root) a part's patch changes."""
    return _TARGET.findall(patch.read_text())


def git_apply(tree: Path, patch: Path) -> None:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent.resolve()))
    result = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=tree, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{patch.name} does not apply: {result.stderr.strip()}")


def checkout(dest: Path) -> None:
    if (dest / "starter_code").exists():
        sys.exit(f"{dest}/starter_code exists: remove it or pick another folder")
    shutil.copytree(KIT_ROOT / "starter_code", dest / "starter_code",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    for patch in parts():
        git_apply(dest, patch)
    print(f"{dest}/starter_code: starter + {', '.join(p.stem for p in parts())}")


def file_diff(path: str, edited: Path) -> str:
    """`git diff` of one file, starter vs the edited tree, with a/ b/ paths from the kit root."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a").symlink_to(KIT_ROOT)
        (Path(tmp) / "b").symlink_to(edited.resolve())
        old = f"a/{path}" if (KIT_ROOT / path).exists() else "/dev/null"
        result = subprocess.run(["git", "diff", "--no-index", "--no-prefix", old, f"b/{path}"], cwd=tmp,
                                capture_output=True, text=True)
    if result.returncode not in (0, 1):
        sys.exit(f"git diff failed for {path}: {result.stderr.strip()}")
    return result.stdout


def join() -> None:
    FULL.write_text("".join(patch.read_text() for patch in parts()))
    print(f"{FULL.relative_to(KIT_ROOT)}: {' + '.join(p.stem for p in parts())}")


def diff(edited: Path, additions: list[str], only: list[str] | None) -> None:
    owners = {patch: owned_files(patch) for patch in parts() if only is None or patch.stem in only}
    for spec in additions:
        name, _, rel = spec.partition(":")
        owners.setdefault(PARTS / f"{name}.patch", []).append(f"starter_code/{rel}")
    for patch, files in owners.items():
        text = "".join(file_diff(path, edited) for path in files)
        if not text:
            print(f"{patch.relative_to(KIT_ROOT)}: no change in {edited}, left alone (checkout first?)")
            continue
        patch.write_text(text)
        print(f"{patch.relative_to(KIT_ROOT)}: {len(files)} file(s)")
    join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("checkout").add_argument("dest", type=Path)
    d = sub.add_parser("diff")
    d.add_argument("edited", type=Path, help="the folder given to checkout")
    d.add_argument("--add", action="append", default=[], metavar="PART:onenode/FILE")
    d.add_argument("--parts", nargs="+", metavar="PART", help="rewrite only these parts (default: all)")
    sub.add_parser("join")
    args = parser.parse_args()
    if args.command == "checkout":
        checkout(args.dest)
    elif args.command == "diff":
        diff(args.edited, args.add, args.parts)
    else:
        join()


if __name__ == "__main__":
    main()
