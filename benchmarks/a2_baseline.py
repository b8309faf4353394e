"""The course's A2 baseline recipe, trained for a few minutes on one H200 (or at tiny scale on a
CPU), exported and evaluated with lm-eval on the offline suite: the record the baseline's speed
and scores come from. Training and evaluation run on the A2 stack students get (the starter with
the reference A1 patch, `grader.a2.job.a2_stack`).

    python benchmarks/a2_baseline.py benchmarks/results/DATE-h200-a2-baseline-offline   # one H200
    python benchmarks/a2_baseline.py /tmp/a2-baseline-cpu --cpu                         # a CPU, tiny model
    python benchmarks/a2_baseline.py benchmarks/results/DATE-h200-a2-replay --replay   # the replay's cost
    python benchmarks/a2_baseline.py OUT --set train.compile=true --set train.micro_batch_size=8   # a variant

It needs data/default (`onenode data build --out data/default`: the offline corpus with the GPT-2
BPE, the baseline's tokenizer). On the GPU: `a2_pretrain/recipes/baseline.yaml` on data/default,
one GPU (ep 1), 8 sequences of 4096 per step, 128 steps (4,194,304 tokens), no checkpoints (the
export still happens); with --cpu the tiny preset with the baseline's vocabulary at sequence
length 64, and 50 items per task. It writes OUT/run/ (the run folder, final/ with its tokenizer),
OUT/eval.json (the `onenode eval` report: every task with its standard error) and
OUT/record.json (the commands, commit, versions, hardware, the run's throughput and the scores).

--replay measures what the grader's replay costs and how far it lands on this machine: the same
recipe cut to 7 layers (so that its checkpoints fit the disk), 64 steps with a checkpoint every
16, then every span replayed by the grader's own code in its sandbox (`grader.a2.replay`, replay
fraction 1): the record gets the replay checks (bit for bit, or the largest relative error: what
`replay_tolerance` in a2_pretrain/rubric.toml must exceed), each checkpoint's loss on the grader's
batch against the recorded one (what `loss_tolerance` must exceed), and their seconds beside the
run's; it evaluates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "a2_pretrain/recipes/baseline.yaml"
GPU = {"data.path": "data/default", "parallel.ep": 1, "train.token_budget": 4_194_304,
       "train.global_batch_size": 8, "train.micro_batch_size": 4, "checkpoint.enabled": False,
       "eval.every_steps": 0, "log.every_steps": 8, "log.tensorboard": False, "log.progress_bar": False}
CPU = {**GPU, "model.preset": "tiny", "model.n_routed_experts": 8, "model.num_experts_per_tok": 2,
       "model.moe_intermediate_size": 32, "model.moe_shared_expert_intermediate_size": 64, "train.seq_len": 64,
       "train.token_budget": 8192, "train.micro_batch_size": 8, "train.precision": "fp32", "train.device": "cpu"}
REPLAY = {"model.hybrid_override_pattern": "MEM*EME", "train.token_budget": 64 * 8 * 4096,
          "checkpoint.enabled": True, "checkpoint.every_steps": 16, "checkpoint.keep_last": 0}
EVAL = {"gpu": ["--device", "cuda", "--batch-size", "64", "--max-length", "1024"],
        "cpu": ["--device", "cpu", "--batch-size", "32", "--max-length", "256", "--limit", "50"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the record's folder (benchmarks/results/<date>-h200-a2-baseline-offline)")
    parser.add_argument("--cpu", action="store_true", help="the tiny preset on a CPU (checks the path in minutes)")
    parser.add_argument("--replay", action="store_true", help="measure the grader's replay of the run instead")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="train this many tokens instead (the record says so): a shorter run on a GPU")
    parser.add_argument("--stack", default=None,
                        help="the A2 stack's folder (holding starter_code/), built where git works and carried "
                             "(default: built now, $ONENODE_CACHE/a2-stack/)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe setting over the job's (repeatable), e.g. train.compile=true: the "
                             "record's train command shows it")
    args = parser.parse_args(argv)
    if any("=" not in setting for setting in args.settings):
        parser.error("--set takes KEY=VALUE, e.g. --set train.micro_batch_size=8")
    sys.path.insert(0, str(KIT_ROOT))
    sys.path.insert(0, str(KIT_ROOT / "starter_code"))
    from onenode.train.logging import environment, git_commit

    if not (KIT_ROOT / "data" / "default" / "manifest.json").is_file():
        raise SystemExit("no data/default: build it first with `onenode data build --out data/default`")
    if args.stack:
        stack = Path(args.stack)
    else:
        from grader.a2.job import a2_stack

        stack = a2_stack()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = CPU if args.cpu else GPU
    if args.replay:
        overrides = {**overrides, **REPLAY, **({"train.token_budget": 64 * 8 * 64} if args.cpu else {})}
    if args.token_budget:  # last: it holds with --replay too
        overrides = {**overrides, "train.token_budget": args.token_budget}
    overrides = {**overrides, **dict(setting.split("=", 1) for setting in args.settings)}
    train = [sys.executable, "-m", "onenode.cli", "train", RECIPE, "--out", str(out / "run"), "--fresh",
             *(f"--set={k}={v}" for k, v in overrides.items())]
    evaluate = [sys.executable, "-m", "onenode.cli", "eval", str(out / "run" / "final"), "--suite", "offline",
                *EVAL["cpu" if args.cpu else "gpu"], "--out", str(out / "eval.json")]
    path = os.pathsep.join([str(stack / "starter_code"), *filter(None, [os.environ.get("PYTHONPATH")])])
    commit = os.environ.get("ONENODE_COMMIT") or git_commit() or "unknown"
    env = {**os.environ, "PYTHONPATH": path, "ONENODE_COMMIT": commit}
    commands = (train,) if args.replay else (train, evaluate)  # the replay's record needs no scores
    with open(out / "log.txt", "w") as log:
        for command in commands:
            log.write("$ " + " ".join(command) + "\n")
            log.flush()
            if subprocess.run(command, cwd=KIT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"`{' '.join(command[2:5])}` failed: see {out / 'log.txt'}")
    manifest = json.loads((out / "run" / "run_manifest.json").read_text())
    if args.replay:
        result = {"replay": replayed(out / "run", stack, "cpu-tiny" if args.cpu else "h200x1")}
    else:
        report = json.loads((out / "eval.json").read_text())
        result = {"eval": {key: report[key] for key in ("suite", "limit", "max_length", "headline", "seconds")}}
    record = {
        "what": ("the A2 baseline recipe cut to 7 layers, trained with checkpoints and replayed by the grader"
                 if args.replay else
                 "the A2 baseline recipe, a few minutes of training, evaluated on the offline suite")
                + (" (tiny preset on CPU: checks the path, not the baseline)" if args.cpu else ""),
        "commands": ["python " + " ".join(command[1:]) for command in commands],
        "commit": env["ONENODE_COMMIT"],
        **environment(1),
        "train": {key: manifest[key] for key in ("parameters", "tokens_seen", "steps", "wall_time_s", "throughput",
                                                 "final_losses")},
        **result,
    }
    (out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    for task, entry in result.get("eval", {}).get("headline", {}).items():
        print(f"{task:<20} {entry['metric']:<16} {entry['value']:.4f} ± {entry['stderr'] or 0:.4f}")
    print(f"{manifest['tokens_seen']:,} tokens at {manifest['throughput'].get('tokens_per_s', 0):,.0f} tokens/s "
          f"-> {out / 'record.json'}")
    if args.replay:
        print(json.dumps(result["replay"], indent=2))
    return 0


def replayed(run: Path, stack: Path, profile_name: str) -> dict:
    """Every span of `run` replayed by the grader (its data folder copied in, as a submission
    holds it): the replay's checks and their cost."""
    import dataclasses
    import shutil

    from grader.a2.intake import load_submission
    from grader.a2.replay import run_harness
    from grader.a2.rubric import load_rubric
    from onenode.verify.replay import replay_checks

    shutil.copytree(KIT_ROOT / "data" / "default", run / "data", dirs_exist_ok=True)
    profile = dataclasses.replace(load_rubric().profile(profile_name), replay_fraction=1.0)
    sub = load_submission(run, notebook=False)
    checks, cost = replay_checks(sub, profile, "benchmark", lambda spans: run_harness(sub, stack, spans, profile, run))
    return {"checks": [c.__dict__ for c in checks], "cost": cost}


if __name__ == "__main__":
    sys.exit(main())
