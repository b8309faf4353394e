"""Verification of an A2 run: its weights tied to its recipe, its data and its token count,
every span of the checkpoint chain examined and some trained again.

The trainer keeps its seeded initialisation (step 0) and a chain of checkpoints, each naming the
one before it (`audit.chain_problem` checks the links). Here the harness (`replay_harness.py`,
run as a child process: the grader's on its pristine A2 stack in the sandbox, since the
checkpoints are untrusted input, `grader/a2/replay.py`; `onenode verify`'s on the student's own
install, `replay_here`) recomputes, from the files alone:
- the recipe's seeded initialisation, which the step-0 checkpoint must be;
- every checkpoint's weights hash, which its meta.json must record, and final/'s, which must be
  the last checkpoint's;
- the data: a fresh loader on the submitted shards stepped through the run. Its batches are the
  ones the replay trains on and the loss checks use; the loader state a checkpoint stores is
  compared with its position, never used;
- every span (cheap): how far it moved each weight against the most any training at the
  schedule's learning rates can move it (above that bound, no training made the later
  checkpoint from the earlier), and each checkpoint's loss on the grader's batch of the next
  step, which must be the loss the run recorded for that step (the next checkpoint's trainer
  state, and the log where it has the step);
- every checkpoint's optimizer state (cheap; a span starts from it): the recipe's settings, step
  counters at its step, moments no larger than its steps of clipped gradients make them
  (`replay_harness.optimizer_state_problem`);
- the first span, the last span and random ones (the job's seed and the submission's name),
  trained again from the earlier checkpoint, which must give the later one back, its weights and
  its optimizer state: bit for bit on the run's layout and hardware, or within the profile's
  `replay_tolerance` (replayed - recorded, relative to how far the span moved them).
The checkpoints must be one interval apart (the last span may be shorter), and the random spans
add up to at most the profile's `replay_fraction` of the run's steps, so that interval must be
that short: a run checkpointed more sparsely, or at uneven intervals, is not verified. A forgery
inside the movement bound and the recorded losses (weights nudged, other batches recorded as the
grader's, moments that steer the next span) is caught when its span is replayed:
`detection_probability` says how surely, and the feedback states it for the run's own spans.
The seconds it took are recorded.

`profile` is the rubric's A2 profile (`a2_pretrain/rubric.toml`: the grader's `A2Profile`,
`onenode verify`'s `cli.RubricProfile`); what is read of it: device, threads, replay_fraction,
replay_minutes, replay_tokens_per_s, deterministic_runs, replay_tolerance, loss_tolerance.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .audit import Check, chain_problem
from .intake import A2Submission, Link

HARNESS_MODULE = "onenode.verify.replay_harness"
DILOCO_HARNESS_MODULE = "onenode.verify.diloco_replay"  # the same plan and report, every replica group's chain
Harness = Callable[[list[tuple[int, int]]], tuple[dict, float]]  # spans -> (the harness's report, wall seconds)


def uneven_interval(chain: list[Link]) -> str | None:
    """Why the chain's checkpoints are not one interval apart (every span as long as the first,
    the last one at most that), in one line, or None.

    Why one interval, rather than drawing steps and replaying the span of each: draws within a
    replay budget are uniform only when each costs the same. With uneven spans a draw costs the
    span it hits, so a plan that draws until the budget is spent reaches a long span (where forged
    steps hide among short ones) only while little of the budget is spent, far less often than its
    steps say (the flaw of drawing spans by their steps until the budget ran out); and a plan that
    fixes its number of draws beforehand must price each at the longest span, leaving most of the
    budget unspent. One interval makes every span cost the same and be drawn alike, so
    `detection_probability` is exactly what a forgery of m middle spans faces, as the feedback
    says. The trainer checkpoints every `checkpoint.every_steps` and at the end, so an honest run
    has one interval and a shorter last span (always replayed): the rule refuses an honest run only
    if it was stopped off its interval."""
    lengths = [link.step - before.step for before, link in zip(chain, chain[1:])]
    for i, length in enumerate(lengths):
        if length != lengths[0] and not (i == len(lengths) - 1 and 0 < length < lengths[0]):
            return (f"{chain[i].path.name} -> {chain[i + 1].path.name} is {length} steps, where the chain's first "
                    f"span is {lengths[0]}: the grader replays only runs checkpointed at one interval (so that each "
                    "span is as likely to be replayed), every checkpoint.every_steps, the last span at most that; "
                    "stop and resume a run only at a multiple of it")
    return None


def choose_spans(chain: list[Link], random_steps: int, seed: str) -> list[tuple[int, int]]:
    """The first and the last span (indices of consecutive checkpoints), then as many of the
    others as `random_steps` holds, drawn uniformly without replacement. The spans are one
    interval long (`uneven_interval`), so every middle span is as likely to be drawn."""
    rng = random.Random(seed)
    ends = {(0, 1), (len(chain) - 2, len(chain) - 1)}
    middle = [(i, i + 1) for i in range(1, len(chain) - 2)]
    interval = chain[1].step - chain[0].step
    return sorted([*ends, *rng.sample(middle, min(len(middle), random_steps // interval))])


def detection_probability(spans: int, drawn: int, forged: int) -> float:
    """How surely a run with `forged` of its `spans` spans forged inside the per-span checks is
    caught when the first and last spans and `drawn` random others (uniformly, equal spans) are
    replayed: 1 - C(middle - forged, drawn) / C(middle, drawn), with the forged spans in the
    middle (the forger's best case; a forged first or last span is always replayed)."""
    middle = spans - min(spans, 2)
    if forged <= 0:
        return 0.0
    if forged > middle:
        return 1.0
    return 1.0 - math.comb(middle - forged, drawn) / math.comb(middle, drawn)


def detection_line(chain: list[Link], replayed: list[tuple[int, int]]) -> str:
    """The feedback's sentence on how surely a forgery that passes the per-span checks is caught,
    for this run's own plan: its spans (one interval apart) and the spans `replayed` of them."""
    spans = len(chain) - 1
    drawn = len(set(replayed) - {(0, 1), (spans - 1, spans)})
    shares = [(f"{share:.0%} of them", max(1, math.ceil(share * spans))) for share in (0.1, 0.25)]
    odds = ", ".join(f"{detection_probability(spans, drawn, forged):.0%} if it forged {what}"
                     for what, forged in [("one span", 1), *shares])
    return (f"of its {spans} spans (every {chain[1].step - chain[0].step} steps) the first, the last and {drawn} "
            f"drawn at random were replayed: a forgery inside the movement bound and the recorded losses is "
            f"caught {odds}")


def replay_plan(sub: A2Submission, profile, seed: str,
                tokens_per_step: int) -> tuple[list[tuple[int, int]], str | None]:
    """The spans to replay, or why the run cannot be replayed on this profile's machine. The
    random spans add up to at most `replay_fraction` of the run's steps and, where the profile
    gives the node's time for it (`replay_minutes` at `replay_tokens_per_s`), to what that time
    leaves after the first and the last span."""
    chain = sub.chain
    layout = chain[-1].meta.get("layout")
    if not isinstance(layout, dict) or layout.get("device") not in ("cpu", "cuda") or not all(
            isinstance(layout.get(key), int) and 1 <= layout[key] <= 256 for key in ("world_size", "threads")):
        return [], f"{chain[-1].path.name}/meta.json records no layout to replay it on"
    if layout["device"] != profile.device:
        return [], f"the run trained on {layout['device']}; this profile replays on {profile.device}"
    if chain[-1].step == 0:
        return [], "the chain holds no training step"
    uneven = uneven_interval(chain)
    if uneven:
        return [], uneven
    allowed = int(profile.replay_fraction * chain[-1].step)
    if profile.replay_minutes is not None:
        in_time = int(profile.replay_minutes * 60 * profile.replay_tokens_per_s / tokens_per_step)
        ends = sum(chain[i + 1].step - chain[i].step for i in {0, len(chain) - 2})
        if ends > in_time:
            return [], (f"its first and last spans ({ends} steps) take longer to replay than the "
                        f"{profile.replay_minutes:g} minutes this profile gives a run ({in_time} steps of "
                        f"{tokens_per_step:,} tokens): checkpoint at least every {max(in_time // 2, 1)} steps "
                        "(checkpoint.every_steps)")
        allowed = min(allowed, in_time - ends)
    longest = max(b.step - a.step for a, b in zip(chain, chain[1:]))
    if longest > allowed:
        return [], (f"checkpoints up to {longest} steps apart: the grader replays at random at most {allowed} of "
                    f"the run's {chain[-1].step} steps, so checkpoint at least every {max(allowed, 1)} steps "
                    "(checkpoint.every_steps)")
    return choose_spans(chain, allowed, seed), None


def harness_plan(sub: A2Submission, final: str, spans: list[tuple[int, int]], threads: int | None) -> dict:
    """The harness's plan.json (`replay_harness`): the run and its data read in place, `final` a
    readable copy of final/ (or final/ itself), the spans to replay."""
    return {"run": str(sub.root.resolve()), "final": final, "data": str(sub.data.resolve()) if sub.data else None,
            "checkpoints": [link.path.name for link in sub.chain], "spans": spans, "threads": threads}


def harness_launch(sub: A2Submission, profile, threads: int | None) -> tuple[list[str], dict, int]:
    """The harness's command line, run in the folder of its plan.json (under torchrun with the
    run's ranks when it had several; a DiLoCo run's harness for a recipe of `parallel.diloco`), its
    environment and the CPU threads it uses: the run's own, unless `threads` says."""
    from ..train.recipe import load_recipe

    layout = sub.chain[-1].meta["layout"]
    world = layout.get("world_size", 1)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    threads_used = threads or layout.get("threads") or profile.threads
    env = {"OMP_NUM_THREADS": str(threads_used), "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
           "PYTHONHASHSEED": "0"}
    module = DILOCO_HARNESS_MODULE if load_recipe(sub.recipe).parallel.diloco.inner_steps else HARNESS_MODULE
    return [*launcher, "-m", module, "plan.json"], env, threads_used


def harness_report(folder: Path, log: str, reason: str | None) -> dict:
    """The report the harness wrote in `folder`, or {"error": why it did not} from its `log`."""
    report_file = folder / "replay.json"
    if not report_file.is_file():
        tail = " ".join(log.strip().splitlines()[-1:])[:300]
        return {"error": f"the replay did not finish ({reason or 'no report'}): {tail}"}
    return json.loads(report_file.read_text())


def replay_here(sub: A2Submission, spans: list[tuple[int, int]], profile, threads: int | None = None,
                log: Path | None = None) -> tuple[dict, float]:
    """The harness of this install's own `onenode`, in a child process without a sandbox
    (`onenode verify`: the run and the code are the student's own), launched as the grader
    launches it; (its report, the wall seconds it took). Its output goes to `log`."""
    import onenode

    command, env, _ = harness_launch(sub, profile, threads)
    path = os.pathsep.join(p for p in (str(Path(onenode.__file__).resolve().parents[1]),
                                       os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="onenode-verify-") as folder:
        (Path(folder) / "plan.json").write_text(json.dumps(harness_plan(sub, str(sub.checkpoint.resolve()),
                                                                        spans, threads)))
        began = time.monotonic()
        done = subprocess.run(command, cwd=folder, env={**os.environ, **env, "PYTHONPATH": path},
                              capture_output=True, text=True)
        output = done.stdout + "\n" + done.stderr
        if log is not None:
            log.write_text(output, encoding="utf-8")
        reason = f"exit status {done.returncode}" if done.returncode else None
        return harness_report(Path(folder), output, reason), time.monotonic() - began


def replay_checks(sub: A2Submission, profile, seed: str, harness: Harness,
                  random_spans: int | None = None) -> tuple[list[Check], dict]:
    """The replay's checks (initialisation, weights, final weights, data order, movement, optimizer
    state, logged losses, replay) and what it cost ({"replay_steps", "replay_fraction",
    "replay_seconds", "verify_seconds", "run_seconds", "spans", "loss_relative_errors"}).
    `harness` runs the replay harness on the spans drawn by `seed` (the grader's: sandboxed on its
    pristine stack; `onenode verify`'s: `replay_here`); `random_spans`, if given, replays that many
    random spans besides the first and the last instead of the plan's (its refusals still hold)."""
    from ..train.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(sub.recipe)
        broken = chain_problem(sub.chain, recipe.training_sha256)
    except (RecipeError, OSError):
        recipe, broken = None, "recipe.yaml does not load"
    spans, problem = ([], f"not replayed: {broken.split(':')[0]}") if broken else \
        replay_plan(sub, profile, seed, recipe.tokens_per_step)
    if not problem and profile.deterministic_runs and not recipe.train.deterministic:
        problem = ("the run trained without `train.deterministic: true`: on this profile's GPUs two runs of one "
                   "recipe part after a few steps on the default kernels, so no replay can tell it from a forgery; "
                   "train graded runs with it (a2_pretrain/README.md)")
    if problem:
        return [Check("replay", False, problem)], {}
    if random_spans is not None:
        spans = choose_spans(sub.chain, random_spans * (sub.chain[1].step - sub.chain[0].step), seed)
    start = time.monotonic()
    report, wall = harness(spans)
    if report.get("error"):
        return [Check("replay", False, f"the replay failed: {report['error']}")], {}
    chain, recomputed = sub.chain, report["checkpoints"]
    groups = _groups(sub, report)
    if isinstance(groups, str):
        return [Check("replay", False, f"the replay failed: {groups}")], {}
    checks = [Check("initialisation", recomputed[0]["weights_sha256"] == report["init_sha256"],
                    f"step_00000000 {'is' if recomputed[0]['weights_sha256'] == report['init_sha256'] else 'is NOT'} "
                    f"the recipe's seeded initialisation (re-created by the grader)")]
    forged = next(((where, link) for where, links, found, _ in groups for link, entry in zip(links, found)
                   if link.weights != entry["weights_sha256"]), None)
    checks.append(Check("weights", forged is None, f"{forged[0]}{forged[1].path.name}/meta.json records weights that "
                        "are not its own" if forged else f"the {len(chain)} checkpoints hold the weights their chain "
                        f"records{_of_every_group(groups)}"))
    final_ok = report["final_sha256"] == recomputed[-1]["weights_sha256"]
    checks.append(Check("final weights", final_ok, f"final/ {'holds' if final_ok else 'does NOT hold'} the weights of "
                        f"the chain's last checkpoint ({chain[-1].path.name})"))
    moved = next(((where, entry) for where, _, found, _ in groups for entry in found if entry["loader"]), None)
    checks.append(Check("data order", moved is None, f"{moved[0]}{moved[1]['name']}'s stored data position is not the "
                        f"one the submitted data gives at that step ({moved[1]['loader']}): it trained on other data "
                        "or another order" if moved else "every checkpoint's stored data position is the one the "
                        f"submitted data gives{_of_every_group(groups)} (the grader reads its own batches either way)"))
    checks.append(Check("movement", *_movement(recomputed)))
    checks.append(Check("optimizer state", *_optimizer_states(groups, recipe.train.grad_clip)))
    checks.append(Check("logged losses", *_logged_losses(groups, profile.loss_tolerance)))
    steps = sum(span["steps"] for span in report["spans"])
    seconds = sum(span["seconds"] for span in report["spans"])
    ok, detail = _replayed(report["spans"], chain[-1].step, profile.replay_tolerance)
    checks.append(Check("replay", ok, f"{detail}; {detection_line(chain, spans)}" if ok else detail))
    manifest_seconds = sub.manifest.get("wall_time_s")
    cost = {"replay_steps": steps, "replay_fraction": steps / chain[-1].step, "replay_seconds": seconds,
            "verify_seconds": wall or time.monotonic() - start,
            "run_seconds": manifest_seconds if isinstance(manifest_seconds, (int, float)) else None,
            # what the tolerances are measured from (benchmarks/a2_baseline.py --replay)
            "spans": [{key: span.get(key) for key in ("start", "end", "steps", "bitwise", "relative_error",
                                                      "optimizer_bitwise", "optimizer_relative_error")}
                      for span in report["spans"]],
            "loss_relative_errors": _loss_errors(recomputed[:-1])}
    return checks, cost


def _movement(recomputed: list[dict]) -> tuple[bool, str]:
    """Whether every span moved the weights no further than training at its learning rates can."""
    spans = [found for found in recomputed[1:] if found["movement"] is not None]
    over = next((found for found in spans if not found["movement"] <= 1.0), None)
    if over is not None:
        before = recomputed[recomputed.index(over) - 1]["name"]
        return False, (f"{before} -> {over['name']} moved {over['movement_at']} {over['movement']:.3g} times as far "
                       "as any training at the schedule's learning rates can: that checkpoint was not trained from "
                       "the one before")
    most = max((found["movement"] for found in spans), default=0.0)
    return len(spans) == len(recomputed) - 1, (f"every one of the {len(spans)} spans moved the weights within what "
                                                f"its learning rates allow (at most {most:.2f} of the bound)")


def _groups(sub: A2Submission, report: dict) -> list[tuple[str, list[Link], list[dict], list[dict]]] | str:
    """Every replica group's (name for the feedback, chain, the harness's entries, log): the run's
    own alone, or with a DiLoCo run's other groups (`sub.replicas`, the harness's "groups"); or
    why the report does not cover them."""
    groups = [("", sub.chain, report["checkpoints"], sub.metrics)]
    others = report.get("groups", [])
    if len(others) != len(sub.replicas):
        return f"the harness examined {len(others)} other replica groups, the run holds {len(sub.replicas)}"
    for group, entries in zip(sub.replicas, others):
        groups.append((f"{group.root.name}/", group.chain, entries, group.metrics))
    if any(len(entries) != len(chain) for _, chain, entries, _ in groups):
        return "the harness did not examine every checkpoint of every replica group"
    return groups


def _of_every_group(groups: list) -> str:
    return f", in each of the {len(groups)} replica groups" if len(groups) > 1 else ""


def _optimizer_states(groups: list, grad_clip: float) -> tuple[bool, str]:
    """Whether every checkpoint stores an optimizer state that training of the recipe makes (the
    state the span after it starts from), and, in a DiLoCo run, the same outer momentum in every
    group."""
    for where, _, recomputed, _ in groups:
        bad = next((found for found in recomputed if found["optimizer"]), None)
        if bad is not None:
            return False, (f"{where}{bad['name']} stores an optimizer state no training of the recipe makes: "
                           f"{bad['optimizer']}")
    lead = groups[0][2]
    for where, _, recomputed, _ in groups[1:]:
        apart = next((found for found, ours in zip(recomputed, lead)
                      if found.get("outer_momentum_sha256") != ours.get("outer_momentum_sha256")), None)
        if apart is not None:
            return False, (f"{where}{apart['name']} stores another outer momentum than group 0's: every group takes "
                           "the same outer step")
    clip = f"gradients clipped to norm {grad_clip:g}" if grad_clip > 0 else "gradients (the recipe clips none)"
    return True, (f"every one of the {len(lead)} checkpoints{_of_every_group(groups)} stores the recipe's optimizer "
                  f"settings, step counters at its step and moments within what its steps of {clip} make")


def _loss_errors(recomputed: list[dict]) -> list[float | None]:
    """Each checkpoint's loss on the grader's batch of the next step against the one its successor's
    trainer state records, relative (None where either is missing)."""
    return [abs(found["next_loss"] - found["stored_next_loss"]) / max(abs(found["stored_next_loss"]), 1e-12)
            if isinstance(found.get("next_loss"), float) and isinstance(found.get("stored_next_loss"), float)
            else None for found in recomputed]


def _logged_losses(groups: list, tolerance: float) -> tuple[bool, str]:
    """Whether each checkpoint's loss on the grader's batch of the step after it is the loss the
    run recorded for that step: in the next checkpoint's trainer state (every step's loss) and,
    where it has the step, in metrics.jsonl; in a DiLoCo run each group's on its own slice, by
    its own files."""
    in_log = 0
    for where, chain, recomputed, records in groups:
        logged = {r["step"]: r["loss"] for r in records if isinstance(r.get("step"), int)
                  and isinstance(r.get("loss"), (int, float))}
        for link, found in zip(chain[:-1], recomputed[:-1]):
            step, ours = link.step + 1, found["next_loss"]
            state = f"the next checkpoint's trainer state{' in ' + where if where else ''}"
            claims = [(state, found["stored_next_loss"])]
            if step in logged:
                in_log += 1
                claims.append((f"{where}metrics.jsonl", logged[step]))
            for what, claimed in claims:
                if claimed is None:
                    return False, f"{what} records no loss for step {step}: submit the files the trainer wrote"
                if not math.isclose(claimed, ours, rel_tol=tolerance):
                    return False, (f"{what} records loss {claimed:.6g} at step {step}; {where}{link.path.name} has "
                                   f"loss {ours:.6g} on the grader's batch of that step: it trained on other data, "
                                   "or those weights are not the ones it trained")
    compared = sum(len(chain) - 1 for _, chain, _, _ in groups)
    return True, (f"every checkpoint's loss on the grader's batch of the next step is the one its successor's "
                  f"trainer state records{_of_every_group(groups)} ({compared} compared; the logs have {in_log} of "
                  "those steps)")


def _replayed(spans: list[dict], run_steps: int, tolerance: float) -> tuple[bool, str]:
    """Whether every replayed span gave its end back, and the line that says so (or why not)."""
    for span in spans:
        if span.get("error"):
            return False, f"{span['start']} -> {span['end']} could not be replayed: {span['error']}"
        if not span["bitwise"] and not span["relative_error"] <= tolerance:
            return False, (f"{span['start']} -> {span['end']} replayed does not give {span['end']} back (relative "
                           f"error {span['relative_error']:.3g}, tolerance {tolerance:g}): those weights were not "
                           "trained by that span")
        if not span["optimizer_bitwise"] and not span["optimizer_relative_error"] <= tolerance:
            return False, (f"{span['start']} -> {span['end']} replayed does not give the optimizer state "
                           f"{span['end']} stores back (relative error {span['optimizer_relative_error']:.3g}, "
                           f"tolerance {tolerance:g}): that state was not made by training that span")
    steps, seconds = sum(s["steps"] for s in spans), sum(s["seconds"] for s in spans)
    near = [s["relative_error"] for s in spans if not s["bitwise"]] + \
        [s["optimizer_relative_error"] for s in spans if not s["optimizer_bitwise"]]
    how = f"within the tolerance (relative error up to {max(near):.1e}, tolerance {tolerance:g})" if near \
        else "bit for bit"
    return True, (f"{len(spans)} span(s) of {steps} steps ({steps / run_steps:.0%} of the run's {run_steps}) "
                  f"replayed {how} in {seconds:.1f} s")
