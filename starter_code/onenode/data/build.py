"""sources -> curation -> tokenizer -> shards + manifest: what `onenode data build` runs.

A data config (YAML) names the sources with their mixture weights, the curation steps, the
tokenizer and the validation fraction; see `configs/offline_default.yaml`. The build runs in
three passes so a tokenizer can be trained on exactly the curated training text:
1. stream every source through the curation filters (one chain for all sources, so a document
   duplicated across sources is kept once), and send each kept document to `train` or `val` by
   its content hash (deterministic: the same text always lands in the same split);
2. load or train the tokenizer;
3. tokenize into shards and write `manifest.json`.
`format: megatron` (or `--format megatron`) writes each shard as Megatron's indexed dataset
through megatron-core (`onenode.data.megatron`) instead of the kit's own index.
The curated text of pass 1 lives in OUT/text/ until the end; `keep_text: true` keeps it there.
"""

from __future__ import annotations

import datetime
import itertools
import json
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml
from tqdm.auto import tqdm

from onenode.data.corpus import FetchError
from onenode.data.curation import build_filters, doc_hash
from onenode.data.megatron import indexed_dataset, megatron_dtype
from onenode.data.shards import MANIFEST, SPLITS, ShardWriter, dtype_for
from onenode.data.sources import SourceError, iter_source
from onenode.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

CONFIG_KEYS = {"sources", "curation", "tokenizer", "val_fraction", "dtype", "keep_text", "format"}
FORMATS = ("onenode", "megatron")
ENCODE_BATCH = 256


def load_config(config: str | Path | dict) -> dict:
    """Read and check a data config; returns a plain dict with defaults filled in."""
    if not isinstance(config, dict):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"data config {path} does not exist")
        config = yaml.safe_load(path.read_text()) or {}
    unknown = set(config) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown data config key(s) {sorted(unknown)}: expected {sorted(CONFIG_KEYS)}")
    if config.get("format", "onenode") not in FORMATS:
        raise ValueError(f"format {config['format']!r} is unknown: choose from {FORMATS}")
    if not config.get("sources"):
        raise ValueError("the data config names no `sources:`")
    sources = {}
    for name, spec in config["sources"].items():
        spec = {"name": name, **(spec or {})}
        if float(spec.get("weight", 1.0)) < 0:
            raise ValueError(f"source {name!r}: weight must be >= 0")
        sources[name] = spec
    return {"tokenizer": "gpt2", "val_fraction": 0.01, "curation": {}, "keep_text": False, "format": "onenode",
            **config, "sources": sources}


def is_validation(text: str, val_fraction: float) -> bool:
    """Held-out by content: the first 64 bits of the document hash as a fraction of 2**64."""
    return int(doc_hash(text)[:16], 16) < val_fraction * 2**64


def _read_texts(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _resolve_tokenizer(spec, out: Path, train_files: list[Path], log) -> Tokenizer:
    if isinstance(spec, dict) and "train_bpe" in spec:
        settings = spec["train_bpe"] or {}
        log(f"training a byte-level BPE of {settings.get('vocab_size', 4096)} tokens")
        texts = (t for path in train_files for t in _read_texts(path))
        return train_bpe(texts, int(settings.get("vocab_size", 4096)), out / "tokenizer.json")
    if not isinstance(spec, str):
        raise ValueError("`tokenizer:` is `gpt2`, a tokenizer.json path, a transformers name, "
                         "or {train_bpe: {vocab_size: N}}")
    return load_tokenizer(spec)


def _curate_source(spec: dict, filters: list, text_dir: Path, val_fraction: float, log) -> dict | None:
    """Pass 1 for one source: the documents every filter keeps, as text_dir/NAME.SPLIT.jsonl;
    None for a corpus part that cannot be fetched here."""
    name, read, kept = spec["name"], 0, dict.fromkeys(SPLITS, 0)
    files = {split: (text_dir / f"{name}.{split}.jsonl").open("w", encoding="utf-8")
             for split in SPLITS}
    try:
        for doc in tqdm(iter_source(spec), desc=f"curate {name}", unit="doc", leave=False,
                        disable=None):
            read += 1
            if all(f.keep(doc) for f in filters):
                split = "val" if is_validation(doc, val_fraction) else "train"
                files[split].write(json.dumps(doc, ensure_ascii=False) + "\n")
                kept[split] += 1
    except FetchError as e:  # e.g. no apt-get here: build from the other sources
        log(f"note: source {name!r} skipped: {e}")
        return None
    finally:
        for f in files.values():
            f.close()
    if kept["train"] == 0:
        raise SourceError(f"source {name!r} has no training documents left after curation (read "
                          f"{read}); check its spec, loosen the filters or drop the source")
    log(f"{name}: kept {sum(kept.values())} of {read} documents")
    return {"spec": {k: v for k, v in spec.items() if k != "name"},
            "weight": float(spec.get("weight", 1.0)), "documents_read": read,
            "documents_kept": kept}


def build(config: str | Path | dict, out: str | Path, command: str | None = None,
          log=print) -> dict:
    """Build the data folder `out` from a data config; returns the manifest."""
    config, out = load_config(config), Path(out)
    megatron = config["format"] == "megatron"
    if megatron:
        indexed_dataset()  # megatron-core missing: say so before curating anything
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a folder is usable only once its build finished
    text_dir = out / "text"
    text_dir.mkdir(exist_ok=True)
    filters = build_filters(config["curation"], log)
    val_fraction = float(config["val_fraction"])
    trained = isinstance(config["tokenizer"], dict) and "train_bpe" in config["tokenizer"]
    tokenizer = None if trained else _resolve_tokenizer(config["tokenizer"], out, [], log)

    # 1. curate and split
    sources = {name: _curate_source(spec, filters, text_dir, val_fraction, log)
               for name, spec in config["sources"].items()}
    sources = {name: entry for name, entry in sources.items() if entry is not None}
    if not sources:
        raise SourceError("no source could be read (see the notes above)")

    # 2. tokenizer (loaded up front unless it is trained on the curated text)
    if tokenizer is None:
        train_files = [text_dir / f"{name}.train.jsonl" for name in sources]
        tokenizer = _resolve_tokenizer(config["tokenizer"], out, train_files, log)
    dtype = np.dtype(config.get("dtype") or dtype_for(tokenizer.vocab_size))
    if megatron:
        dtype = megatron_dtype(dtype)

    # 3. tokenize
    for name, entry in sources.items():
        entry["splits"] = {}
        for split in SPLITS:
            writer = ShardWriter(out / name / split, dtype, tokenizer.eos_id, megatron=megatron)
            texts = _read_texts(text_dir / f"{name}.{split}.jsonl")
            with tqdm(total=entry["documents_kept"][split], desc=f"tokenize {name}/{split}",
                      unit="doc", leave=False, disable=None) as progress:
                while batch := list(itertools.islice(texts, ENCODE_BATCH)):
                    for ids in tokenizer.encode_batch(batch):
                        writer.write(ids)
                    progress.update(len(batch))
            entry["splits"][split] = writer.close()
    if not config["keep_text"]:
        shutil.rmtree(text_dir)

    manifest = {
        "format": "megatron/1" if megatron else "onenode-shards/1",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command or shlex.join(sys.argv),
        "config": config,
        "tokenizer": tokenizer.describe(),
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "sources": sources,
        "curation": {f.name: f.report() for f in filters},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
