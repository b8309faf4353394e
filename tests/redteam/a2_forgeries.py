"""Forged A2 runs, written as a group that wants the points without the training would write
them: every file the grader reads as a claim is edited to agree, and the lie sits where the
grader does not replay. Each is built from real runs of the tiny recipe on the grader's A2 stack
(cached), and names the checks that must fail whatever spans the job's seed draws.

- forged first, middle or last span: one checkpoint's weights swapped for those of a run trained
  four times as long (its recorded hash updated), the rest of the chain trained on from it, so
  every other link is honest;
- rewritten loader states: one span trained on other batches (later ones of the same data), its
  checkpoint's loader state rewritten to the position the submitted data gives, the run continued
  on the right data;
- more tokens: a run of four times the budget, every file edited to claim the budget;
- a larger batch: a run of four times the batch, every file (loader states too) edited to claim
  the recipe's;
- steered moments: before each checkpoint, the optimizer's moments set to push the next span
  towards the four-times-longer run's weights, each span then trained honestly from the state
  stored (every replay bit for bit, every recorded loss true);
- a long span among short ones: a run checkpointed twice as often, one span of the usual
  interval left in its middle, whose second half trained on other batches;
- a hidden replica: two-replica DiLoCo emulated by hand (every checkpoint the average of two
  copies trained one interval from the one before, the second on batches the first never sees),
  submitted with the recipe, manifest and log of a one-replica run, which count one copy's tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

KIT = Path(__file__).resolve().parents[2]
TINY = KIT / "a2_pretrain" / "recipes" / "tiny.yaml"


@dataclass(frozen=True)
class Scale:
    """The size of the runs the forgeries are made of: a recipe, the honest run's steps, batch and
    sequence length, its checkpoint interval, and the recipe's other settings. The long run trains
    four times the steps (checkpointing four times as sparsely, so that claiming a quarter of it
    gives the honest chain's spacing), the wide one four times the batch."""

    recipe: Path
    steps: int
    batch: int
    seq_len: int
    every: int
    settings: dict

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def budget(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def small(self) -> dict:
        return {**self.settings, "train.seq_len": self.seq_len, "train.global_batch_size": self.batch,
                "train.token_budget": self.budget, "checkpoint.every_steps": self.every, "checkpoint.keep_last": 0}

    @property
    def fine(self) -> dict:
        """The honest run checkpointed twice as often."""
        return {**self.small, "checkpoint.every_steps": self.every // 2}

    @property
    def long(self) -> dict:
        return {**self.small, "train.token_budget": 4 * self.budget, "checkpoint.every_steps": 4 * self.every}

    @property
    def wide(self) -> dict:
        return {**self.small, "train.global_batch_size": 4 * self.batch, "train.token_budget": 4 * self.budget}


# 20 steps of 4 x 32 tokens in 2 micro-batches, a checkpoint every 2 steps (10% of the run: the
# cpu-tiny profile replays the first, the last and one random span): seconds on the grader's A2 stack.
TINY_SCALE = Scale(TINY, steps=20, batch=4, seq_len=32, every=2, settings={
    "train.micro_batch_size": 2, "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1,
    "log.tensorboard": False, "log.progress_bar": False})
STEPS, EVERY = TINY_SCALE.steps, TINY_SCALE.every
TOKENS_PER_STEP, BUDGET = TINY_SCALE.tokens_per_step, TINY_SCALE.budget
SMALL, LONG, WIDE = TINY_SCALE.small, TINY_SCALE.long, TINY_SCALE.wide  # the honest, 4x-longer and 4x-wider runs


def make_reference():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_reference", KIT / "solutions" / "a2" / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Runs:
    """The real runs the forgeries start from, each trained once (cached by content)."""

    def __init__(self, scale: Scale = TINY_SCALE):
        self.scale = scale

    def _trained(self, overrides: dict) -> Path:
        from grader.a2.job import trained_run

        return trained_run(self.scale.recipe, overrides)

    @cached_property
    def honest(self) -> Path:
        return self._trained(self.scale.small)

    @cached_property
    def fine(self) -> Path:
        return self._trained(self.scale.fine)

    @cached_property
    def long(self) -> Path:
        return self._trained(self.scale.long)

    @cached_property
    def wide(self) -> Path:
        return self._trained(self.scale.wide)


@dataclass(frozen=True)
class Forgery:
    name: str
    build: Callable[[Runs, Path], Path]  # (the runs, a destination folder) -> the submission folder
    caught_by: dict[str, str]  # check that must fail -> regex over its detail
    slow: bool = True


# --------------------------------------------------------------------------- editing a run


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def metas(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step_*/meta.json"))


def swap_weights(into: Path, source: Path) -> None:
    """Checkpoint `into` given `source`'s weights (and optimizer state), its recorded hash updated."""
    for old in [into / ".metadata", *into.glob("*.distcp")]:
        old.unlink()
    for new in [source / ".metadata", *source.glob("*.distcp")]:
        shutil.copy2(new, into / new.name)
    weights = json.loads((source / "meta.json").read_text())["weights_sha256"]
    edit_json(into / "meta.json", lambda meta: meta.update(weights_sha256=weights))


def cut_after(run: Path, step: int) -> None:
    """The run as it was at `step`: later checkpoints and the export gone (the trainer then resumes there)."""
    for path in metas(run):
        if json.loads(path.read_text())["step"] > step:
            shutil.rmtree(path.parent)
    shutil.rmtree(run / "final", ignore_errors=True)


def train_on(runs: Runs, run: Path, overrides: dict, *options: str) -> None:
    from grader.a2.job import train_on_stack

    train_on_stack(runs.scale.recipe, run, overrides, *options)


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def assemble(run: Path, dest: Path) -> Path:
    return make_reference().assemble(run, dest)


# --------------------------------------------------------------------------- the forgeries


def forged_span(step: int) -> Callable[[Runs, Path], Path]:
    """The honest run whose checkpoint at `step` holds the long run's final weights, trained on
    from there to the end (the last checkpoint's: final/ too): one span of the chain a lie."""

    def build(runs: Runs, dest: Path) -> Path:
        scale = runs.scale
        work = copy_run(runs.honest, dest / "work")
        swap_weights(checkpoint(work, step), checkpoint(runs.long, 4 * scale.steps))
        if step < scale.steps:
            cut_after(work, step)
            train_on(runs, work, scale.small)
        else:
            for name in ("model.safetensors", "config.json"):
                shutil.copy2(runs.long / "final" / name, work / "final" / name)
        return assemble(work, dest / "sub")

    return build


def rewritten_loader_states(runs: Runs, dest: Path) -> Path:
    """The span from the middle checkpoint to the next trained on other batches (the loader
    resumed where the run ends, so on batches the run never drew there), the start checkpoint
    then put back as it was, the end's meta.json and trainer state rewritten to the honest run's
    (data position and digest), and the run continued on the right data."""
    import torch

    scale = runs.scale
    start = middle(scale)
    work = copy_run(runs.honest, dest / "work")
    cut_after(work, start)
    state_file = checkpoint(work, start) / "trainer_state_rank0.pt"
    as_it_was = state_file.read_bytes()
    state = torch.load(state_file, weights_only=True)
    state["loader"] = torch.load(checkpoint(runs.honest, scale.steps) / state_file.name, weights_only=True)["loader"]
    torch.save(state, state_file)
    train_on(runs, work, scale.small, f"--stop-after={start + scale.every}")
    state_file.write_bytes(as_it_was)
    end = checkpoint(work, start + scale.every)
    forged = json.loads((end / "meta.json").read_text())
    honest = json.loads((checkpoint(runs.honest, start + scale.every) / "meta.json").read_text())
    (end / "meta.json").write_text(json.dumps({**honest, "weights_sha256": forged["weights_sha256"],
                                               "previous": forged["previous"]}, indent=2))
    state_file = end / state_file.name
    state = torch.load(state_file, weights_only=True)
    state["loader"] = torch.load(checkpoint(runs.honest, start + scale.every) / state_file.name,
                                 weights_only=True)["loader"]
    torch.save(state, state_file)
    train_on(runs, work, scale.small)
    return assemble(work, dest / "sub")


def disguise(run: Path, dest: Path, factor: int) -> Path:
    """A run trained `factor` times past its claim, with every file edited to claim 1/factor of
    it: the recipe's budget, the manifests, the log, the checkpoints renamed and their meta.json
    rewritten (steps, tokens, links, recipe hash). Only the weights and the data position tell."""
    from onenode.train.recipe import load_recipe

    sub = assemble(run, dest)
    recipe = yaml.safe_load((sub / "recipe.yaml").read_text())
    recipe["train"]["token_budget"] //= factor
    (sub / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    claimed = load_recipe(sub / "recipe.yaml").training_sha256
    for meta_path in metas(sub):
        meta = json.loads(meta_path.read_text())
        meta.update(step=meta["step"] // factor, tokens_seen=meta["tokens_seen"] // factor, training_sha256=claimed)
        if meta["previous"]:
            meta["previous"]["step"] //= factor
        meta_path.write_text(json.dumps(meta))
        meta_path.parent.rename(meta_path.parent.with_name(f"step_{meta['step']:08d}"))

    def claim(m):
        m.update({k: m[k] // factor for k in ("steps", "total_steps", "tokens_seen", "token_budget",
                                               "data_tokens_served")}, recipe=recipe)
    for path in (sub / "run_manifest.json", sub / "final" / "run_manifest.json"):
        edit_json(path, claim)
    records = [json.loads(line) for line in (sub / "metrics.jsonl").read_text().splitlines()]
    (sub / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "step": r["step"] // factor, "tokens": r["tokens"] // factor}) + "\n"
        for r in records if r["step"] % factor == 0))
    return sub


def more_tokens(runs: Runs, dest: Path) -> Path:
    return disguise(runs.long, dest / "sub", factor=4)


def larger_batch(runs: Runs, dest: Path) -> Path:
    """The run of four times the batch claiming the recipe's: the recipe, the manifests, the log's
    token counts, every checkpoint's recipe hash, layout, token count and loader state (the honest
    run's, which a fresh loader gives) edited to match."""
    import torch

    from onenode.train.recipe import load_recipe

    scale = runs.scale
    sub = assemble(runs.wide, dest / "sub")
    recipe = yaml.safe_load((sub / "recipe.yaml").read_text())
    recipe["train"].update(global_batch_size=scale.batch, token_budget=scale.budget)
    (sub / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    claimed = load_recipe(sub / "recipe.yaml").training_sha256
    for meta_path in metas(sub):
        honest = checkpoint(runs.honest, json.loads(meta_path.read_text())["step"])
        truth = json.loads((honest / "meta.json").read_text())
        meta = json.loads(meta_path.read_text())
        meta.update({k: truth[k] for k in ("tokens_seen", "layout", "loader", "data_digest")}, training_sha256=claimed)
        meta_path.write_text(json.dumps(meta, indent=2))
        state_file = meta_path.parent / "trainer_state_rank0.pt"
        state = torch.load(state_file, weights_only=True)
        own = torch.load(honest / state_file.name, weights_only=True)
        state.update(tokens_seen=own["tokens_seen"], loader=own["loader"])
        torch.save(state, state_file)
    honest_manifest = json.loads((runs.honest / "run_manifest.json").read_text())
    keys = ("tokens_seen", "tokens_per_step", "token_budget", "data_tokens_served", "data_digest")

    def claim(m):
        m.update({k: honest_manifest[k] for k in keys}, recipe=recipe)
    for path in (sub / "run_manifest.json", sub / "final" / "run_manifest.json"):
        edit_json(path, claim)
    records = [json.loads(line) for line in (sub / "metrics.jsonl").read_text().splitlines()]
    (sub / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "tokens": r["step"] * scale.tokens_per_step}) + "\n" for r in records))
    return sub


STEERING_PACE = 0.9  # each steered step moves a weight this many learning rates: inside the movement bound


def train_steered(recipe_path: str, out: str, overrides: dict, target: str) -> None:
    """`onenode train` of the recipe (run on the grader's A2 stack, `steered_moments`), whose
    trainer sets AdamW's moments before each checkpoint it writes: exp_avg_sq 1 (far above what
    the span's own gradients add), exp_avg the sign of (`target`'s weights - the weights) scaled
    so that the next step moves each weight `STEERING_PACE` learning rates towards `target`."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from onenode.model import build_model
    from onenode.train.checkpoint import load_weights
    from onenode.train.optim import optimizers_of
    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    recipe = load_recipe(recipe_path, overrides)
    trainer = Trainer(recipe, out, resume=None)
    goal = build_model(trainer.config, device="cpu")
    load_weights(target, goal)
    goals = dict(goal.named_parameters())
    names = {id(param): name.replace("_orig_mod.", "") for name, param in trainer.parallel.model.named_parameters()}
    save = trainer.save

    @torch.no_grad()
    def steer_then_save() -> Path:
        get_state_dict(trainer.parallel.model, optimizers_of(trainer.optimizer))  # the state step 0 stores
        for optimizer in optimizers_of(trainer.optimizer):
            for group in optimizer.param_groups:
                beta1, beta2 = group["betas"]
                for param in group["params"]:
                    state = optimizer.state[param]
                    t = float(state["step"]) + 1  # the next step's bias corrections
                    scale = STEERING_PACE * math.sqrt(beta2) / beta1 * (1 - beta1 ** t) / math.sqrt(1 - beta2 ** t)
                    state["exp_avg_sq"].fill_(1.0)
                    state["exp_avg"].copy_(torch.sign(goals[names[id(param)]].to(param.device) - param) * scale)
        return save()

    trainer.save = steer_then_save
    trainer.fit()


def steered_moments(runs: Runs, dest: Path) -> Path:
    """The honest recipe trained by `train_steered`, towards the four-times-longer run's weights."""
    from grader.a2.job import a2_stack

    scale, work = runs.scale, dest / "work"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(a2_stack() / "starter_code"), str(KIT / "tests")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = "import json, sys; from redteam.a2_forgeries import train_steered; train_steered(*json.loads(sys.argv[1]))"
    arguments = [str(scale.recipe), str(work), scale.small, str(checkpoint(runs.long, 4 * scale.steps))]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(arguments)], cwd=KIT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the steered run failed: {done.stderr.strip()[-800:]}")
    return assemble(work, dest / "sub")


def long_span_among_short(runs: Runs, dest: Path) -> Path:
    """The run checkpointed every `every // 2` steps, its two spans after the middle checkpoint
    made one (the checkpoint between them gone, the next one linked to the middle one): the first
    half trained honestly (so the recorded loss after the middle checkpoint is true), the second on
    other batches (the loader put where the run ends), the end's meta.json and loader state
    rewritten to the honest run's, the run continued on the right data. Every check but a replay of
    that span passes: spans drawn by their steps within the budget reach it less often than its
    steps say."""
    import torch

    scale = runs.scale
    half, start = scale.every // 2, middle(scale)
    work = copy_run(runs.fine, dest / "work")
    cut_after(work, start + half)  # the first half as the run trained it (training it again gives the same bits)
    state_file = checkpoint(work, start + half) / "trainer_state_rank0.pt"
    state = torch.load(state_file, weights_only=True)
    state["loader"] = torch.load(checkpoint(runs.fine, scale.steps) / state_file.name, weights_only=True)["loader"]
    torch.save(state, state_file)
    train_on(runs, work, scale.fine, f"--stop-after={start + scale.every}")
    shutil.rmtree(checkpoint(work, start + half))
    end, honest = checkpoint(work, start + scale.every), checkpoint(runs.fine, start + scale.every)
    forged = json.loads((end / "meta.json").read_text())
    link = {"step": start, "weights_sha256": json.loads((checkpoint(work, start) / "meta.json").read_text())[
        "weights_sha256"]}
    (end / "meta.json").write_text(json.dumps({**json.loads((honest / "meta.json").read_text()),
                                               "weights_sha256": forged["weights_sha256"], "previous": link}, indent=2))
    state = torch.load(end / state_file.name, weights_only=True)
    state["loader"] = torch.load(honest / state_file.name, weights_only=True)["loader"]
    torch.save(state, end / state_file.name)
    train_on(runs, work, scale.fine)
    return assemble(work, dest / "sub")


def train_hidden_replica(recipe_path: str, out: str, overrides: dict) -> None:
    """`onenode train` of the recipe (run on the grader's A2 stack, `hidden_replica`) beside a
    second replica, a trainer of its own (its weights, AdamW state and loader) reading the data
    further along, past the run's end (batches the first never draws). Before each checkpoint the
    first writes, the second trains as many steps from the last checkpoint's weights, and both take
    the average of their weights and buffers (DiLoCo's sync at outer lr 1 without momentum): the
    checkpoint holds it with the first's optimizer, loader and losses, and the run's files count
    the first's tokens alone."""
    import torch

    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    recipe = load_recipe(recipe_path, overrides)
    trainer = Trainer(recipe, out, resume=None)
    second = Trainer(recipe, Path(out).with_name(Path(out).name + "-second-replica"), resume=None)
    for _ in range(recipe.total_steps * second.accumulation):
        next(second.loader)
    save = trainer.save

    def sync_then_save() -> Path:
        while second.step < trainer.step:
            second.train_step()
        with torch.no_grad():
            for mine, theirs in zip(trainer.parallel.model.state_dict().values(),
                                    second.parallel.model.state_dict().values()):
                if mine.is_floating_point():
                    mine.copy_((mine + theirs) / 2)
                    theirs.copy_(mine)
        return save()

    trainer.save = sync_then_save
    trainer.fit()


def hidden_replica(runs: Runs, dest: Path) -> Path:
    """The honest recipe trained by `train_hidden_replica`: two replicas' tokens, one counted."""
    from grader.a2.job import a2_stack

    scale, work = runs.scale, dest / "work"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(a2_stack() / "starter_code"), str(KIT / "tests")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = ("import json, sys; from redteam.a2_forgeries import train_hidden_replica; "
            "train_hidden_replica(*json.loads(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps([str(scale.recipe), str(work), scale.small])],
                          cwd=KIT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run with a hidden replica failed: {done.stderr.strip()[-800:]}")
    return assemble(work, dest / "sub")


def middle(scale: Scale) -> int:
    """The checkpoint step nearest the run's middle."""
    return scale.steps // 2 // scale.every * scale.every


NOT_TRAINED = r"moved .* times as far as any training at the schedule's learning rates can"
NOT_REPLAYED = r"were not trained by that span"
NO_TRAINING_MAKES = r"stores an optimizer state no training of the recipe makes"
STATE_NOT_REPLAYED = r"that state was not made by training that span"


def forgeries(scale: Scale) -> list[Forgery]:
    """Every forgery class at `scale`, with the checks that must catch it whatever spans are drawn."""
    def span(end: int) -> str:
        return rf"^step_{end - scale.every:08d} -> step_{end:08d} "

    half, first, last = middle(scale), scale.every, scale.steps
    return [
        Forgery("forged-first-span", forged_span(first),
                {"movement": span(first) + NOT_TRAINED, "replay": NOT_REPLAYED}),
        Forgery("forged-middle-span", forged_span(half), {"movement": span(half) + NOT_TRAINED}, slow=False),
        Forgery("forged-last-span", forged_span(last), {"movement": span(last) + NOT_TRAINED, "replay": NOT_REPLAYED}),
        Forgery("rewritten-loader-states", rewritten_loader_states,
                {"logged losses": rf"loss .* at step {half + 1}; step_{half:08d} has loss .* on the grader's batch of "
                                  "that step"}),
        Forgery("more-tokens", more_tokens, {"movement": NOT_TRAINED, "replay": NOT_REPLAYED,
                                             "data order": r"is not the one the submitted data gives"}),
        Forgery("larger-batch", larger_batch,
                {"replay": NOT_REPLAYED, "logged losses": r"at step \d+; step_\d{8} has loss"}),
        Forgery("steered-moments", steered_moments,
                {"optimizer state": rf"^step_00000000 {NO_TRAINING_MAKES}: .* 0 steps of any gradients give",
                 "replay": STATE_NOT_REPLAYED}),
        Forgery("long-span-among-short", long_span_among_short,
                {"replay": rf"^step_{half:08d} -> step_{half + scale.every:08d} is {scale.every} steps, where the "
                           rf"chain's first span is {scale.every // 2}: the grader replays only runs checkpointed at "
                           "one interval"}),
        Forgery("hidden-replica", hidden_replica, {"replay": span(first) + "replayed does not give .*" + NOT_REPLAYED}),
    ]


FORGERIES = forgeries(TINY_SCALE)
