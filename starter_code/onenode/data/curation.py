"""Curation steps students switch on and compare; each counts what it removed and why.

Every step is a streaming filter (`keep(text) -> bool`), so the same code runs on the offline
corpus and on a hub stream of millions of documents. A document is kept when every filter of
`build_filters` keeps it, in the order of `STEPS`: cheap per-document heuristics first, then
dedup (exact, then MinHash near-dup), then decontamination against evaluation sets. Each filter
sees only the documents the earlier ones kept.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

_WORD = re.compile(r"\w+")
_SYMBOLS = "#$%&*+/<=>@\\^_`{|}~"
_ASCII_LETTER = re.compile(r"[A-Za-z]")


def _has_letter(token: str) -> bool:
    """Whether any character of `token` is a letter (`str.isalpha`), by a regex where it is ASCII."""
    return bool(_ASCII_LETTER.search(token)) if token.isascii() else any(map(str.isalpha, token))


def words(text: str) -> list[str]:
    """Lower-cased word tokens: what dedup and decontamination compare."""
    return _WORD.findall(text.lower())


def ngram_hashes(tokens: list[str], n: int) -> np.ndarray:
    """64-bit hashes of every word n-gram (one hash of the whole text when it is shorter)."""
    if not tokens:
        return np.zeros(0, dtype=np.uint64)
    ids = np.fromiter((zlib.crc32(w.encode()) for w in tokens), dtype=np.uint64, count=len(tokens))
    n = min(n, len(ids))
    out = np.zeros(len(ids) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # polynomial rolling hash, wrapping mod 2**64 on purpose
        for k in range(n):
            out = out * np.uint64(1_000_003) + ids[k : len(ids) - n + 1 + k]
    return out


class Filter:
    """A curation step: `keep(text)` decides, `removed` counts, `report()` says why."""

    name = "filter"

    def __init__(self):
        self.seen = 0
        self.removed: Counter[str] = Counter()

    def keep(self, text: str) -> bool:
        self.seen += 1
        reason = self.reject_reason(text)
        if reason:
            self.removed[reason] += 1
        return reason is None

    def reject_reason(self, text: str) -> str | None:
        raise NotImplementedError

    def report(self) -> dict:
        return {"seen": self.seen, "removed": sum(self.removed.values()),
                "reasons": dict(sorted(self.removed.items())), "settings": self.settings()}

    def settings(self) -> dict:
        return {}


class QualityFilter(Filter):
    """Gopher-style heuristics that catch boilerplate, tables, ASCII art and spam.

    Limits: document length in characters; symbols (#, |, {, ...) per visible character; share
    of whitespace-separated words with a letter; share of line characters in lines seen before
    in the document; share of word characters in the most frequent repeated word bigram.
    """

    name = "quality"

    def __init__(self, min_chars: int = 100, max_chars: int = 1_000_000,
                 max_symbol_ratio: float = 0.1, min_alpha_words: float = 0.7,
                 max_dup_line_chars: float = 0.3, max_top_bigram_chars: float = 0.2):
        super().__init__()
        self.limits = dict(min_chars=min_chars, max_chars=max_chars,
                           max_symbol_ratio=max_symbol_ratio, min_alpha_words=min_alpha_words,
                           max_dup_line_chars=max_dup_line_chars,
                           max_top_bigram_chars=max_top_bigram_chars)

    def settings(self) -> dict:
        return self.limits

    def reject_reason(self, text: str) -> str | None:
        lim = self.limits
        if len(text) < lim["min_chars"]:
            return "too_short"
        if len(text) > lim["max_chars"]:
            return "too_long"
        tokens = text.split()
        visible = sum(map(len, tokens))
        if sum(text.count(c) for c in _SYMBOLS) > lim["max_symbol_ratio"] * visible:
            return "symbols"
        if sum(map(_has_letter, tokens)) < lim["min_alpha_words"] * len(tokens):
            return "not_alphabetic"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        seen, dup_chars = set(), 0
        for line in lines:
            dup_chars += len(line) if line in seen else 0
            seen.add(line)
        if dup_chars > lim["max_dup_line_chars"] * sum(map(len, lines)):
            return "repeated_lines"
        low = [t.lower() for t in tokens]
        bigrams = Counter(zip(low, low[1:]))
        if bigrams:
            (a, b), count = bigrams.most_common(1)[0]
            if count > 1 and count * (len(a) + len(b)) > lim["max_top_bigram_chars"] * visible:
                return "repeated_ngrams"
        return None


class LanguageFilter(Filter):
    """Keeps documents identified as `lang` by py3langid (an optional dependency)."""

    name = "language"

    def __init__(self, lang: str = "en", min_score: float = 0.5):
        super().__init__()
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ModuleNotFoundError:
            raise ModuleNotFoundError("the language filter needs py3langid: pip install py3langid") from None
        self._identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        self.lang, self.min_score = lang, min_score

    def settings(self) -> dict:
        return {"lang": self.lang, "min_score": self.min_score}

    def reject_reason(self, text: str) -> str | None:
        lang, score = self._identifier.classify(text[:2000])
        if lang != self.lang:
            return f"lang_{lang}"
        return "low_score" if score < self.min_score else None


def normalise(text: str) -> str:
    """What two exact duplicates share: NFKC, lower case, words only, single spaces."""
    return " ".join(words(unicodedata.normalize("NFKC", text)))


def doc_hash(text: str) -> str:
    return hashlib.sha256(normalise(text).encode()).hexdigest()


class ExactDedup(Filter):
    """Drops a document whose normalised text was already seen (across all sources)."""

    name = "exact_dedup"

    def __init__(self):
        super().__init__()
        self._seen: set[bytes] = set()

    def reject_reason(self, text: str) -> str | None:
        key = bytes.fromhex(doc_hash(text))[:16]  # 16 bytes keep the set small
        if key in self._seen:
            return "duplicate"
        self._seen.add(key)
        return None


class NearDedup(Filter):
    """MinHash over word shingles with LSH banding: drops a document whose estimated Jaccard
    similarity to an earlier kept one reaches `threshold`.

    Each of `num_perm` hash functions h(x) = (a x + b mod 2^64) >> 32 (multiply-shift, a odd) maps
    the document's shingle hashes to their minimum; the fraction of equal minima estimates Jaccard
    similarity. Signatures are cut into `bands` bands; documents sharing a band are candidates,
    then compared on the full signature.
    """

    name = "near_dedup"

    def __init__(self, threshold: float = 0.8, num_perm: int = 128, bands: int = 16,
                 shingle: int = 5, seed: int = 0):
        super().__init__()
        if num_perm % bands:
            raise ValueError(f"near_dedup: num_perm ({num_perm}) must be a multiple of bands ({bands})")
        rng = np.random.default_rng(seed)
        self._a = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._b = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64)
        self.threshold, self.num_perm, self.bands, self.shingle = threshold, num_perm, bands, shingle
        self._buckets: list[dict[bytes, int]] = [{} for _ in range(bands)]
        self._signatures: list[np.ndarray] = []

    def settings(self) -> dict:
        return {"threshold": self.threshold, "num_perm": self.num_perm, "bands": self.bands,
                "shingle": self.shingle}

    def signature(self, text: str) -> np.ndarray:
        x = np.unique(ngram_hashes(words(text), self.shingle))
        if len(x) == 0:
            x = np.zeros(1, dtype=np.uint64)
        with np.errstate(over="ignore"):  # wrapping mod 2**64 is the hash; in place: one [perm, n] array
            hashed = np.multiply(self._a[:, None], x[None, :])
            hashed += self._b[:, None]
        hashed >>= np.uint64(32)
        return hashed.min(axis=1).astype(np.uint32)  # kept for every document: 4 bytes a value

    def reject_reason(self, text: str) -> str | None:
        sig = self.signature(text)
        keys = [band.tobytes() for band in np.split(sig, self.bands)]
        for buckets, key in zip(self._buckets, keys):
            other = buckets.get(key)
            if other is not None and np.mean(self._signatures[other] == sig) >= self.threshold:
                return "near_duplicate"
        index = len(self._signatures)
        self._signatures.append(sig)
        for buckets, key in zip(self._buckets, keys):
            buckets.setdefault(key, index)
        return None


def read_eval_texts(paths: Iterable[str | Path]) -> list[str]:
    """Evaluation items from .txt (one per blank-line-separated block) or .jsonl (every string
    field of a record, joined) files."""
    texts = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"decontamination set {path} does not exist")
        if path.suffix == ".jsonl":
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    values = record.values() if isinstance(record, dict) else [record]
                    texts.append(" ".join(v for v in values if isinstance(v, str)))
        else:
            texts.extend(b for b in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if b.strip())
    return texts


class Decontaminate(Filter):
    """Drops a training document sharing any word n-gram (13 by default) with an evaluation
    item; items shorter than n words must appear whole."""

    name = "decontaminate"

    def __init__(self, eval_texts: list[str], ngram: int = 13):
        super().__init__()
        self.ngram, self.items = ngram, len(eval_texts)
        self._grams: dict[int, set[int]] = {}
        for text in eval_texts:
            tokens = words(text)
            if tokens:
                n = min(ngram, len(tokens))
                self._grams.setdefault(n, set()).update(ngram_hashes(tokens, n).tolist())

    def settings(self) -> dict:
        return {"ngram": self.ngram, "eval_items": self.items}

    def reject_reason(self, text: str) -> str | None:
        tokens = words(text)
        for n, grams in self._grams.items():
            if len(tokens) >= n and not grams.isdisjoint(ngram_hashes(tokens, n).tolist()):
                return "overlaps_eval"
        return None


STEPS = {"quality": QualityFilter, "language": LanguageFilter, "exact_dedup": ExactDedup,
         "near_dedup": NearDedup, "decontaminate": Decontaminate}


def build_filters(config: dict, log=print) -> list[Filter]:
    """Filters from the `curation:` section of a data config, in the fixed order of STEPS.

    A step is switched on by its key (`true` for defaults, or a mapping of settings);
    `decontaminate` takes `files:` (eval sets) and `ngram:`. A step whose optional dependency is
    missing is skipped with a note.
    """
    unknown = set(config) - set(STEPS)
    if unknown:
        raise ValueError(f"unknown curation step(s) {sorted(unknown)}: choose from {list(STEPS)}")
    filters = []
    for name, cls in STEPS.items():
        settings = config.get(name)
        if settings is None or settings is False:
            continue
        settings = {} if settings is True else dict(settings)
        if name == "decontaminate":
            settings["eval_texts"] = read_eval_texts(settings.pop("files", []))
        try:
            filters.append(cls(**settings))
        except ModuleNotFoundError as e:
            log(f"note: curation step {name!r} skipped: {e}")
    return filters
