"""Grading A2: audit a pretraining run, evaluate its checkpoint in the sandbox, score it against
the course's baseline recipe evaluated in the same job.

An A2 submission is a folder (a run folder of `onenode train`, without `checkpoints/`):
    final/            the model in the transformers layout + its tokenizer (tokenizer.json or
                      onenode_tokenizer.json) + run_manifest.json
    recipe.yaml       the recipe it ran
    run_manifest.json tokens seen, steps, data-order digest, config, parameters
    metrics.jsonl     the training log
    report.ipynb      the report
    data/manifest.json (optional; with the shards, the grader checks them for evaluation text)

Nothing of the submission runs: the kit's own evaluation code reads its weights, inside
`grader.sandbox` (no network, memory, time and file limits), because a checkpoint is untrusted
input. The audit reads JSON, YAML and safetensors headers only.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .report import test_entry
from .rubric import KIT_ROOT, Profile, Rubric, read_toml, tier_share

A2_RUBRIC_PATH = KIT_ROOT / "a2_pretrain" / "rubric.toml"
CHECKPOINT_DIRS = ("final", "checkpoint")
SUITE_SEED = 1234
_PARTIAL = ".partial-"


class A2SubmissionError(ValueError):
    """An A2 submission that cannot be graded; one line says what to do."""


# -- rubric ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class A2Profile(Profile):
    token_budget: int
    suite: str
    benchmark_tiers: list
    heldout_tiers: list
    max_length: int = 2048
    batch_size: int = 16
    limit: int | None = None
    baseline_recipe: str | None = None
    baseline_set: dict = field(default_factory=dict)
    baseline_checkpoint: str | None = None
    hf_home: str | None = None


@dataclass(frozen=True)
class A2Rubric(Rubric):
    points: dict
    kind: ClassVar[str] = "A2 profile"

    def zero_tests(self, reason: str) -> list[dict]:
        return [test_entry(title, 0, self.points[key], reason, key) for key, title in
                (("budget", "Token budget and run audit"), ("benchmarks", "Benchmarks vs baseline"),
                 ("heldout", "Held-out perplexity vs baseline"))]


def load_a2_rubric(path: str | Path = A2_RUBRIC_PATH) -> A2Rubric:
    raw = read_toml(path)
    profiles = {name: A2Profile(name=name, **spec) for name, spec in raw["profiles"].items()}
    return A2Rubric(profiles, {k: float(v) for k, v in raw["points"].items()})


# -- intake ------------------------------------------------------------------------------------
@dataclass
class A2Submission:
    name: str
    root: Path
    checkpoint: Path
    recipe: Path
    manifest: Path
    metrics: Path
    notebook: Path | None
    data: Path | None


def load_a2_submission(path: str | Path) -> A2Submission:
    root = Path(path)
    if not root.is_dir():
        raise A2SubmissionError(f"{root} is not a folder: an A2 submission is a run folder (final/, recipe.yaml, "
                                "run_manifest.json, metrics.jsonl, report.ipynb)")
    links = [p for p in root.rglob("*") if p.is_symlink()]
    if links:
        raise A2SubmissionError(f"{links[0].relative_to(root)} is a symbolic link: copy the file itself")
    checkpoint = next((root / d for d in CHECKPOINT_DIRS if (root / d / "config.json").is_file()), None)
    if checkpoint is None:
        raise A2SubmissionError("no final/config.json: submit the run's final/ folder (the transformers export)")
    found = {}
    for name in ("recipe.yaml", "run_manifest.json", "metrics.jsonl"):
        if not (root / name).is_file():
            raise A2SubmissionError(f"{name} is missing: submit the whole run folder that `onenode train` wrote")
        found[name] = root / name
    notebook = root / "report.ipynb"
    data = root / "data"
    return A2Submission(root.name, root, checkpoint, found["recipe.yaml"], found["run_manifest.json"],
                        found["metrics.jsonl"], notebook if notebook.is_file() else None,
                        data if (data / "manifest.json").is_file() else None)


# -- the audit ---------------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _safetensors_numel(folder: Path) -> int:
    """Parameters stored in a checkpoint, from the safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    from onenode.model.hf_io import _weight_files

    total = 0
    for path in _weight_files(folder):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def _stored_numel(config) -> int:
    """Numbers a checkpoint of `config` stores: parameters and buffers, a tied head once."""
    from onenode.model import build_model

    model = build_model(config, device="meta")
    tied = model.lm_head.weight.numel() if config.tie_word_embeddings else 0
    return sum(t.numel() for t in model.state_dict().values()) - tied


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise A2SubmissionError(f"{path.name} is not valid JSON ({e}): submit the file the trainer wrote") from None
    if not isinstance(data, dict):
        raise A2SubmissionError(f"{path.name} is not a JSON object")
    return data


def _read_metrics(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise A2SubmissionError(f"metrics.jsonl has a line that is not JSON ({e})") from None


def audit_run(sub: A2Submission, token_budget: int) -> list[Check]:
    """Do the manifest, the logs, the recipe and the checkpoint tell one story within the budget?"""
    from onenode.model import count_parameters
    from onenode.model.config import NemotronHConfig
    from onenode.train.recipe import RecipeError, load_recipe

    manifest = _read_json(sub.manifest)
    records = _read_metrics(sub.metrics)
    checks: list[Check] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(Check(name, bool(ok), detail))

    try:
        recipe = load_recipe(sub.recipe)
        recipe_config = recipe.model_config()
    except (RecipeError, OSError) as e:
        check("recipe", False, f"recipe.yaml does not load: {e}")
        return checks
    seen, steps, per_step = manifest.get("tokens_seen"), manifest.get("steps"), manifest.get("tokens_per_step")
    check("budget", isinstance(seen, int) and seen <= token_budget and recipe.train.token_budget <= token_budget,
          f"tokens seen {seen:,} and recipe budget {recipe.train.token_budget:,} vs the profile's budget "
          f"{token_budget:,}" if isinstance(seen, int) else "the manifest has no tokens_seen")
    check("finished", manifest.get("status") == "finished", f"manifest status {manifest.get('status')!r}")
    check("manifest arithmetic", per_step == recipe.tokens_per_step and isinstance(steps, int)
          and seen == steps * per_step and manifest.get("token_budget") == recipe.train.token_budget
          and manifest.get("data_tokens_served", seen) == seen,
          f"{steps} steps x {per_step} tokens = {seen} tokens seen (recipe: {recipe.tokens_per_step} tokens per step, "
          f"budget {recipe.train.token_budget}); data loader served {manifest.get('data_tokens_served')}")
    logged = [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int)
              and isinstance(r.get("tokens"), int)]
    last = max(logged, key=lambda r: r["step"]) if logged else {}
    check("logs", bool(logged) and last.get("step") == steps and last.get("tokens") == seen
          and all(r["tokens"] == r["step"] * recipe.tokens_per_step for r in logged),
          f"metrics.jsonl ends at step {last.get('step')} with {last.get('tokens')} tokens; the manifest says "
          f"step {steps} with {seen}")
    try:
        config = NemotronHConfig.load(sub.checkpoint)
        stored = _safetensors_numel(sub.checkpoint)
    except (OSError, ValueError, TypeError, KeyError) as e:
        check("checkpoint", False, f"the checkpoint does not load: {e}")
        return checks
    total, active = count_parameters(config)
    declared = manifest.get("parameters", {})
    expected = _stored_numel(config)
    same_config = config.to_hf_dict() == recipe_config.to_hf_dict() == manifest.get("model_config")
    check("checkpoint", same_config and stored == expected and total == declared.get("total")
          and active == declared.get("active"),
          f"config.json {'matches' if same_config else 'differs from'} the recipe's and the manifest's model; "
          f"{stored:,} numbers stored where its config needs {expected:,}; {total:,} parameters by its config, "
          f"{declared.get('total')} in the manifest")
    final_manifest = sub.checkpoint / "run_manifest.json"
    if final_manifest.is_file():
        check("final manifest", _read_json(final_manifest) == manifest,
              "final/run_manifest.json and run_manifest.json agree")
    return checks


def contamination(sub: A2Submission, suite_dir: Path) -> Check | None:
    """Training documents of the submitted data that share a 13-gram with the evaluation text
    (the data pipeline's own decontamination filter); None when no shards were submitted."""
    from onenode.data.curation import Decontaminate, read_eval_texts
    from onenode.data.shards import open_shards
    from onenode.eval.model import checkpoint_tokenizer

    if sub.data is None:
        return None
    try:
        _, shards = open_shards(sub.data, "train")
    except (FileNotFoundError, ValueError):
        return None  # a manifest alone: nothing to check against
    tokenizer = checkpoint_tokenizer(sub.checkpoint)
    filt = Decontaminate(read_eval_texts([suite_dir / "onenode_heldout.jsonl"]))
    flagged = sum(not filt.keep(tokenizer.decode(s.document(i).tolist()))
                  for s in shards.values() for i in range(s.num_docs))
    return Check("contamination", flagged == 0, f"{flagged} of {filt.seen} training documents share a 13-word "
                                                f"sequence with the evaluation text")


# -- evaluation in the sandbox -----------------------------------------------------------------
def evaluate_sandboxed(checkpoint: Path, profile: A2Profile, suite_dir: Path | None, logs: Path,
                       label: str) -> tuple[dict | None, str | None]:
    """`onenode eval` of the pristine kit on `checkpoint`, sandboxed; (report, error)."""
    from .sandbox import Limits, SandboxError, make_scratch, run_sandboxed

    scratch = make_scratch()
    try:
        shutil.copytree(KIT_ROOT / "starter_code", scratch / "starter_code",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(checkpoint, scratch / "checkpoint", ignore=shutil.ignore_patterns("run_manifest.json"))
        argv = [sys.executable, "-m", "onenode.eval.cli", "checkpoint", "--suite", profile.suite,
                "--device", profile.device, "--batch-size", str(profile.batch_size),
                "--max-length", str(profile.max_length), "--out", "report.json"]
        if profile.limit:
            argv += ["--limit", str(profile.limit)]
        if suite_dir is not None:
            shutil.copytree(suite_dir, scratch / "suite")
            _retarget_tasks(scratch / "suite")
            argv += ["--tasks-dir", "suite", "--val-text", "suite/heldout.txt", "--val-seq-len", str(profile.max_length)]
        env = {"OMP_NUM_THREADS": str(profile.threads), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        if profile.hf_home:
            env["HF_HOME"] = profile.hf_home
        limits = Limits(wall_s=profile.timeout_s, cpu_s=profile.timeout_s * max(1, profile.threads),
                        memory_mb=profile.memory_mb or None, nproc=512)
        try:
            result = run_sandboxed(argv, cwd=scratch, env=env, limits=limits)
        except SandboxError as e:
            return None, f"sandbox: {e}"
        log = (result.stdout + b"\n" + result.stderr).decode("utf-8", errors="replace")
        (logs / f"eval-{label}.log").write_text(log, encoding="utf-8")
        report_file = scratch / "report.json"
        if not result.ok or not report_file.is_file():
            tail = " ".join(log.strip().splitlines()[-1:])[:300]
            return None, f"evaluation failed ({result.reason or 'no report'}): {tail}"
        return json.loads(report_file.read_text()), None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _retarget_tasks(suite: Path) -> None:
    """Point the copied task YAML files at the copied data files (lm-eval wants absolute paths)."""
    import yaml

    for path in suite.glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        files = spec["dataset_kwargs"]["data_files"]
        files["test"] = str((suite / Path(files["test"]).name).resolve())
        path.write_text(yaml.safe_dump(spec, sort_keys=False))


def build_suite(folder: Path) -> Path:
    """The offline suite plus its held-out text (for token-level val loss), in `folder`."""
    from onenode.eval.suite import build_offline_suite

    build_offline_suite(folder, seed=SUITE_SEED)
    passages = [json.loads(line)["text"] for line in (folder / "onenode_heldout.jsonl").read_text().splitlines()]
    (folder / "heldout.txt").write_text("\n\n".join(passages) + "\n", encoding="utf-8")
    return folder


# -- the job -----------------------------------------------------------------------------------
@dataclass
class A2Job:
    rubric: A2Rubric
    profile: A2Profile
    workdir: Path
    baseline_checkpoint: Path | None = None
    _suite: Path | None = None
    _baseline: dict | None = None

    @property
    def suite_dir(self) -> Path | None:
        if self.profile.suite != "offline":
            return None
        if self._suite is None:
            self._suite = build_suite(self.workdir / "suite")
        return self._suite

    @property
    def baseline(self) -> dict:
        """The baseline's evaluation report, through the same sandboxed path as a submission."""
        if self._baseline is None:
            checkpoint = self.baseline_checkpoint or baseline_checkpoint(self.profile)
            logs = self.workdir / "baseline-logs"
            logs.mkdir(parents=True, exist_ok=True)
            report, error = evaluate_sandboxed(Path(checkpoint), self.profile, self.suite_dir, logs, "baseline")
            if report is None:
                raise RuntimeError(f"the baseline does not evaluate ({error}): see {logs}")
            self._baseline = report
        return self._baseline


def baseline_checkpoint(profile: A2Profile) -> Path:
    """The profile's baseline: a given checkpoint, or its recipe trained once (cached by content)."""
    if profile.baseline_checkpoint:
        path = Path(profile.baseline_checkpoint)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"baseline checkpoint {path} not found: train a2_pretrain/recipes/baseline.yaml "
                                    "or pass --baseline DIR")
        return path
    return trained_run(KIT_ROOT / profile.baseline_recipe, profile.baseline_set) / "final"


def trained_run(recipe_path: str | Path, overrides: dict | None = None) -> Path:
    """A run folder of `onenode train RECIPE --set ...`, trained once per content of the recipe,
    its overrides and its data config, under $ONENODE_CACHE/a2-runs/ (the trainer puts the data's
    tokenizer in final/)."""
    import hashlib

    from onenode.data.corpus import cache_dir
    from onenode.train.recipe import load_recipe

    overrides = overrides or {}
    recipe = load_recipe(recipe_path, overrides)
    data_config = Path(KIT_ROOT / recipe.data.path).read_text() if recipe.data.source == "config" else None
    key = json.dumps([recipe.to_dict(), data_config], sort_keys=True, default=str)
    run = cache_dir() / "a2-runs" / f"{recipe.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    final = run / "final"
    if not (final / "config.json").is_file():
        sets = [f"--set={k}={v}" for k, v in overrides.items()]
        done = subprocess.run([sys.executable, "-m", "onenode.cli", "train", str(recipe_path), "--out", str(run),
                               "--fresh", *sets], cwd=KIT_ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not (final / "config.json").is_file():
            raise RuntimeError(f"training {recipe_path} failed: {done.stderr.strip()[-500:]}")
    return run


def new_a2_job(rubric: A2Rubric, profile_name: str, workdir: Path, baseline: str | None = None) -> A2Job:
    return A2Job(rubric, rubric.profile(profile_name), workdir, Path(baseline) if baseline else None)


# -- scoring -----------------------------------------------------------------------------------
@dataclass
class A2Result:
    tests: list = field(default_factory=list)
    leaderboard: list = field(default_factory=list)
    numbers: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    output: str = ""


def score(job: A2Job, checks: list[Check], report: dict | None, error: str | None) -> A2Result:
    """Tests and leaderboard entries from the audit and the evaluation, against the baseline."""
    points, profile = job.rubric.points, job.profile
    res = A2Result()
    verified = bool(checks) and all(c.ok for c in checks)
    audit_text = "; ".join(f"{c.name}: {'ok' if c.ok else 'FAILED'} ({c.detail})" for c in checks)
    res.tests.append(test_entry("Token budget and run audit", points["budget"] if verified else 0,
                                points["budget"], audit_text, "budget"))
    res.numbers["verified"] = verified
    if report is None:
        reason = f"not evaluated: {error}"
        res.failures["evaluation"] = error or ""
        res.tests += [test_entry("Benchmarks vs baseline", 0, points["benchmarks"], reason, "benchmarks"),
                      test_entry("Held-out perplexity vs baseline", 0, points["heldout"], reason, "heldout")]
        return res
    base = job.baseline
    gate = "" if verified else " (no points: the run is not verified)"
    choice_tasks = [t for t, e in report["headline"].items() if e["higher_is_better"]]
    per_task = points["benchmarks"] / max(1, len(choice_tasks))
    for task, entry in report["headline"].items():
        value, ref = entry["value"], base["headline"].get(task, {}).get("value")
        res.numbers[task] = value
        res.leaderboard.append({"name": f"{task} {entry['metric']}", "value": _round(value),
                                **({} if entry["higher_is_better"] else {"order": "asc"})})
        if value is None or ref is None:
            earned, line = 0.0, f"{task}: no score"
        elif entry["higher_is_better"]:
            earned = per_task * tier_share(profile.benchmark_tiers, value - ref)
            line = f"{task} {entry['metric']} {value:.4f} vs baseline {ref:.4f} ({value - ref:+.4f})"
        else:
            ratio = ref / value if value > 0 else 0.0
            earned = points["heldout"] * tier_share(profile.heldout_tiers, ratio)
            res.tests.append(test_entry("Held-out perplexity vs baseline", earned if verified else 0, points["heldout"],
                                        f"{task} {entry['metric']} {value:.3f} vs baseline {ref:.3f} "
                                        f"(baseline/yours {ratio:.3f}; tiers "
                                        + ", ".join(f">= {t:g} -> {s:.0%}" for t, s in profile.heldout_tiers)
                                        + f"){gate}", "heldout"))
            continue
        res.tests.append(test_entry(f"Benchmark: {task}", earned if verified else 0, per_task, line + gate,
                                    "benchmarks"))
    heldout = report.get("heldout")
    if heldout:
        res.numbers.update(val_loss=heldout["loss"], val_ppl=heldout["perplexity"])
        res.leaderboard += [{"name": "val loss", "value": _round(heldout["loss"]), "order": "asc"},
                            {"name": "val perplexity", "value": _round(heldout["perplexity"]), "order": "asc"}]
    res.output = ("Verified run" if verified else "Run NOT verified: " + "; ".join(
        f"{c.name}: {c.detail}" for c in checks if not c.ok)) + f". Suite {report['suite']} on {profile.device}."
    return res


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)


def grade_notebook(notebook: Path | None, logs: Path) -> list[dict]:
    """report.ipynb through nbgrader (grader/notebook.py), against the A2 template."""
    from . import notebook as notebooks

    return notebooks.grade(notebook, logs, assignment="a2")


def run_facts(sub: A2Submission) -> dict:
    """What the leaderboard shows about a run, from its manifest and recipe (as submitted)."""
    manifest = _read_json(sub.manifest)
    recipe = manifest.get("recipe") or {}
    data = recipe.get("data", {})
    return {"parameters": manifest.get("parameters", {}), "tokens_seen": manifest.get("tokens_seen"),
            "optimizer": recipe.get("optimizer", {}).get("name"),
            "data": data.get("path") or data.get("source"),
            "pattern": manifest.get("model_config", {}).get("hybrid_override_pattern")}


def grade_a2_submission(job: A2Job, path: Path, logs: Path) -> tuple[A2Result, dict]:
    """(result, extra facts) for one submission folder."""
    sub = load_a2_submission(path)
    checks = audit_run(sub, job.profile.token_budget)
    if job.suite_dir is not None:
        found = contamination(sub, job.suite_dir)
        if found is not None:
            checks.append(found)
    report, error = evaluate_sandboxed(sub.checkpoint, job.profile, job.suite_dir, logs, "submission")
    result = score(job, checks, report, error)
    if report is not None:
        (logs / "eval-report.json").write_text(json.dumps(report, indent=2) + "\n")
    result.tests += grade_notebook(sub.notebook, logs)
    shutil.copy2(sub.metrics, logs / "metrics.jsonl")  # the leaderboard's loss curve
    return result, {"run": run_facts(sub), "audit": [c.__dict__ for c in checks]}


def grade_one_a2(path: Path, job: A2Job, out: Path) -> dict:
    """Grade one submission into `out/<name>/` atomically (like A1's cohort) and return results."""
    from .cohort import publish
    from .report import environment, results_json, write_submission_results

    start = time.monotonic()
    name = path.name
    staging = Path(tempfile.mkdtemp(prefix=f"{_PARTIAL}{name}-", dir=out))
    logs = staging / "logs"
    logs.mkdir()
    extra: dict = {"assignment": "A2", "profile": job.profile.name, "seed": SUITE_SEED}
    failures: dict = {}
    try:
        result, facts = grade_a2_submission(job, path, logs)
        tests, leaderboard, failures, output = result.tests, result.leaderboard, result.failures, result.output
        extra.update(numbers=result.numbers, **facts)
    except A2SubmissionError as e:
        tests, leaderboard, output = job.rubric.zero_tests(f"not graded: {e}"), [], f"Not graded: {e}"
    except Exception as e:  # a grader bug must not cost the cohort: record it, re-grade on resume
        (logs / "grader-error.txt").write_text(traceback.format_exc())
        tests, leaderboard = job.rubric.zero_tests("grader error (not your fault): a TA will re-grade"), []
        output = f"Grader error (not your fault): {type(e).__name__}: {e}"
        extra["grader_error"] = True
    results = results_json(name, tests, leaderboard, time.monotonic() - start, output, extra)
    write_submission_results(staging, results, failures, environment(job.profile, SUITE_SEED))
    publish(staging, out / name)
    return results


def grade_cohort_a2(cohort: Path, job: A2Job, out: Path, force: bool = False) -> list[dict]:
    """Every submission folder in `cohort` not yet graded in `out`; writes `out/cohort.csv`."""
    from .cohort import is_done

    if not cohort.is_dir():
        raise FileNotFoundError(f"{cohort} is not a folder: pass the folder that holds one run folder per submission")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{_PARTIAL}*"):
        shutil.rmtree(stale, ignore_errors=True)
    folders = sorted(p for p in cohort.iterdir() if p.is_dir() and not p.name.startswith("."))
    for path in folders:
        if force or not is_done(out, path.name):
            grade_one_a2(path, job, out)
    results = [json.loads((out / p.name / "results.json").read_text()) for p in folders]
    write_a2_csv(out / "cohort.csv", results)
    return results


def a2_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        extra = r["extra_data"]
        row = {"name": extra["submission"], "score": r["score"], "max_score": extra["max_score"],
               "verified": extra.get("numbers", {}).get("verified", False)}
        row.update({e["name"]: e["value"] for e in r["leaderboard"]})
        row["note"] = r["output"].splitlines()[0] if r["output"] else ""
        rows.append(row)
    return rows


def write_a2_csv(path: Path, results: list[dict]) -> None:
    import csv

    rows = a2_rows(results)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def table(results: list[dict]) -> str:
    """A plain-text table of an A2 cohort for the terminal."""
    rows = a2_rows(results)
    keys = ["name", "score", "verified"] + [k for k in dict.fromkeys(k for r in rows for k in r)
                                            if k not in ("name", "score", "max_score", "verified", "note")]
    lines = [keys] + [[f"{r.get(k)}" if r.get(k) is not None else "-" for k in keys] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(*lines)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in lines)


# -- `onenode-grade a2` ------------------------------------------------------------------------
def register(sub) -> None:
    parser = sub.add_parser("a2", help="grade A2 submissions (a run folder, or a cohort of them)")
    parser.add_argument("submission", nargs="?", help="submission folder (a run folder with final/)")
    parser.add_argument("--cohort", help="folder with one submission folder per entry")
    parser.add_argument("--out", required=True, help="output folder (one subfolder per submission)")
    parser.add_argument("--profile", required=True, help="rubric profile: cpu-tiny, h100x8")
    parser.add_argument("--baseline", default=None, help="baseline checkpoint folder (default: the profile's)")
    parser.add_argument("--force", action="store_true", help="re-grade submissions already graded in --out")
    parser.add_argument("--rubric", default=str(A2_RUBRIC_PATH), help="rubric TOML (default: a2_pretrain/rubric.toml)")
    parser.set_defaults(func=run_a2)


def run_a2(args) -> int:
    from .sandbox import make_private

    if (args.submission is None) == (args.cohort is None):
        raise SystemExit("onenode-grade a2: pass either one SUBMISSION or --cohort DIR")
    rubric = load_a2_rubric(args.rubric)
    rubric.profile(args.profile)  # an unknown profile fails before anything is made
    workdir = make_private(tempfile.mkdtemp(prefix="onenode-grade-a2-"))
    job = new_a2_job(rubric, args.profile, workdir, args.baseline)
    out = Path(args.out)
    start = time.monotonic()
    try:
        if args.cohort:
            results = grade_cohort_a2(Path(args.cohort), job, out, force=args.force)
        else:
            out.mkdir(parents=True, exist_ok=True)
            results = [grade_one_a2(Path(args.submission), job, out)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(results))
    print(f"{len(results)} A2 submission(s) graded on {job.profile.name} in {time.monotonic() - start:.0f} s: {out}")
    return 0
