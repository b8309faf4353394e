"""Evaluation text in the data a run trained on, on every profile.

The shards scanned are the ones the run's checkpoints name, verified by hash (`audit.trained_shards`);
the evaluation text is every item of the profile's suite (`onenode.eval.suite.suite_texts`),
tokenized with the data's own tokenizer. A training document is flagged when it shares with it
a run of as many tokens as 13 words take (13 x the evaluation text's tokens per word: 17 for
GPT-2's BPE, about 35 for a 512-token one): the data pipeline's 13-word rule, on token ids so
that billions of tokens scan in minutes: vectorised rolling hashes over the memory-mapped shards (nothing decoded), a
table of the wanted hashes' top bits in front of the exact lookup, chunks spread over the
profile's CPU threads.

Two kinds of shared run say nothing of where a text came from, and are not counted: runs that are
mostly whitespace (at least half of a run's tokens must carry text: indentation and blank lines
are every poem's and table's), and runs that the kit's own corpus holds outside the documents its
offline suite holds out, in the parts the data was built from (a scene's heading repeated in
another scene, a refrain, a quotation: every honest build of those parts trains on them).
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np

from .audit import Check
from .intake import A2Submission

NGRAM_WORDS = 13  # the data pipeline's `decontaminate` n-gram, in words
CHUNK_TOKENS = 1 << 22  # tokens hashed at a time (a few hundred MB of temporaries)
_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_TABLE_BITS = 26  # the lookup table: one byte per value of a hash's top 26 bits (64 MiB)


def _powers(base: int, count: int) -> np.ndarray:
    """base**0 .. base**(count - 1) modulo 2**64."""
    out = np.empty(count, dtype=np.uint64)
    out[0] = 1
    if count > 1:
        out[1:] = np.cumprod(np.full(count - 1, base, dtype=np.uint64))  # uint64 products wrap modulo 2**64
    return out


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """`np.unique` by a sort: numpy 2.3+'s `np.unique` hashes integer arrays, which on millions of
    distinct n-gram hashes (the kit corpus's) took 70x as long as sorting them (4.7 s against 0.07)."""
    values = np.sort(values, axis=None)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


def in_sorted(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """`np.isin(values, table)` for a sorted, unique `table`, by binary search (`np.isin` would
    sort or hash the whole table again on every call)."""
    if not len(table):
        return np.zeros(len(values), dtype=bool)
    return table[np.minimum(np.searchsorted(table, values), len(table) - 1)] == values


@cache
def _power_tables(count: int) -> tuple[np.ndarray, np.ndarray]:
    """B**i and B**-i for i < count."""
    return _powers(_BASE, count), _powers(pow(_BASE, -1, 2**64), count)


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit polynomial hash of each of the len(tokens) - n + 1 runs of n consecutive tokens:
    prefix sums of t_i * B**i, differenced and shifted back by B**-i (arithmetic modulo 2**64)."""
    count = len(tokens) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    up, down = _power_tables(max(CHUNK_TOKENS + n, len(tokens)))
    prefix = np.zeros(len(tokens) + 1, dtype=np.uint64)
    np.cumsum(np.asarray(tokens, dtype=np.uint64) * up[:len(tokens)], out=prefix[1:])
    return (prefix[n:] - prefix[:count]) * down[:count]


class _Wanted:
    """The evaluation text's hashes, sorted, behind a table of their top bits (most training
    hashes stop at the table; the rest are looked up exactly)."""

    shift = np.uint64(64 - _TABLE_BITS)

    def __init__(self, hashes: np.ndarray):
        self.hashes = sorted_unique(hashes)
        self.table = np.zeros(1 << _TABLE_BITS, dtype=bool)
        self.table[self.hashes >> self.shift] = True

    def positions(self, hashes: np.ndarray) -> np.ndarray:
        """Where in `hashes` a wanted one is."""
        candidates = np.flatnonzero(self.table[hashes >> self.shift])
        at = np.minimum(np.searchsorted(self.hashes, hashes[candidates]), len(self.hashes) - 1)
        return candidates[self.hashes[at] == hashes[candidates]]


_wanted: _Wanted | None = None  # a scanning process's copy (set by _start_worker)


def _start_worker(wanted: _Wanted) -> None:
    global _wanted
    _wanted = wanted


@cache
def _shard(prefix: Path, dtype: str):
    from onenode.data.shards import Shard

    return Shard(prefix, np.dtype(dtype))


def _scan(task: tuple[Path, str, int, int]) -> np.ndarray:
    """The documents of one chunk of a shard (from token `start`) that hold a wanted run of n tokens."""
    prefix, dtype, n, start = task
    shard = _shard(prefix, dtype)
    hits = _wanted.positions(ngram_hashes(shard.tokens[start:start + CHUNK_TOKENS + n - 1], n)) + start
    return sorted_unique(np.searchsorted(shard.offsets, hits, side="right") - 1)


def flagged_documents(shards: dict[str, Path], dtype: str, wanted: np.ndarray, n: int,
                      workers: int = 1) -> dict[str, int]:
    """Per source, how many of its documents hold a run of `n` tokens whose hash is in `wanted`."""
    tasks = [(name, (path.with_suffix(""), dtype, n, start)) for name, path in shards.items()
             for start in range(0, max(len(_shard(path.with_suffix(""), dtype).tokens) - n + 1, 0), CHUNK_TOKENS)]
    state = _Wanted(wanted)
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(workers, initializer=_start_worker, initargs=(state,)) as pool:
            found = list(pool.map(_scan, [task for _, task in tasks]))
    else:
        _start_worker(state)
        found = [_scan(task) for _, task in tasks]
    documents: dict[str, set] = {name: set() for name in shards}
    for (name, _), docs in zip(tasks, found):
        documents[name].update(docs.tolist())
    return {name: len(docs) for name, docs in documents.items()}


def text_runs(ids: np.ndarray, n: int, carries_text: np.ndarray) -> np.ndarray:
    """The hashes of the runs of `n` tokens of `ids` in which at least half the tokens carry text
    (`carries_text[id]`: the token decodes to more than whitespace)."""
    hashes = ngram_hashes(ids, n)
    counts = np.concatenate([[0], np.cumsum(carries_text[ids])])
    return hashes[(counts[n:] - counts[:len(hashes)]) * 2 >= n]


def carries_text(tokenizer) -> np.ndarray:
    """Per token id: whether it decodes to more than whitespace."""
    return np.array([bool(tokenizer.decode([i]).strip()) for i in range(tokenizer.vocab_size)])


_CORPUS_RUNS: dict[tuple[str, int, tuple[str, ...]], np.ndarray] = {}


def corpus_parts(manifest: dict) -> tuple[str, ...]:
    """The kit corpus's parts a data folder was built from, as its manifest names them."""
    from onenode.data.corpus import PARTS

    specs = [source.get("spec") for source in (manifest.get("sources") or {}).values() if isinstance(source, dict)]
    return tuple(sorted({spec["part"] for spec in specs
                         if isinstance(spec, dict) and spec.get("kind") == "corpus" and spec.get("part") in PARTS}))


def corpus_runs(tokenizer, n: int, parts: tuple[str, ...]) -> np.ndarray:
    """The runs of `n` tokens that `parts` of the kit's corpus hold outside the documents the
    offline suite holds out (sorted, unique; computed once per tokenizer)."""
    from onenode.data.build import is_validation
    from onenode.data.corpus import corpus_part
    from onenode.eval.suite import HELDOUT_FRACTION

    key = (tokenizer.content_hash(), n, parts)
    if key not in _CORPUS_RUNS:
        texts = []
        for part in parts:
            with corpus_part(part).open(encoding="utf-8") as f:
                texts += [d["text"] for d in map(json.loads, f) if not is_validation(d["text"], HELDOUT_FRACTION)]
        runs = [ngram_hashes(np.asarray(ids), n) for ids in tokenizer.encode_batch(texts)]
        _CORPUS_RUNS[key] = sorted_unique(np.concatenate(runs + [np.empty(0, dtype=np.uint64)]))
    return _CORPUS_RUNS[key]


def data_tokenizer(data: Path, manifest: dict):
    """The tokenizer the shards were built with: data/tokenizer.json, or the one the manifest names."""
    from onenode.data.tokenizer import load_tokenizer

    own = data / "tokenizer.json"
    return load_tokenizer(str(own) if own.is_file() else manifest["tokenizer"]["name"])


def contamination(sub: A2Submission, shards: dict[str, Path], eval_texts: list[str], workers: int = 1) -> Check:
    """Training documents of the shards the run trained on that share 13 words' worth of tokens
    with the evaluation text; `shards` as `audit.trained_shards` verified them (none: synthetic)."""
    from onenode.data.shards import Shard

    if not shards:
        return Check("contamination", True, "no text trained on (synthetic tokens)")
    manifest = sub.data_manifest
    tokenizer = data_tokenizer(sub.data, manifest)
    if tokenizer.content_hash() != manifest["tokenizer"]["sha256"]:
        return Check("contamination", False, "data/ holds another tokenizer than the one its shards were built with")
    encoded = tokenizer.encode_batch(eval_texts)
    words = sum(len(text.split()) for text in eval_texts)
    n = max(NGRAM_WORDS, round(NGRAM_WORDS * sum(map(len, encoded)) / max(words, 1)))
    text = carries_text(tokenizer)
    wanted = sorted_unique(np.concatenate([text_runs(np.asarray(ids), n, text) for ids in encoded]
                                      + [np.empty(0, dtype=np.uint64)]))
    parts, exempt = corpus_parts(manifest), ""
    if parts and len(wanted):
        shared = in_sorted(wanted, corpus_runs(tokenizer, n, parts))
        wanted = wanted[~shared]
        exempt = (f"; {int(shared.sum())} of the evaluation text's runs that the kit corpus's {', '.join(parts)} "
                  "hold outside the suite's held-out documents not counted")
    flagged = flagged_documents(shards, manifest["dtype"], wanted, n, workers) if len(wanted) else {}
    total = sum(Shard(path.with_suffix(""), np.dtype(manifest["dtype"])).num_docs for path in shards.values())
    sources = ", ".join(f"{name}: {count}" for name, count in sorted(flagged.items(), key=lambda x: -x[1]) if count)
    return Check("contamination", not sources,
                 f"{sum(flagged.values())} of {total} training documents share {NGRAM_WORDS} words ({n} tokens) "
                 "with the evaluation text" + (f" ({sources})" if sources else "") + exempt)
