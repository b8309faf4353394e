"""Scoring A2: the audit gates everything, then the benchmarks and the held-out perplexity
against the baseline's, evaluated in the same job, and the report notebook."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from onenode.verify import verify_run
from onenode.verify.audit import Check
from onenode.verify.intake import A2Submission, RunFolderError

from ..assignment import Graded
from ..errors import SubmissionError
from ..report import test_entry
from ..rubric import tier_share
from .evaluation import evaluate_sandboxed
from .intake import load_submission
from .job import A2Job
from .replay import run_harness
from .rubric import TITLES


def margin_in_stderr(entry: dict, ref: dict) -> float:
    """The margin over the baseline in standard errors of the difference (positive: better):
    accuracy for benchmarks, log perplexity for perplexity; each side's error from its report
    (lm-eval's, or `onenode.eval.run`'s for perplexity), the two independent."""
    value, base = entry["value"], ref["value"]
    error, base_error = entry.get("stderr") or 0.0, ref.get("stderr") or 0.0
    if entry["higher_is_better"]:
        margin, spread = value - base, math.hypot(error, base_error)
    elif value > 0 and base > 0:
        margin, spread = math.log(base / value), math.hypot(error / value, base_error / base)
    else:
        return -math.inf
    if spread > 0:
        return margin / spread
    return math.copysign(math.inf, margin) if margin else 0.0


def _shown(entry: dict) -> str:
    error = entry.get("stderr")
    return f"{entry['value']:.4g}" + (f" ± {error:.2g}" if error is not None else "")


def score(job: A2Job, checks: list[Check], report: dict | None, error: str | None) -> Graded:
    """Tests and leaderboard entries from the audit and the evaluation, against the baseline.
    A task's share is the tier its margin reaches in standard errors of the difference
    (`margin_tiers`), so a difference inside the evaluation's noise cannot move the points."""
    points, profile = job.rubric.points, job.profile
    res = Graded()
    verified = bool(checks) and all(c.ok for c in checks)
    audit_text = "; ".join(f"{c.name}: {'ok' if c.ok else 'FAILED'} ({c.detail})" for c in checks)
    res.tests.append(test_entry(TITLES["budget"], points["budget"] if verified else 0,
                                points["budget"], audit_text, "budget"))
    res.measurements["verified"] = verified
    if report is None:
        reason = f"not evaluated: {error}"
        res.failures["evaluation"] = error or ""
        res.tests += [test_entry(TITLES[key], 0, points[key], reason, key) for key in ("benchmarks", "heldout")]
        return res
    base = job.baseline
    gate = "" if verified else " (no points: the run is not verified)"
    tiers = ", ".join(f">= {t:+g} -> {s:.0%}" for t, s in profile.margin_tiers)
    choice_tasks = [t for t, e in report["headline"].items() if e["higher_is_better"]]
    per_task = points["benchmarks"] / max(1, len(choice_tasks))
    stderr = res.extra_data.setdefault("stderr", {})
    for task, entry in report["headline"].items():
        ref = base["headline"].get(task, {})
        name = f"{task} {entry['metric']}"
        res.measurements[task] = entry["value"]
        res.leaderboard.append({"name": name, "value": _round(entry["value"]),
                                **({} if entry["higher_is_better"] else {"order": "asc"})})
        stderr[name] = _round(entry.get("stderr"))
        key, most = ("benchmarks", per_task) if entry["higher_is_better"] else ("heldout", points["heldout"])
        if entry["value"] is None or ref.get("value") is None:
            earned, line = 0.0, f"{name}: no score"
        else:
            z = margin_in_stderr(entry, ref)
            earned = most * tier_share(profile.margin_tiers, z)
            line = (f"{name} {_shown(entry)} vs baseline {_shown(ref)}: {z:+.2f} standard errors of the "
                    f"difference (tiers {tiers})")
        title = f"Benchmark: {task}" if key == "benchmarks" else TITLES["heldout"]
        res.tests.append(test_entry(title, earned if verified else 0, most, line + gate, key))
    heldout = report.get("heldout")
    if heldout:
        res.measurements.update(val_loss=heldout["loss"], val_ppl=heldout["perplexity"])
        res.leaderboard += [{"name": "val loss", "value": _round(heldout["loss"]), "order": "asc"},
                            {"name": "val perplexity", "value": _round(heldout["perplexity"]), "order": "asc"}]
    res.output = ("Verified run" if verified else "Run NOT verified: " + "; ".join(
        f"{c.name}: {c.detail}" for c in checks if not c.ok)) + f". Suite {report['suite']} on {profile.device}."
    return res


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)


def grade_notebook(notebook: Path | None, logs: Path) -> list[dict]:
    """report.ipynb through nbgrader (grader/notebook.py), against the A2 template."""
    from .. import notebook as notebooks

    return notebooks.grade(notebook, logs, assignment="a2")


def run_facts(sub: A2Submission) -> dict:
    """What the leaderboard shows about a run, from its manifest and recipe (as submitted)."""
    manifest = sub.manifest
    recipe = manifest.get("recipe") or {}
    data = recipe.get("data", {})
    return {"parameters": manifest.get("parameters", {}), "tokens_seen": manifest.get("tokens_seen"),
            "optimizer": recipe.get("optimizer", {}).get("name"),
            "data": data.get("path") or data.get("source"),
            "pattern": manifest.get("model_config", {}).get("hybrid_override_pattern")}


def verify(job: A2Job, sub: A2Submission, logs: Path, threads: int | None = None) -> tuple[list[Check], dict]:
    """Every check that makes a run verified, and what the replay cost (`onenode.verify.verify_run`,
    the code `onenode verify` runs): the kit's checks in this process, the replay's harness on the
    job's pristine A2 stack in the sandbox, the spans drawn by the job's seed and the submission's
    name, the contamination check against the profile's suite."""
    try:
        return verify_run(sub, job.profile, f"{job.seed}:{sub.name}",
                          lambda spans: run_harness(sub, job.stack, spans, job.profile, logs, threads),
                          job.evaluation_text)
    except RunFolderError as e:
        raise SubmissionError(str(e)) from None


def grade(job: A2Job, path: Path, work: Path, logs: Path) -> Graded:
    """Verification, sandboxed evaluation against the baseline, the notebook. Nothing of the
    submission's code runs, so it needs no scratch folder (`work`)."""
    sub = load_submission(path, notebook=job.notebooks and job.evaluate)
    checks, cost = verify(job, sub, logs)
    report, error = evaluate_sandboxed(sub.checkpoint, job.profile, job.suite_dir, logs, "submission") \
        if job.evaluate else (None, "--verify-only: the run's verification alone")
    graded = score(job, checks, report, error)
    replay = {key: cost.pop(key) for key in ("spans", "loss_relative_errors") if key in cost}  # lists, not columns
    graded.measurements.update(cost)
    if report is not None:
        (logs / "eval-report.json").write_text(json.dumps(report, indent=2) + "\n")
    if job.notebooks:
        graded.tests += grade_notebook(sub.notebook, logs)
    shutil.copy2(sub.metrics_path, logs / "metrics.jsonl")  # the leaderboard's loss curve
    graded.extra_data.update(run=run_facts(sub), audit=[c.__dict__ for c in checks],
                             **({"replay": replay} if replay else {}))
    return graded
