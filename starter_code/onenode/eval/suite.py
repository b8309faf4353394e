"""The evaluation suites: the standard one small base models report, and the kit's offline one.

`standard` (needs the hub's datasets; the course node): 0-shot HellaSwag, ARC-Easy/Challenge,
PIQA, SciQ (reported as acc_norm), WinoGrande (acc), 5-shot MMLU (acc), and WikiText word
perplexity (held-out text, comparable across tokenizers).

`offline`: three lm-eval tasks made from documents of the kit's own corpus that every data
build holds out (`is_validation(doc, HELDOUT_FRACTION)`: any build with `val_fraction` at least
that keeps them out of training), written as local JSONL + YAML task files, so the whole path
runs without a hub:
- `onenode_cloze`: a few lines of a play or novel, then the true next line among 3 lines drawn
  from other held-out documents (acc_norm);
- `onenode_order`: a line and the same words shuffled, after the line before it: which is real (acc);
- `onenode_heldout`: held-out passages scored whole (loglikelihood_rolling): word and byte
  perplexity, bits per byte, which compare across tokenizers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

HELDOUT_FRACTION = 0.01
OFFLINE_PARTS = ("shakespeare", "austen")
OFFLINE_TASKS = ("onenode_cloze", "onenode_order", "onenode_heldout")
PASSAGE_CHARS = 1500


@dataclass(frozen=True)
class TaskSpec:
    name: str
    metric: str  # the headline metric
    num_fewshot: int = 0
    higher_is_better: bool = True


STANDARD = (
    TaskSpec("hellaswag", "acc_norm"), TaskSpec("arc_easy", "acc_norm"), TaskSpec("arc_challenge", "acc_norm"),
    TaskSpec("piqa", "acc_norm"), TaskSpec("sciq", "acc_norm"), TaskSpec("winogrande", "acc"),
    TaskSpec("mmlu", "acc", num_fewshot=5), TaskSpec("wikitext", "word_perplexity", higher_is_better=False),
)
OFFLINE = (
    TaskSpec("onenode_cloze", "acc_norm"), TaskSpec("onenode_order", "acc"),
    TaskSpec("onenode_heldout", "word_perplexity", higher_is_better=False),
)
SUITES = {"standard": STANDARD, "offline": OFFLINE}


def suite_tasks(name: str) -> tuple[TaskSpec, ...]:
    """A named suite, or a comma-separated list of lm-eval task names (0-shot, metric acc)."""
    if name in SUITES:
        return SUITES[name]
    tasks = tuple(TaskSpec(t.strip(), "acc") for t in name.split(",") if t.strip())
    if not tasks:
        raise ValueError(f"empty suite {name!r}: use offline, standard or TASK[,TASK...]")
    return tasks


def heldout_documents(parts=OFFLINE_PARTS, fraction: float = HELDOUT_FRACTION) -> list[str]:
    """The corpus documents every data build with val_fraction >= `fraction` holds out."""
    from ..data.build import is_validation
    from ..data.corpus import corpus_part

    docs = []
    for part in parts:
        with corpus_part(part).open(encoding="utf-8") as f:
            docs += [d["text"] for d in map(json.loads, f) if is_validation(d["text"], fraction)]
    if not docs:
        raise ValueError(f"no held-out documents in corpus parts {parts}: run `onenode data fetch`")
    return docs


def _lines(doc: str) -> list[str]:
    """Lines of real text: at least four words, not a speaker's name or a heading in capitals."""
    lines = (" ".join(line.split()) for line in doc.splitlines())
    return [line for line in lines if len(line.split()) >= 4 and not line.isupper()]


def _passages(doc: str, chars: int = PASSAGE_CHARS) -> list[str]:
    """A document cut at line ends into passages of about `chars` characters."""
    passages, current = [], ""
    for line in doc.splitlines(keepends=True):
        current += line
        if len(current) >= chars:
            passages.append(current.strip())
            current = ""
    if len(current.strip()) >= chars // 4:
        passages.append(current.strip())
    return passages


def cloze_items(docs: list[str], rng: random.Random, count: int, context_lines: int = 3) -> list[dict]:
    lines = [_lines(d) for d in docs]
    candidates = [(d, i) for d, doc_lines in enumerate(lines) for i in range(context_lines, len(doc_lines))]
    items = []
    for d, i in rng.sample(candidates, min(count, len(candidates))):
        others = [line for e, doc_lines in enumerate(lines) if e != d for line in doc_lines]
        choices = rng.sample(others, 3)
        label = rng.randrange(4)
        choices.insert(label, lines[d][i])
        items.append({"context": "\n".join(lines[d][i - context_lines:i]) + "\n", "choices": choices, "label": label})
    return items


def order_items(docs: list[str], rng: random.Random, count: int) -> list[dict]:
    candidates = [(doc_lines[i - 1], doc_lines[i]) for doc_lines in map(_lines, docs)
                  for i in range(1, len(doc_lines)) if len(set(doc_lines[i].split())) >= 6]
    items = []
    for before, line in rng.sample(candidates, min(count, len(candidates))):
        words = line.split()
        shuffled = words[:]
        while shuffled == words:
            rng.shuffle(shuffled)
        label = rng.randrange(2)
        choices = [" ".join(shuffled)]
        choices.insert(label, line)
        items.append({"context": before + "\n", "choices": choices, "label": label})
    return items


def _task_yaml(name: str, data_file: Path, body: dict) -> dict:
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
            "test_split": "test", **body, "metadata": {"version": 1.0}}


_MULTIPLE_CHOICE = {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                    "doc_to_target": "{{label}}", "target_delimiter": "",
                    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}
_ROLLING = {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]}


def build_offline_suite(out: str | Path, docs: list[str] | None = None, items: int = 200, seed: int = 1234) -> Path:
    """Write the offline tasks (JSONL data + lm-eval YAML) into `out`; returns `out`.

    `docs` default to the corpus's held-out documents; the items depend only on them and `seed`.
    `out/onenode_heldout.jsonl` holds every held-out passage: the decontamination reference.
    """
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    docs = heldout_documents() if docs is None else docs
    rng = random.Random(seed)
    data = {
        "onenode_cloze": (cloze_items(docs, rng, items), _MULTIPLE_CHOICE),
        "onenode_order": (order_items(docs, rng, items), _MULTIPLE_CHOICE),
        "onenode_heldout": ([{"text": p} for d in docs for p in _passages(d)], _ROLLING),
    }
    for name, (records, body) in data.items():
        if not records:
            raise ValueError(f"task {name}: the held-out documents gave no items (too few lines of text)")
        data_file = out / f"{name}.jsonl"
        data_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        (out / f"{name}.yaml").write_text(yaml.safe_dump(_task_yaml(name, data_file, body), sort_keys=False))
    return out


def task_manager(suite: str, tasks_dir: str | Path | None = None):
    """lm-eval's TaskManager for `suite`: the offline suite's tasks are all local, so lm-eval's own
    task definitions (thousands of YAML files) are not indexed at every evaluation."""
    from lm_eval.tasks import TaskManager

    include = tasks_dir or (offline_suite_dir() if suite == "offline" else None)
    if include is None:
        return TaskManager()
    return TaskManager(include_path=str(include), include_defaults=suite != "offline")


def suite_texts(name: str, tasks_dir: str | Path | None = None) -> list[str]:
    """Every text the suite's items show a model: each evaluation document's prompt with its
    choices (multiple choice) or its target (perplexity), as lm-eval builds them from the task
    definitions and datasets (`tasks_dir`: local task YAML, default for `offline`: the kit's).
    What training data must not contain; the `decontaminate` curation step and the grader's
    contamination check read it."""
    from lm_eval.api.task import Task
    from lm_eval.tasks import get_task_dict

    manager = task_manager(name, tasks_dir)
    texts: list[str] = []
    pending = [get_task_dict([spec.name for spec in suite_tasks(name)], manager)]
    while pending:  # groups (MMLU) hold their subtasks as nested dicts
        for value in pending.pop().values():
            if not isinstance(value, Task):
                pending.append(value)
                continue
            for doc in value.eval_docs:
                prompt = value.doc_to_text(doc)
                if value.OUTPUT_TYPE == "multiple_choice":
                    texts += [f"{prompt} {choice}" for choice in value.doc_to_choice(doc)]
                else:
                    texts.append(f"{prompt} {value.doc_to_target(doc)}")
    return texts


def offline_suite_dir() -> Path:
    """The offline suite, built once into $ONENODE_CACHE/eval/offline."""
    from ..data.corpus import cache_dir, cache_lock

    folder = cache_dir() / "eval" / "offline"
    with cache_lock("eval-offline"):
        if not all((folder / f"{t}.yaml").is_file() for t in OFFLINE_TASKS):
            build_offline_suite(folder)
    return folder
