"""`evaluate(checkpoint, suite, route)`: one checkpoint through lm-eval, plus held-out loss."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from .model import DEFAULT_MAX_LENGTH, checkpoint_tokenizer, hf_tokenizer, onenode_lm_class
from .suite import suite_tasks, task_manager

ROUTES = ("onenode", "hf")


def build_lm(checkpoint: str | Path, route: str = "onenode", batch_size: int = 16,
             max_length: int = DEFAULT_MAX_LENGTH, device: str = "cpu", dtype: str | None = None,
             tokenizer: str | None = None):
    """The lm-eval model for a checkpoint folder: the kit's model, or the transformers export."""
    if route == "onenode":
        return onenode_lm_class()(pretrained=str(checkpoint), tokenizer=tokenizer, batch_size=batch_size,
                                  max_length=max_length, device=device, dtype=dtype)
    if route == "hf":
        from lm_eval.models.huggingface import HFLM
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype or "float32"))
        return HFLM(pretrained=model.to(device).eval(), tokenizer=hf_tokenizer(checkpoint), batch_size=batch_size,
                    max_length=max_length, device=device)
    raise ValueError(f"unknown route {route!r}: choose from {', '.join(ROUTES)}")


def _task_metrics(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's {"task": {"acc,none": x, "acc_stderr,none": s, ...}} -> {"task": {"acc": x, "acc_stderr": s}}
    (a standard error lm-eval could not compute, "N/A", is left out)."""
    metrics = {}
    for task, values in results.items():
        metrics[task] = {key.split(",")[0]: float(v) for key, v in values.items()
                         if "," in key and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return metrics


_PERPLEXITIES = {"word_perplexity": math.exp, "byte_perplexity": math.exp, "bits_per_byte": lambda r: r / math.log(2)}


def _perplexity_stderr(samples: list[dict], metric: str) -> float | None:
    """The standard error of a perplexity metric, which lm-eval does not give: each document
    holds (loglikelihood, units: words or bytes); the metric is f(rate), rate = -sum(ll) /
    sum(units), and the rate's error is the ratio estimator's (delta method) over documents."""
    pairs = [sample[metric] for sample in samples if metric in sample]
    if len(pairs) < 2:
        return None
    units = sum(u for _, u in pairs)
    rate = -sum(ll for ll, _ in pairs) / units
    spread = sum((-ll - rate * u) ** 2 for ll, u in pairs) * len(pairs) / (len(pairs) - 1)
    rate_stderr = math.sqrt(spread) / units
    f = _PERPLEXITIES[metric]
    return abs(f(rate + rate_stderr) - f(rate - rate_stderr)) / 2


def evaluate(checkpoint: str | Path, suite: str = "offline", route: str = "onenode",
             tasks_dir: str | Path | None = None, limit: int | None = None, batch_size: int = 16,
             max_length: int = DEFAULT_MAX_LENGTH, device: str = "cpu", dtype: str | None = None,
             tokenizer: str | None = None, val_data: str | Path | None = None, val_text: str | Path | None = None,
             val_seq_len: int = 512, val_max_tokens: int | None = None) -> dict:
    """Run `suite` on `checkpoint` (and held-out loss when `val_data` or `val_text` is given).

    `tasks_dir` holds local task YAML (default for `offline`: the kit's suite, built on first
    use); `limit` caps the items per task. Returns {"tasks": {task: {metric: value}},
    "headline": {task: {"metric", "value"}}, "heldout": {...} or None, ...}.
    """
    if suite == "offline":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON files: never ask the hub (read at import)
    import lm_eval

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint folder (no config.json): point at the "
                                "run's final/ folder")
    specs = suite_tasks(suite)
    manager = task_manager(suite, tasks_dir)
    start = time.monotonic()
    held_tokens = None
    if val_data or val_text:  # read first: a bad path fails before the long part
        from .heldout import text_tokens, val_split_tokens

        if val_data:
            held_tokens = val_split_tokens(val_data)
        else:
            held_tokens = text_tokens(val_text, checkpoint_tokenizer(checkpoint, tokenizer))
    lm = build_lm(checkpoint, route, batch_size, max_length, device, dtype, tokenizer)
    metrics: dict[str, dict[str, float]] = {}
    for shots in sorted({s.num_fewshot for s in specs}):
        names = [s.name for s in specs if s.num_fewshot == shots]
        rolling = [s.name for s in specs if s.num_fewshot == shots and s.metric in _PERPLEXITIES]
        # bootstrap_iters > 0: lm-eval's closed-form standard error of every mean (accuracies)
        out = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=shots, limit=limit, task_manager=manager,
                                      log_samples=bool(rolling), bootstrap_iters=1, verbosity="WARNING")
        metrics.update(_task_metrics(out["results"]))
        for task in rolling:
            for metric in _PERPLEXITIES:
                stderr = _perplexity_stderr(out["samples"].get(task, []), metric)
                if stderr is not None and task in metrics:
                    metrics[task][f"{metric}_stderr"] = stderr
    headline = {s.name: {"metric": s.metric, "value": metrics.get(s.name, {}).get(s.metric),
                         "stderr": metrics.get(s.name, {}).get(f"{s.metric}_stderr"),
                         "higher_is_better": s.higher_is_better} for s in specs}
    heldout = None
    if held_tokens is not None:
        from .heldout import heldout_loss

        model = lm.model if route == "onenode" else lm._model
        heldout = {"source": str(val_data or val_text),
                   **heldout_loss(model, held_tokens, val_seq_len, batch_size, val_max_tokens)}
    return {"checkpoint": str(checkpoint), "suite": suite, "route": route, "limit": limit, "max_length": max_length,
            "tasks": metrics, "headline": headline, "heldout": heldout, "seconds": time.monotonic() - start,
            "lm_eval_version": getattr(lm_eval, "__version__", None)}
