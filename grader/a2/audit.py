"""The budget audit of an A2 run: do the manifest, the logs, the recipe and the checkpoint tell
one story within the profile's token budget? It reads JSON, YAML and safetensors headers only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .intake import A2Submission, read_json, read_metrics


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


def audit_run(sub: A2Submission, token_budget: int) -> list[Check]:
    """Do the manifest, the logs, the recipe and the checkpoint tell one story within the budget?"""
    from onenode.model import count_parameters
    from onenode.model.config import NemotronHConfig
    from onenode.train.recipe import RecipeError, load_recipe

    manifest = read_json(sub.manifest)
    records = read_metrics(sub.metrics)
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
        check("final manifest", read_json(final_manifest) == manifest,
              "final/run_manifest.json and run_manifest.json agree")
    return checks
