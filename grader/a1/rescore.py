"""Re-score an A1 submission from the evidence its grading job kept: nothing runs again.

    python -m grader.a1.rescore results/a1 NAME                        # the kit's rubric
    python -m grader.a1.rescore results/a1 NAME --rubric changed.toml  # a new tolerance or range

A grading job keeps, in each submission's `logs/evidence.json`, every digest, time, traffic and
memory reading the grader took from its sessions (the starter's MoE layer, timed in turns with
it, included), and the starter's own sessions in `OUT/.starter-logs/seed-SEED/evidence.json`
(`runner.keep_evidence`). This runs the grader's own scoring steps of Parts 1 to 3 on them, as
`scoring.grade` does once the sessions have run, and prints each test's points as `results.json`
recorded them and as they come out now, with the grader's words. The report notebook is not
re-scored. So a disputed grade is re-examined on what was measured, and a tolerance or a speed
range is re-set on the same readings, without a GPU.

A later job graded into the same --out (a resumed or a forced one) keeps its starter under its own
seed. A starter folder given with --starter-logs is checked: the submission's own reading of the
starter's MoE layer (same seeds as the starter's evidence, so the same outputs) tells another
job's, and such a starter is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
from pathlib import Path

from ..runner import EVIDENCE, SessionResult
from . import STARTER_LOGS
from . import starter_logs as starter_logs_of
from .compare import moe_error
from .job import A1Job, Reference
from .rubric import RUBRIC_PATH, A1Rubric, load_rubric
from .scoring import Context, grade_ep, grade_moe, grade_pp, grade_steps


def read_evidence(folder: Path) -> dict[str, SessionResult]:
    """The sessions `keep_evidence` kept in `folder` (`evidence.json`, or a record's `.json.gz`)."""
    plain, packed = folder / EVIDENCE, folder / f"{EVIDENCE}.gz"
    if plain.is_file():
        text = plain.read_text(encoding="utf-8")
    elif packed.is_file():
        text = gzip.decompress(packed.read_bytes()).decode("utf-8")
    else:
        raise FileNotFoundError(f"no {EVIDENCE} in {folder}: pass the --out folder of the `onenode-grade a1` job "
                                "that graded the submission (a submission refused at intake ran nothing)")
    fields = {f.name for f in dataclasses.fields(SessionResult)}
    return {name: SessionResult(**{k: v for k, v in raw.items() if k in fields})
            for name, raw in json.loads(text).items()}


def rescore(results: Path, name: str, rubric: A1Rubric, starter_logs: Path | None = None) -> tuple[dict, Context]:
    """(the recorded results.json, the context of Parts 1 to 3 scored again from the evidence) of
    submission `name` in the job folder `results`, on the profile it was graded on."""
    recorded = json.loads((results / name / "results.json").read_text(encoding="utf-8"))
    extra = recorded["extra_data"]
    starter_logs = starter_logs or starter_logs_of(results, extra["seed"])
    starter = read_evidence(starter_logs)
    runs = read_evidence(results / name / "logs")
    profile = rubric.profile(extra["profile"])
    beside = runs.get("moe-starter")  # the starter's MoE on the job's seeds, timed in turns with the submission
    if beside is not None and beside.digests and moe_error(starter["moe"].digests, beside.digests) > profile.rtol:
        raise ValueError(f"{starter_logs} holds another grading job's starter than the one {name} was graded beside "
                         f"(seed {extra['seed']}): pass that job's own folder with --starter-logs")
    job = A1Job(rubric, profile, extra["seed"], results, starter_logs)
    job._reference = Reference(tree=Path(), moe=starter["moe"], moe_exact=starter.get("moe-exact", starter["moe"]),
                               train=starter["reference"], ep=starter.get("ep"), moe_weights=Path(),
                               model_weights=Path(), pp_train=starter.get("pp-reference"))
    ctx = Context(job, None, runs, results / name / "logs")
    grade_steps(ctx, [grade_moe, grade_ep, grade_pp])
    return recorded, ctx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader.a1.rescore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="the --out folder of the `onenode-grade a1` job")
    parser.add_argument("name", help="the submission's name (its folder in RESULTS)")
    parser.add_argument("--rubric", type=Path, default=RUBRIC_PATH, help="rubric TOML (default: a1_infra/rubric.toml)")
    parser.add_argument("--starter-logs", type=Path, default=None,
                        help=f"the starter's evidence folder (default: RESULTS/{STARTER_LOGS}/seed-SEED)")
    args = parser.parse_args(argv)
    try:
        recorded, ctx = rescore(args.results, args.name, load_rubric(args.rubric), args.starter_logs)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"rescore: {e}", file=sys.stderr)
        return 2
    before = {t["name"]: t["score"] for t in recorded["tests"]}
    for test in ctx.tests:
        print(f"{test['name']}: recorded {before.get(test['name'], '-')}, now {test['score']:g} of "
              f"{test['max_score']:g}\n    {test['output']}")
    numbers = recorded["extra_data"].get("numbers", {})
    for key, value in ctx.measurements.items():
        print(f"{key}: recorded {numbers.get(key)}, now {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
