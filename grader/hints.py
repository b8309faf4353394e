"""`onenode-grade hints a1 --part N --rung K`: one rung of a hint ladder, for the course forum.

The ladders live in `<handout>/hints.toml` beside the handout, never in it: the release leaves
the file out and refuses a bundle that holds any of its lines, so a rung reaches students only
when the instructor posts it.
"""

from __future__ import annotations

from .rubric import KIT_ROOT, tomllib

HINT_FILES = {"a1": KIT_ROOT / "a1_infra" / "hints.toml"}
MIN_SECRET_CHARS = 30


class HintError(ValueError):
    """No such ladder, part or rung; one line saying what exists."""


def ladders(assignment: str) -> dict[str, dict]:
    """{"part1": {"title": ..., "rungs": [markdown, ...]}, ...} of `assignment`."""
    path = HINT_FILES.get(assignment)
    if path is None or not path.is_file():
        raise HintError(f"{assignment} has no hint ladders (they exist for: {', '.join(HINT_FILES)})")
    with path.open("rb") as f:
        return tomllib.load(f)


def rung(assignment: str, part: int, number: int) -> str:
    """Rung `number` (from 1) of part `part`'s ladder, as Markdown with a heading."""
    ladder = ladders(assignment).get(f"part{part}")
    if ladder is None:
        raise HintError(f"{assignment} has no part {part}: parts {', '.join(k[4:] for k in ladders(assignment))}")
    rungs = ladder["rungs"]
    if not 1 <= number <= len(rungs):
        raise HintError(f"{ladder['title']} has rungs 1 to {len(rungs)}, not {number}")
    return f"**{ladder['title']}, hint {number} of {len(rungs)}**\n\n{rungs[number - 1].strip()}\n"


def secret_lines(assignment: str) -> set[str]:
    """Every hint line long enough to be recognised in a release bundle."""
    if assignment not in HINT_FILES:
        return set()
    lines = (line.strip() for ladder in ladders(assignment).values() for text in ladder["rungs"]
             for line in text.splitlines())
    return {line for line in lines if len(line) > MIN_SECRET_CHARS}


def register(sub) -> None:
    hints = sub.add_parser("hints", help="print one rung of an assignment's hint ladder (for the course forum)")
    hints.add_argument("assignment", choices=sorted(HINT_FILES))
    hints.add_argument("--part", type=int, required=True, help="part number (A1: 1 MoE, 2 EP, 3 pipeline)")
    hints.add_argument("--rung", type=int, required=True, help="rung number, from 1 (gentlest)")
    hints.set_defaults(func=lambda args: print(rung(args.assignment, args.part, args.rung), end=""))
