"""What a graded submission leaves behind: results.json (Gradescope), feedback.md/.html, env.json."""

from __future__ import annotations

import html
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from .rubric import KIT_ROOT, Profile


def test_entry(name: str, score: float, max_score: float, output: str, tag: str) -> dict:
    """One Gradescope test entry."""
    return {"name": name, "score": round(score, 3), "max_score": max_score,
            "status": "passed" if score >= max_score else "failed", "output": output,
            "visibility": "visible", "tags": [tag]}


def results_json(name: str, tests: list[dict], leaderboard: list[dict], execution_time: float, output: str,
                 extra: dict) -> dict:
    """Gradescope's results format: the score is the sum of the tests' scores."""
    return {
        "score": round(sum(t["score"] for t in tests), 3),
        "execution_time": round(execution_time, 1),
        "output": output,
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
        "leaderboard": leaderboard,
        "extra_data": {"submission": name, "max_score": sum(t["max_score"] for t in tests), **extra},
    }


def part_scores(results: dict) -> dict[str, float]:
    """A results.json's score per tag (each part, the notebook)."""
    scores: dict[str, float] = {}
    for t in results["tests"]:
        for tag in t["tags"]:
            scores[tag] = scores.get(tag, 0) + t["score"]
    return scores


def assignment_label(results: dict) -> str:
    """The label of the assignment a results.json belongs to ("A1", "A2"); results written
    before the grader recorded it are A1's."""
    return results["extra_data"].get("assignment", "A1")


# The grader's paths in what a child printed: its scratch copy (the student's tree is its
# starter_code/) and the virtual environment it ran in
SCRATCH_PATH = re.compile(r"""[^\s"'(]*/onenode-scratch/[^/\s"']+/""")
VENV_PATH = re.compile(r"""[^\s"'(]*/lib/(python3\.\d+)/site-packages/""")
TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception, another exception occurred:",
           "The above exception was the direct cause of the following exception:")


def student_paths(text: str) -> str:
    """`text` with paths as the student's tree has them: starter_code/onenode/... for the
    grader's scratch copy, .venv/lib/python3.X/site-packages/... for its environment."""
    return VENV_PATH.sub(r".venv/lib/\1/site-packages/", SCRATCH_PATH.sub("", text))


def one_traceback(failure: str) -> str:
    """A failure's error line(s) and one traceback from the log's tail after them: the one that
    ends in that error (with the exceptions chained to it), else the last. A log of several ranks
    holds one each, and its tail often starts inside one; a failure without a traceback stays whole."""
    head, _, log = failure.partition("\n\n")
    blocks = [block.strip("\n") for block in log.split(TRACEBACK)[1:]]
    if not blocks:
        return failure
    last = max((i for i, block in enumerate(blocks) if block.splitlines()[-1].strip() in head), default=len(blocks) - 1)
    first = last
    while first > 0 and blocks[first - 1].splitlines()[-1].strip() in CHAINED:
        first -= 1
    return "\n\n".join([head, *(f"{TRACEBACK}\n{block}" for block in blocks[first:last + 1])])


def feedback_markdown(results: dict, failures: dict[str, str]) -> str:
    extra = results["extra_data"]
    lines = [f"# {assignment_label(results)} feedback: {extra['submission']}", "",
             f"**Score: {results['score']:g} / {extra['max_score']:g}** "
             f"(profile `{extra['profile']}`, grading seed {extra['seed']}, {results['execution_time']:g} s)", ""]
    if results["output"]:
        lines += [results["output"], ""]
    lines += ["| test | score | what was measured |", "| --- | --- | --- |"]
    for t in results["tests"]:
        output = t["output"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {t['name']} | {t['score']:g} / {t['max_score']:g} | {output} |")
    if results["leaderboard"]:
        lines += ["", "## Numbers", ""] + [f"- {e['name']}: {e['value']:g}" for e in results["leaderboard"]]
    for name, text in failures.items():
        lines += ["", f"## What went wrong: {name} run", "", "```", text, "```"]
    lines += ["", "Logs of every run are in `logs/`; `env.json` says where and with what this ran."]
    return "\n".join(lines) + "\n"


_FEEDBACK_STYLE = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}"
                   "td{padding:.3em .6em;vertical-align:top}\n"
                   "tr.passed td:first-child{color:#186a1d}tr.failed td:first-child{color:#a21}"
                   "pre{background:#f4f4f4;padding:1em;overflow:auto}")


def feedback_html(results: dict, failures: dict[str, str]) -> str:
    e = html.escape
    extra = results["extra_data"]
    rows = "".join(
        f"<tr class='{e(t['status'])}'><td>{e(t['name'])}</td><td>{t['score']:g} / {t['max_score']:g}</td>"
        f"<td>{e(t['output'])}</td></tr>" for t in results["tests"])
    numbers = "".join(f"<li>{e(x['name'])}: {x['value']:g}</li>" for x in results["leaderboard"])
    logs = "".join(f"<h2>What went wrong: {e(name)} run</h2><pre>{e(text)}</pre>" for name, text in failures.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{assignment_label(results)} feedback: {e(extra['submission'])}</title>
<style>{_FEEDBACK_STYLE}</style>
</head><body><h1>{assignment_label(results)} feedback: {e(extra['submission'])}</h1>
<p><b>Score: {results['score']:g} / {extra['max_score']:g}</b> (profile <code>{e(extra['profile'])}</code>,
grading seed {extra['seed']}, {results['execution_time']:g} s)</p><p>{e(results['output'])}</p>
<table><tr><th>test</th><th>score</th><th>what was measured</th></tr>{rows}</table>
{'<h2>Numbers</h2><ul>' + numbers + '</ul>' if numbers else ''}{logs}
<p>Logs of every run are in <code>logs/</code>; <code>env.json</code> says where and with what this ran.</p>
</body></html>
"""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _gpus() -> list[str]:
    """GPU names from nvidia-smi (the grader process itself never initialises CUDA)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _kit_commit() -> str | None:
    """The kit's git commit; `ONENODE_COMMIT` names it where the tree arrives without its .git (a
    copy on a GPU machine), as for the training logs."""
    if os.environ.get("ONENODE_COMMIT"):
        return os.environ["ONENODE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=KIT_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(profile: Profile, seed: int) -> dict:
    """Where and with what a job ran (the same for every submission of the job)."""
    from .sandbox import capabilities

    return {
        "machine": {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "gpus": _gpus()},
        "versions": {"python": sys.version.split()[0],
                     **{p: _version(p) for p in ("torch", "transformers", "onenode")}},
        "kit_commit": _kit_commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "profile": profile.as_dict(),
        "seed": seed,
        "sandbox": capabilities(),
    }


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, allow_nan=False, default=str) + "\n", encoding="utf-8")


def write_submission_results(out: Path, results: dict, failures: dict[str, str], env: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    write_json(out / "env.json", env)
    (out / "feedback.md").write_text(feedback_markdown(results, failures), encoding="utf-8")
    (out / "feedback.html").write_text(feedback_html(results, failures), encoding="utf-8")
