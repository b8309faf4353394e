"""The verification of an A2 run, the one implementation of it: `onenode verify RUN` runs it on a
student's own run before the hand-in, and the grader (`onenode-grade a2`) runs it on every
submission, from its own pristine copy of the kit.

`intake.py` reads the run folder (nothing of it runs), `audit.py` checks that its chain, budget,
manifest, logs and schedule tell one story and hashes the shards it trained on, `replay.py` plans
the replay and reads its report into checks, `replay_harness.py` re-creates the initialisation,
hashes every checkpoint, bounds every span's movement and optimizer state, recomputes the data
order and trains sampled spans again (a child process: sandboxed on the grader's stack for the
grader, plain for a student), `contamination.py` scans the shards trained on for the evaluation
suite's text. `cli.py` is `onenode verify`.
"""

from __future__ import annotations

from collections.abc import Callable

from .audit import Check, audit_run, trained_shards
from .contamination import contamination, evaluated_tokenizer
from .intake import A2Submission
from .replay import Harness, replay_checks


def verify_run(sub: A2Submission, profile, seed: str, harness: Harness,
               eval_texts: Callable[[], list[str] | None], random_spans: int | None = None) -> tuple[list[Check], dict]:
    """Every check that makes a run verified, and what the replay cost: the audit (chain, budget
    by the chain, manifest, logs, schedule, replica groups, checkpoint), the shards trained on (hashed), the
    replay (initialisation, weights, final weights, data order, movement, optimizer state, logged
    losses, spans: `replay.replay_checks`), contamination of the shards by `eval_texts()`, the
    profile's suite's text (None: it cannot be read here, and the run has no contamination check;
    the caller says why), and final/'s tokenizer (`contamination.evaluated_tokenizer`)."""
    checks = audit_run(sub, profile.token_budget)
    shards, data = trained_shards(sub)
    replayed, cost = replay_checks(sub, profile, seed, harness, random_spans)
    checks += [data, *replayed]
    texts = eval_texts() if data.ok else None
    if not data.ok:
        checks.append(Check("contamination", False, "not checked: the data trained on is not verified (see data)"))
    elif texts is not None:
        checks.append(contamination(sub, shards, texts, profile.threads))
    checks.append(evaluated_tokenizer(sub, texts))
    return checks, cost
