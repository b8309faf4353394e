"""The budget audit of an A2 run: do the checkpoint chain, the manifest, the logs, the recipe and
the checkpoint tell one story within the profile's token budget, and are the shards the run
trained on the submitted ones? It reads JSON, YAML and safetensors headers, and hashes the
shards; what needs the weights themselves is the replay's (`replay.py`).

The tokens trained follow from the chain: its last step x the recipe's global batch x sequence
length, never from the group's own counters (which must agree, but decide nothing)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from .intake import A2Submission, Link, read_json


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _safetensors_numel(folder: Path) -> int:
    """Parameters stored in a checkpoint, from the safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    from onenode.model.hf_io import weight_files

    total = 0
    for path in weight_files(folder):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def _stored_numel(config) -> int:
    """Numbers a checkpoint of `config` stores: parameters and buffers, a tied head once."""
    from onenode.model import build_model

    model = build_model(config, device="meta")
    tied = model.lm_head.weight.numel() if config.tie_word_embeddings else 0
    return sum(t.numel() for t in model.state_dict().values()) - tied


def audit_run(sub: A2Submission, token_budget: int) -> list[Check]:
    """Do the manifest, the logs, the recipe and the checkpoint tell one story within the budget?"""
    from onenode.model import count_parameters
    from onenode.model.config import NemotronHConfig
    from onenode.train.recipe import RecipeError, load_recipe

    manifest, records = sub.manifest, sub.metrics
    checks: list[Check] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(Check(name, bool(ok), detail))

    try:
        recipe = load_recipe(sub.recipe)
        recipe_config = recipe.model_config()
    except (RecipeError, OSError) as e:
        check("recipe", False, f"recipe.yaml does not load: {e}")
        return checks
    chain_steps = sub.chain[-1].step if sub.chain else None
    broken = chain_problem(sub.chain, recipe.training_sha256)
    check("chain", broken is None, broken or f"{len(sub.chain)} checkpoints chained from step 0 to step {chain_steps}")
    if chain_steps is None:
        check("budget", False, "no checkpoint chain to count the tokens trained by: submit checkpoints/")
    else:
        trained = chain_steps * recipe.tokens_per_step
        check("budget", trained <= token_budget and recipe.train.token_budget <= token_budget,
              f"the chain runs {chain_steps:,} steps x {recipe.tokens_per_step:,} tokens = {trained:,} tokens; recipe "
              f"budget {recipe.train.token_budget:,}; the profile's budget {token_budget:,}")
    seen, steps, per_step = manifest.get("tokens_seen"), manifest.get("steps"), manifest.get("tokens_per_step")
    check("finished", manifest.get("status") == "finished", f"manifest status {manifest.get('status')!r}")
    check("manifest arithmetic", per_step == recipe.tokens_per_step and isinstance(steps, int)
          and steps == chain_steps and seen == steps * per_step
          and manifest.get("token_budget") == recipe.train.token_budget
          and manifest.get("data_tokens_served") == seen,
          f"{steps} steps x {per_step} tokens = {seen} tokens seen (recipe: {recipe.tokens_per_step} tokens per step, "
          f"budget {recipe.train.token_budget}; chain: {chain_steps} steps); data loader served "
          f"{manifest.get('data_tokens_served')}")
    logged = [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int)
              and isinstance(r.get("tokens"), int)]
    last = max(logged, key=lambda r: r["step"]) if logged else {}
    check("logs", bool(logged) and last.get("step") == steps and last.get("tokens") == seen
          and all(r["tokens"] == r["step"] * recipe.tokens_per_step for r in logged),
          f"metrics.jsonl ends at step {last.get('step')} with {last.get('tokens')} tokens; the manifest says "
          f"step {steps} with {seen}")
    check("schedule", *logged_schedule(logged, recipe))
    check("replica groups", *replica_groups(sub, recipe))
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
        check("final manifest", read_json(final_manifest) == manifest,
              "final/run_manifest.json and run_manifest.json agree")
    return checks


# What every replica group's manifest must share with group 0's: one run, counted once for all groups.
SHARED_BY_GROUPS = ("status", "token_budget", "tokens_seen", "tokens_per_step", "steps", "data_tokens_served",
                    "model_config", "parameters")


def replica_groups(sub: A2Submission, recipe) -> tuple[bool, str]:
    """Whether the run is the replica groups its recipe trains. The budget counts every group's
    tokens through the recipe (a DiLoCo global batch spans the groups), so every group the run
    trained must be submitted and be the recipe's: for `parallel.diloco` with R groups, group 0's
    folder with replica_1/ .. replica_{R-1}/ (as the trainer wrote them), each group's chain
    linked from step 0 by the same recipe, at the same steps, holding group 0's weights at every
    checkpoint (each falls on a sync, where the groups hold one model), its manifest naming its
    group and counting what group 0's counts. A run whose recipe trains one group must show no
    other (a `replica_*/` folder, the manifest's `diloco`): that group's tokens go uncounted.
    Whether the groups trained what they claim is the replay's (`diloco_replay.py`)."""
    folders = [group.root.name for group in sub.replicas]
    named = sub.manifest.get("diloco")
    d = recipe.parallel.diloco
    if not d.inner_steps:
        if folders or named is not None:
            found = f"the run holds {folders[0]}/" if folders else f"run_manifest.json names DiLoCo {named!r}"
            return False, (f"{found}, but recipe.yaml trains one replica group (parallel.diloco.inner_steps: 0): "
                           "another group's tokens are trained and not counted; submit the recipe the run trained with")
        return True, "one replica group: the recipe trains no DiLoCo and the run holds no other group's folder"
    expected = [f"replica_{r}" for r in range(1, d.replicas)]
    if folders != expected:
        return False, (f"recipe.yaml trains {d.replicas} DiLoCo replica groups, so the run folder holds "
                       f"{', '.join(f'{name}/' for name in expected)} (each group's folder as the trainer wrote it); "
                       f"it holds {', '.join(f'{name}/' for name in folders) or 'none'}: submit every group's folder "
                       "(`onenode pack a2` copies them)")
    if named != {"replica_group": 0}:
        return False, (f"run_manifest.json names replica group {named!r}, not {{'replica_group': 0}}: submit group "
                       "0's run folder, with the other groups' in it")
    steps = [link.step for link in sub.chain]
    layout = sub.chain[-1].meta.get("layout") if sub.chain else None
    for group in sub.replicas:
        where = f"{group.root.name}/"
        manifest = group.manifest
        if manifest is None:
            return False, f"{where} has no run_manifest.json: submit the group's folder as the trainer wrote it"
        if manifest.get("diloco") != {"replica_group": group.index}:
            return False, f"{where}run_manifest.json names replica group {manifest.get('diloco')!r}, not {group.index}"
        differs = [key for key in SHARED_BY_GROUPS if manifest.get(key) != sub.manifest.get(key)]
        if differs:
            return False, (f"{where}run_manifest.json differs from group 0's in {', '.join(differs)}: the groups of "
                           "one run train the same steps and count every group's tokens alike")
        broken = chain_problem(group.chain, recipe.training_sha256)
        if broken:
            return False, f"{where}: {broken}"
        if [link.step for link in group.chain] != steps:
            return False, (f"{where}checkpoints/ holds steps {[link.step for link in group.chain]}, group 0's "
                           f"{steps}: every group checkpoints at the same syncs")
        apart = next((link for link, ours in zip(group.chain, sub.chain) if link.weights != ours.weights), None)
        if apart is not None:
            return False, (f"{where}checkpoints/{apart.path.name} holds other weights than group 0's at that step: "
                           "a checkpoint falls on a sync, where every group holds the same model")
        if group.chain[-1].meta.get("layout") != layout:
            return False, f"{where} trained on another layout than group 0 (meta.json's layout): the replay needs one"
        if (group.chain[-1].meta.get("loader") or {}).get("settings") != \
                (sub.chain[-1].meta.get("loader") or {}).get("settings"):
            return False, f"{where} read other data than group 0 (meta.json's loader settings): one run, one data"
    return True, (f"{d.replicas} DiLoCo replica groups (a sync every {d.inner_steps} steps), each group's chain of "
                  f"{len(steps)} checkpoints linked from step 0 and holding group 0's weights at every sync, each "
                  f"manifest counting the run's {sub.manifest.get('tokens_seen')} tokens, every group's")


def logged_schedule(records: list[dict], recipe) -> tuple[bool, str]:
    """Whether every logged learning rate is the one the recipe's schedule gives at that step
    (the replay's movement bound sums the schedule's, so a log that claims another lr is a lie)."""
    from onenode.train.schedule import lr_factor

    with_lr = [r for r in records if isinstance(r.get("lr"), (int, float))]
    for r in with_lr:
        expected = recipe.optimizer.lr * lr_factor(recipe.schedule, r["step"] - 1, recipe.total_steps)
        if not math.isclose(r["lr"], expected, rel_tol=1e-6, abs_tol=1e-12):
            return False, (f"metrics.jsonl logs lr {r['lr']:.6g} at step {r['step']}; the recipe's schedule gives "
                           f"{expected:.6g} there")
    return bool(with_lr), f"the {len(with_lr)} logged learning rates are the recipe's schedule's" if with_lr \
        else "metrics.jsonl logs no learning rate: submit the log the trainer wrote"


def chain_problem(chain: list[Link], training_sha256: str) -> str | None:
    """What breaks the chain from the seeded initialisation to the last checkpoint, or None:
    step 0 first, each checkpoint naming the one before it (step and weights hash), every one
    trained with the submitted recipe. Whether the hashes are the weights' is the replay's."""
    if not chain:
        return "no checkpoints/: submit every checkpoint of the run, from step 0 to the last"
    for link in chain:
        if link.step is None or link.path.name != f"step_{link.step:08d}":
            return f"{link.path.name}/meta.json says step {link.meta.get('step')!r}"
    first = chain[0]
    if first.step != 0 or first.meta.get("previous") is not None:
        return (f"the chain starts at {first.path.name}, not at step_00000000 (the seeded initialisation): "
                "the run did not start from this recipe's initialisation")
    for before, link in zip(chain, chain[1:]):
        previous = link.meta.get("previous")
        if previous != {"step": before.step, "weights_sha256": before.weights}:
            named = (f"step {previous.get('step')} with weights {str(previous.get('weights_sha256'))[:12]}"
                     if isinstance(previous, dict) else repr(previous))
            return (f"{link.path.name} follows {named}, not {before.path.name} (weights {str(before.weights)[:12]}): "
                    "the chain is broken (a checkpoint missing, or training continued from another one)")
    other = next((link for link in chain if link.meta.get("training_sha256") != training_sha256), None)
    if other is not None:
        return (f"{other.path.name} was trained with another recipe than recipe.yaml (seed, model, data mixture, "
                "train, optimizer, schedule, moe or parallel differ)")
    return None


_SOURCE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def trained_shards(sub: A2Submission) -> tuple[dict[str, Path], Check]:
    """The shards the run trained on, as its last checkpoint's loader names them (source ->
    sha256), found in the submitted data/ and hashed here; and the check saying so. A run on
    synthetic tokens trained on no shards."""
    from onenode.data.shards import file_sha256

    if not sub.chain:
        return {}, Check("data", False, "no checkpoints: they name the data the run trained on")
    loader = sub.chain[-1].meta.get("loader")
    settings = loader.get("settings") if isinstance(loader, dict) else None
    if not isinstance(settings, dict) or not isinstance(settings.get("shards"), dict):
        synthetic = isinstance(loader, dict) and "batches" in loader
        return {}, Check("data", synthetic, "synthetic tokens: no shards to check" if synthetic
                         else f"{sub.chain[-1].path.name}/meta.json names no data the run trained on")
    named = settings["shards"]
    if sub.data is None:
        return {}, Check("data", False, f"the run trained on the shards of {', '.join(sorted(named))}: submit the data "
                                        "folder it trained on as data/ (manifest.json and each <source>/train.bin)")
    manifest = sub.data_manifest or {}
    tokenizer = (manifest.get("tokenizer") or {}).get("sha256")
    if tokenizer != settings.get("tokenizer"):
        return {}, Check("data", False, "data/manifest.json's tokenizer is not the one the run trained with")
    shards = {}
    for name, sha in sorted(named.items()):
        path = sub.data / name / "train.bin"
        if not _SOURCE_NAME.fullmatch(name) or not path.is_file():
            return {}, Check("data", False, f"data/{name}/train.bin is missing: the run trained on it")
        found = file_sha256(path)
        if found != sha:
            return {}, Check("data", False, f"data/{name}/train.bin (sha256 {found[:12]}) is not the shard the run "
                                            f"trained on ({str(sha)[:12]}): it trained on other data than submitted")
        shards[name] = path
    return shards, Check("data", True, f"the {len(shards)} shards the run trained on are the submitted ones "
                                       "(hashes recomputed)")
