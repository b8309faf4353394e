"""A2's verification on a GPU, measured: honest runs and every forgery class of
tests/redteam/a2_forgeries.py, verified by the grader's own code in its sandbox with every span
replayed (replay fraction 1, so that each span's error is measured). The record is what the GPU
profiles' `replay_tolerance` and `loss_tolerance` in a2_pretrain/rubric.toml are set from.

    python benchmarks/a2_verification.py OUT honest        # honest runs, default and deterministic kernels
    python benchmarks/a2_verification.py OUT forgeries     # every forgery class, deterministic kernels
    python benchmarks/a2_verification.py OUT graded        # honest and forged runs graded end to end
    python benchmarks/a2_verification.py OUT honest --cpu  # the tiny scale on a CPU (checks the path)

`honest`: the baseline recipe at one-GPU scale (below), 16 steps, verified with checkpoints every
4 and every 8 steps on the GPU's default kernels, and every 4 with `train.deterministic: true`
(`--only` adds seed 1, compiled blocks, and compiled blocks with mamba_ssm's scan or with FlexAttention under
the mode: `deterministic-seed-1-every-4`, `deterministic-compiled-every-4`, `deterministic-mamba-ssm-every-4`,
which needs mamba-ssm >= 2.3: `make mamba-ssm`, `deterministic-flex-every-4`); then the deterministic
mode's cost: the baseline recipe's own model (25 layers, 64 experts), 12 steps of 8 x 4096 tokens each
way, tokens per second from the run's manifest.
`graded`: the honest deterministic run and every forgery class graded end to end in one cohort
(`grade_cohort`, as `onenode-grade a2 --cohort` does) on the profile as it is: its own replay
fraction and tolerances, the offline suite, the honest run as the baseline; OUT/graded/ holds each
result.
`forgeries`: each forgery built from deterministic runs (the honest, a 4x-longer and a 4x-wider
one) and verified; it is caught when every check its class names fails as it says.

The one-GPU scale is `a2_pretrain/recipes/baseline.yaml` cut to 7 layers (MEM*EME), width 512
and 16 experts top-4 (92.5M parameters: 1.1 GB per checkpoint, so that seven runs' chains fit
one GPU machine's disk), on data/default, 8 sequences of 2048 per step in two micro-batches.
Runs are cached under $ONENODE_CACHE/a2-runs/ and trained on the grader's A2 stack
(`grader.a2.job.a2_stack`; built where git works and carried with $ONENODE_CACHE).
OUT/record.json is rewritten after every case, so a job stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(KIT_ROOT), str(KIT_ROOT / "tests"), str(KIT_ROOT / "starter_code")]

from redteam.a2_forgeries import TINY_SCALE, Runs, Scale, assemble, forgeries  # noqa: E402

BASELINE = KIT_ROOT / "a2_pretrain" / "recipes" / "baseline.yaml"
GPU_SCALE = Scale(BASELINE, steps=16, batch=8, seq_len=2048, every=4, settings={
    "data.path": "data/default", "parallel.ep": 1, "train.micro_batch_size": 4,
    "model.hybrid_override_pattern": "MEM*EME", "model.hidden_size": 512, "model.n_routed_experts": 16,
    "model.num_experts_per_tok": 4, "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1,
    "log.tensorboard": False, "log.progress_bar": False})
# the deterministic mode's cost, at the course model's own size (12 steps; the first interval is warm-up)
COST = {"data.path": "data/default", "parallel.ep": 1, "train.seq_len": 4096, "train.global_batch_size": 8,
        "train.micro_batch_size": 4, "train.token_budget": 12 * 8 * 4096, "checkpoint.enabled": False,
        "eval.every_steps": 0, "log.every_steps": 2, "log.tensorboard": False, "log.progress_bar": False}
EVALUATION_TEXT = ["a sentence no training document of the offline corpus holds"]  # contamination is not measured here


def deterministic(scale: Scale, on: bool = True) -> Scale:
    return dataclasses.replace(scale, settings={**scale.settings, "train.deterministic": on})


def every(scale: Scale, steps: int) -> Scale:
    return dataclasses.replace(scale, every=steps)


def make_job(profile_name: str, workdir: Path):
    """A grading job on `profile_name` that replays every span of a run."""
    from grader.a2.job import new_job
    from grader.a2.rubric import load_rubric

    job = new_job(load_rubric(), profile_name, workdir, seed=0, notebooks=False)
    job.profile = dataclasses.replace(job.profile, replay_fraction=1.0)
    job.eval_texts = EVALUATION_TEXT
    return job


def verified(job, sub: Path, logs: Path) -> dict:
    """The grader's verification of the submission at `sub`: every check, each span's replay, each
    checkpoint's loss error."""
    from grader.a2.intake import load_submission
    from grader.a2.scoring import verify

    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    checks, cost = verify(job, load_submission(sub), logs)
    return {"verified": all(c.ok for c in checks), "checks": [c.__dict__ for c in checks],
            "spans": cost.get("spans"), "loss_relative_errors": cost.get("loss_relative_errors"),
            "replay_seconds": cost.get("replay_seconds"), "seconds": round(time.monotonic() - start, 1)}


def honest_cases(scale: Scale) -> dict:
    """Name -> the scale of an honest run: deterministic kernels (first: the forgeries' runs need
    them), the default ones with two span lengths, then another seed and compiled blocks under
    the deterministic mode, and compiled blocks with mamba_ssm's scan in its own deterministic mode
    (mamba-ssm >= 2.3 on a GPU) or with FlexAttention (a GPU; these four only when named with --only)."""
    base, strict = deterministic(scale, False), deterministic(scale)
    compiled = setting(strict, **{"train.compile": True})
    return {f"deterministic-every-{scale.every}": strict, f"default-every-{scale.every}": base,
            f"default-every-{2 * scale.every}": every(base, 2 * scale.every),
            f"deterministic-seed-1-every-{scale.every}": setting(strict, seed=1),
            f"deterministic-compiled-every-{scale.every}": compiled,
            f"deterministic-mamba-ssm-every-{scale.every}": setting(compiled, **{"model.mamba_kernel": "mamba_ssm"}),
            f"deterministic-flex-every-{scale.every}": setting(compiled, **{"model.attention_kernel": "flex"})}


def setting(scale: Scale, **settings) -> Scale:
    return dataclasses.replace(scale, settings={**scale.settings, **settings})


def failure(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[-800:]}


def measure_honest(record: dict, scale: Scale, job, work: Path, save, cpu: bool, only: list[str] | None) -> None:
    """The honest cases (by default the first two on a CPU, three on a GPU), then on a GPU the
    deterministic mode's cost (unless --only names cases and not `cost`)."""
    cases = honest_cases(scale)
    names = only or list(cases)[:2 if cpu else 3]
    unknown = sorted(set(names) - set(cases) - {"cost"})
    if unknown:
        raise SystemExit(f"no honest case {', '.join(unknown)}: choose among {', '.join(cases)} or cost")
    for name, case in ((name, cases[name]) for name in names if name in cases):
        start = time.monotonic()
        try:
            run = Runs(case).honest
            entry = verified(job, assemble(run, work / name / "sub"), work / name / "logs")
        except Exception as e:  # a case that fails (a kernel with no deterministic version) leaves the others
            record["honest"][name] = failure(e)
            save()
            continue
        manifest = json.loads((run / "run_manifest.json").read_text())
        entry.update(settings=case.small, train_seconds=round(time.monotonic() - start - entry["seconds"], 1),
                     tokens_per_s=manifest["throughput"].get("tokens_per_s"), final_loss=manifest["final_losses"])
        record["honest"][name] = entry
        shutil.rmtree(work / name)
        save()
    if cpu or (only and "cost" not in only):
        return
    from grader.a2.job import train_on_stack

    for on in (False, True):
        out, mode = work / f"cost-{on}", "deterministic" if on else "default"
        settings = {**COST, "train.deterministic": on}
        try:
            train_on_stack(BASELINE, out, settings, "--fresh")
        except Exception as e:
            record["cost"][mode] = failure(e)
            save()
            continue
        manifest = json.loads((out / "run_manifest.json").read_text())
        record["cost"][mode] = {"settings": settings, "throughput": manifest["throughput"],
                                "wall_time_s": manifest["wall_time_s"]}
        shutil.rmtree(out)
        save()


def measure_forgeries(record: dict, scale: Scale, job, work: Path, save, only: list[str] | None) -> None:
    import re

    runs = Runs(deterministic(scale))
    classes = forgeries(runs.scale)
    unknown = sorted(set(only or []) - {forgery.name for forgery in classes})
    if unknown:
        raise SystemExit(f"no forgery {', '.join(unknown)}: choose among {', '.join(f.name for f in classes)}")
    for forgery in classes:
        if only and forgery.name not in only:
            continue
        dest = work / forgery.name
        dest.mkdir()
        start = time.monotonic()
        try:
            sub = forgery.build(runs, dest)
        except Exception as e:  # one class that cannot be built still leaves the others measured
            record["forgeries"][forgery.name] = failure(e)
            save()
            shutil.rmtree(dest)
            continue
        built = round(time.monotonic() - start, 1)
        shutil.rmtree(dest / "work", ignore_errors=True)
        entry = verified(job, sub, dest / "logs")
        by_name = {c["name"]: c for c in entry["checks"]}
        entry["caught_by"] = {name: bool(name in by_name and not by_name[name]["ok"]
                                         and re.search(reason, by_name[name]["detail"]))
                              for name, reason in forgery.caught_by.items()}
        entry.update(caught=all(entry["caught_by"].values()), build_seconds=built)
        record["forgeries"][forgery.name] = entry
        shutil.rmtree(dest)
        save()


def measure_graded(record: dict, scale: Scale, profile_name: str, work: Path, out: Path, save,
                   only: list[str] | None) -> None:
    """End to end, as `onenode-grade a2 --cohort` grades: the honest deterministic run and each
    forgery class (or those of --only) in one cohort, on the profile as it is (its own replay
    fraction and tolerances), evaluated on the offline suite (a GPU machine without lm-eval's
    datasets cached) against the honest run itself as the baseline. Each result goes to
    OUT/graded/<name>.json."""
    from grader.a2 import A2
    from grader.a2.job import new_job
    from grader.a2.rubric import load_rubric
    from grader.cohort import grade_cohort

    runs = Runs(deterministic(scale))
    classes = [f for f in forgeries(runs.scale) if not only or f.name in only]
    cohort = work / "cohort"
    cohort.mkdir(parents=True)
    assemble(runs.honest, cohort / "honest")
    for forgery in classes:
        os.replace(forgery.build(runs, work / "builds" / forgery.name), cohort / forgery.name)
        shutil.rmtree(work / "builds" / forgery.name)
    job = new_job(load_rubric(), profile_name, work / "job", baseline=str(runs.honest / "final"), notebooks=False)
    # a short run: at least the share of its steps that its first and last spans take is replayed
    fraction = max(job.profile.replay_fraction, 2 * scale.every / scale.steps)
    job.profile = dataclasses.replace(job.profile, suite="offline", hf_home=None, replay_fraction=fraction)
    # without lm-eval (a GPU image may lack it) the cohort is graded as `--verify-only` does
    # and with the contamination check's text of make_job's (lm-eval reads the suite's)
    job.evaluate = record["evaluated"] = importlib.util.find_spec("lm_eval") is not None
    if not job.evaluate:
        job.eval_texts = EVALUATION_TEXT
    (work / "job").mkdir()
    start = time.monotonic()
    results = grade_cohort(A2, cohort, job, work / "out", progress=False)
    (out / "graded").mkdir(exist_ok=True)
    for result in results:
        name = result["extra_data"]["submission"]
        shutil.copy2(work / "out" / name / "results.json", out / "graded" / f"{name}.json")
        numbers = result["extra_data"].get("numbers", {})
        record["graded"][name] = {
            "score": result["score"], "verified": numbers.get("verified"),
            "replay_fraction": numbers.get("replay_fraction"), "grading_seed": result["extra_data"].get("seed"),
            "failed_checks": [c["name"] for c in result["extra_data"].get("audit", []) if not c.get("ok")],
            "feedback": result.get("output") or ""}
    record["graded_seconds"] = round(time.monotonic() - start, 1)
    save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the record's folder (benchmarks/results/<date>-h200-a2-verification)")
    parser.add_argument("part", choices=("honest", "forgeries", "graded"))
    parser.add_argument("--cpu", action="store_true", help="the tiny scale on a CPU, profile cpu-tiny")
    parser.add_argument("--only", nargs="+", metavar="CASE",
                        help="these cases only: honest runs (deterministic-seed-1-every-4, "
                             "deterministic-compiled-every-4, ..., cost) or forgery classes (forged-first-span, ...)")
    args = parser.parse_args(argv)
    from onenode.train.logging import environment, git_commit

    if not args.cpu and not (KIT_ROOT / "data" / "default" / "manifest.json").is_file():
        raise SystemExit("no data/default: build it first with `onenode data build --out data/default`")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scale, profile = (TINY_SCALE, "cpu-tiny") if args.cpu else (GPU_SCALE, "h200x1")
    work = Path(tempfile.mkdtemp(prefix="a2-verification-", dir=os.environ.get("ONENODE_SCRATCH")))
    job = make_job(profile, work / "job")
    record = {"what": f"A2 verification measured on {profile}, every span replayed: the {args.part} runs",
              "command": " ".join(["python", "benchmarks/a2_verification.py", args.out, args.part,
                                   *(["--cpu"] if args.cpu else []), *(["--only", *args.only] if args.only else [])]),
              "commit": os.environ.get("ONENODE_COMMIT") or git_commit() or "unknown", **environment(1),
              "profile": {key: getattr(job.profile, key) for key in ("name", "replay_tolerance", "loss_tolerance")},
              "scale": {**dataclasses.asdict(scale), "recipe": str(scale.recipe.relative_to(KIT_ROOT))},
              "honest": {}, "forgeries": {}, "cost": {}, "graded": {}}

    def save() -> None:
        (out / "record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")

    save()
    try:
        if args.part == "honest":
            measure_honest(record, scale, job, work, save, args.cpu, args.only)
        elif args.part == "graded":
            measure_graded(record, scale, profile, work, out, save, args.only)
        else:
            measure_forgeries(record, scale, job, work, save, args.only)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for part in ("honest", "forgeries"):
        for name, entry in record[part].items():
            spans = ["bitwise" if s.get("bitwise") else f"{s.get('relative_error'):.2g}"
                     for s in entry.get("spans") or []]
            print(f"{part:<10} {name:<26} verified {entry.get('verified')!s:<5} caught {entry.get('caught', '-')!s:<5} "
                  f"spans {' '.join(spans)} {entry.get('error', '')}")
    for name, entry in record["graded"].items():
        print(f"graded     {name:<26} score {entry['score']} verified {entry['verified']} "
              f"failed {', '.join(entry['failed_checks']) or '-'}")
    for mode, entry in record["cost"].items():
        speed = entry.get("throughput", {}).get("tokens_per_s", 0)
        print(f"cost {mode:<14} {speed:,.0f} tokens/s {entry.get('error', '')}")
    print(f"-> {out / 'record.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
