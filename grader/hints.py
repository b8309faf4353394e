"""`onenode-grade hints NAME --part N --rung K`: one rung of a hint ladder, for the course forum.

An assignment's ladders live in the file its `Handout.hints` names (`a1_infra/hints.toml`),
beside the handout, never in it: the release leaves the file out and refuses a bundle that holds
any of its lines, so a rung reaches students only when the instructor posts it.
"""

from __future__ import annotations

from .assignment import Assignment
from .rubric import tomllib

MIN_SECRET_CHARS = 30


class HintError(ValueError):
    """No such ladder, part or rung; one line saying what exists."""


def ladders(assignment: Assignment) -> dict[str, dict]:
    """{"part1": {"title": ..., "rungs": [markdown, ...]}, ...} of `assignment`."""
    path = assignment.handout.hints
    if path is None or not path.is_file():
        raise HintError(f"{assignment.name} has no hint ladders" + (f" ({path} is missing)" if path else ""))
    with path.open("rb") as f:
        return tomllib.load(f)


def rung(assignment: Assignment, part: int, number: int) -> str:
    """Rung `number` (from 1) of part `part`'s ladder, as Markdown with a heading."""
    ladder = ladders(assignment).get(f"part{part}")
    if ladder is None:
        raise HintError(f"{assignment.name} has no part {part}: parts {', '.join(k[4:] for k in ladders(assignment))}")
    rungs = ladder["rungs"]
    if not 1 <= number <= len(rungs):
        raise HintError(f"{ladder['title']} has rungs 1 to {len(rungs)}, not {number}")
    return f"**{ladder['title']}, hint {number} of {len(rungs)}**\n\n{rungs[number - 1].strip()}\n"


def secret_lines(assignment: Assignment) -> set[str]:
    """Every hint line long enough to be recognised in a release bundle."""
    if assignment.handout.hints is None:
        return set()
    lines = (line.strip() for ladder in ladders(assignment).values() for text in ladder["rungs"]
             for line in text.splitlines())
    return {line for line in lines if len(line) > MIN_SECRET_CHARS}


def register(sub, assignments: dict[str, Assignment]) -> None:
    """`onenode-grade hints NAME` for those of `assignments` (by name) that have hint ladders."""
    laddered = {name: a for name, a in assignments.items() if a.handout.hints is not None}
    hints = sub.add_parser("hints", help="print one rung of an assignment's hint ladder (for the course forum)")
    hints.add_argument("assignment", choices=sorted(laddered))
    hints.add_argument("--part", type=int, required=True, help="part number, from 1 (a wrong one lists them)")
    hints.add_argument("--rung", type=int, required=True, help="rung number, from 1 (gentlest)")
    hints.set_defaults(func=lambda args: print(rung(laddered[args.assignment], args.part, args.rung), end=""))
