"""`onenode verify RUN`: the grader's verification of an A2 run, on your own run, before you hand it in.

    onenode verify runs/mine                          # every check, the replay the profile's grader plans
    onenode verify runs/mine --spans 5 --out verify.json

The checks are the code the grader runs (`onenode.verify`): the run folder, the chain of
checkpoints from the seeded initialisation, the token budget by the chain, the manifest and the
log, the schedule's learning rates, the replica groups, the shards trained on, every span's
movement bound and optimizer state, the logged losses, the first, the last and random spans trained
again, and the evaluation suite's text in the shards. They run here, on your install, in this machine's time,
without the grader's sandbox (the code and the run are your own). Exit status: 0 when the run
verifies, 1 when a check fails, 2 for a usage error.

Passing is necessary, not sufficient: the TA's grading draws the random spans with a seed of its
own (so any span may be replayed), runs on the profile's machine, and scores the suite's tasks
against the baseline on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import secrets
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

BESIDE = Path(__file__).resolve().parents[3] / "a2_pretrain" / "rubric.toml"  # the kit's, the release's
RUBRIC = BESIDE if BESIDE.is_file() else Path("a2_pretrain") / "rubric.toml"  # else the folder it runs in
NOT_SUFFICIENT = ("necessary, not sufficient: the TA's grading replays spans you cannot predict (a seed of its own) "
                  "and scores the evaluation suite's tasks against the baseline")
HONEST = "train the run again with the recipe as it is, from step 0, resuming only from its own last checkpoint"
# what to do when a check fails, by its name (the reason says what was found)
FIXES = {
    "recipe": "submit the recipe.yaml the run wrote",
    "chain": "keep every checkpoint (checkpoint.keep_last: 0) and " + HONEST,
    "budget": "lower train.token_budget to the profile's budget and " + HONEST,
    "finished": "let the run finish: resume it from its last checkpoint until it does",
    "manifest arithmetic": "submit the run_manifest.json the trainer wrote, unedited",
    "logs": "submit the metrics.jsonl the trainer wrote, unedited",
    "schedule": "submit the metrics.jsonl the trainer wrote; keep the recipe's schedule for the whole run",
    "checkpoint": "submit the final/ the trainer exported, with the recipe it trained",
    "final manifest": "submit final/ and run_manifest.json as the trainer wrote them",
    "replica groups": "submit group 0's run folder with every other group's replica_*/ in it, as the trainer "
                      "wrote them (`onenode pack a2` copies them); a run of one group holds none",
    "data": "pass the data folder the run trained on (--data DIR), unchanged since the run",
    "contamination": "rebuild the data with the `decontaminate` curation step (a2_pretrain/README.md) and train again",
    "tokenizer": "submit final/ with the tokenizer `onenode train` put there (the data's), and train on data "
                 "made with a tokenizer that keeps text as it is given",
}


@dataclasses.dataclass(frozen=True)
class RubricProfile:
    """What the verification reads of an A2 profile of `a2_pretrain/rubric.toml` (the grader reads
    the same table into its `A2Profile`)."""

    name: str
    device: str
    threads: int
    token_budget: int
    replay_fraction: float
    replay_tolerance: float
    loss_tolerance: float
    suite: str
    deterministic_runs: bool = False
    replay_minutes: float | None = None
    replay_tokens_per_s: float | None = None


def load_profiles(rubric: Path) -> dict[str, RubricProfile]:
    """Every A2 profile of `rubric`, by name."""
    with open(rubric, "rb") as f:
        profiles = tomllib.load(f)["profiles"]
    names = {field.name for field in dataclasses.fields(RubricProfile)}
    return {name: RubricProfile(name=name, **{k: v for k, v in spec.items() if k in names})
            for name, spec in profiles.items()}


def register(subparsers) -> None:
    parser = subparsers.add_parser("verify", help="check an A2 run as the grader verifies it, before you hand it in",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the run folder `onenode train --out` wrote, or the folder `onenode pack a2` wrote")
    parser.add_argument("--profile", default=None,
                        help="the rubric's profile the run is graded on (default: the first one on the run's device)")
    parser.add_argument("--spans", type=int, default=None, metavar="N",
                        help="replay N random spans besides the first and the last (default: as many as the "
                             "profile's grader replays)")
    parser.add_argument("--seed", default=None, help="what draws the random spans (default: random, printed)")
    parser.add_argument("--data", default=None,
                        help="the data folder the run trained on (default: its data/, or the one its recipe names)")
    parser.add_argument("--rubric", default=str(RUBRIC), help="the A2 rubric (default: %(default)s)")
    parser.add_argument("--out", default=None, metavar="FILE", help="also write every check to FILE (JSON)")
    parser.set_defaults(func=run)


def suite_text(profile: RubricProfile) -> tuple[Callable[[], list[str] | None], list[str]]:
    """A reader of the profile's suite's text for the contamination check (it returns None where
    the text cannot be read here), and the list its reason for that lands in."""
    skipped: list[str] = []

    def read() -> list[str] | None:
        if importlib.util.find_spec("lm_eval") is None:
            skipped.append("reading the suite's text needs lm-eval: pip install 'onenode[eval]'")
            return None
        from ..eval.suite import suite_texts

        try:
            return suite_texts(profile.suite)
        except Exception as e:  # a dataset not downloaded here, say: the grader checks it then
            skipped.append(f"the {profile.suite} suite's text does not load here ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]})")
            return None

    return read, skipped


def run(args: argparse.Namespace) -> int:
    from ..handin import HandInError, trains_on_data
    from ..pack import trained_data
    from . import verify_run
    from .intake import RunFolderError, load_submission
    from .replay import replay_here

    if args.spans is not None and args.spans < 0:
        print("onenode verify: --spans takes a number of spans, 0 or more", file=sys.stderr)
        return 2
    try:
        profiles = load_profiles(Path(args.rubric))
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as e:
        print(f"onenode verify: {args.rubric} is not the A2 rubric ({e}): pass a2_pretrain/rubric.toml with --rubric",
              file=sys.stderr)
        return 2
    if args.profile is not None and args.profile not in profiles:
        print(f"onenode verify: unknown profile {args.profile!r}: choose one of {', '.join(profiles)}", file=sys.stderr)
        return 2
    root = Path(args.run)
    try:
        has_data = (root / "data" / "manifest.json").is_file()
        data = None if has_data or not trains_on_data(root / "recipe.yaml") else \
            trained_data(root, Path(args.data) if args.data else None)
        sub = load_submission(root, notebook=False, data=data)
    except (RunFolderError, HandInError) as e:
        print(f"FAIL run folder: {e}")
        return 1
    layout = sub.chain[-1].meta.get("layout") if sub.chain else None
    device = layout.get("device") if isinstance(layout, dict) else None
    profile = profiles[args.profile] if args.profile else next(
        (p for p in profiles.values() if p.device == device), next(iter(profiles.values())))
    seed = args.seed if args.seed is not None else str(secrets.randbelow(2**31))
    print(f"onenode verify {root}: profile {profile.name} ({args.rubric}), spans drawn by seed {seed}; the replay "
          "trains spans of the run again, which takes about as long as they took", flush=True)
    texts, skipped = suite_text(profile)
    checks, cost = verify_run(sub, profile, seed, lambda spans: replay_here(sub, spans, profile), texts, args.spans)
    for check in checks:
        print(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
        if not check.ok:
            print(f"     what to do: {FIXES.get(check.name, HONEST)}")
    for reason in skipped:
        print(f"SKIP contamination: {reason}; the grader checks it")
    verified = all(check.ok for check in checks)
    print(f"{'verified' if verified else 'NOT verified'}: "
          + (f"every check passed ({NOT_SUFFICIENT})" if verified else
             f"{sum(not c.ok for c in checks)} check(s) failed; a run that fails earns no benchmark or perplexity "
             "points"))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "run": str(root), "profile": profile.name, "seed": seed, "verified": verified,
            "checks": [dataclasses.asdict(check) for check in checks],
            "skipped": [{"name": "contamination", "detail": reason} for reason in skipped],
            "cost": cost}, indent=2) + "\n")
    return 0 if verified else 1
