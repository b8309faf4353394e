"""Evaluation text in the data a run trained on, on every profile.

The shards scanned are the ones the run's checkpoints name, verified by hash (`audit.trained_shards`);
the evaluation text is every item of the profile's suite (`onenode.eval.suite.suite_texts`), as
text: it never goes through the submission's tokenizer. A training document is flagged when the
bytes its tokens stand for share with it a run of 13 words: the data pipeline's `decontaminate`
rule (`onenode.data.curation`: words are runs of `\\w`), case kept. So the check decides on what
the shards say, not on which ids say it: the same bytes written with other ids (a merge's two
halves for the merged token) are the same text, and a tokenizer that rewrites the evaluation text
when it is handed it cannot hide it.

Each token id stands for the bytes its vocabulary entry holds, read from the vocabulary alone
(`token_bytes`: the GPT-2 BPE's ranks, a byte-level tokenizer.json's entries through the
byte-level alphabet, an added token's text); the end of a document, and an id with no bytes of its
own, reads as a separator. The data's tokenizer must keep text as it is given (`rewrites_text`):
no normalizer or pre-tokenizer that rewrites or drops text, and its encoding of the suite's text
must give the suite's words back (what the model is evaluated on is that encoding).

Billions of tokens scan in minutes: the memory-mapped shards are read in chunks (each chunk reads a
little before and after itself, so that a run across two chunks is found by the one it starts in),
bytes are joined, decoded and split into words, words and runs of words hashed, all vectorised
(`numpy`), behind a table of the wanted hashes' top bits; chunks spread over the profile's CPU threads.

Two kinds of shared run say nothing of where a text came from, and are not counted: runs of
whitespace (indentation and blank lines are every poem's and table's: words never hold
whitespace), and runs that the kit's own corpus holds outside the documents its offline suite
holds out, in the parts the data was built from (a scene's heading repeated in another scene, a
refrain, a quotation: every honest build of those parts trains on them).
"""

from __future__ import annotations

import json
import re
import unicodedata
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np

from .audit import Check
from .intake import A2Submission

NGRAM_WORDS = 13  # the data pipeline's `decontaminate` n-gram, in words
CHUNK_TOKENS = 1 << 20  # tokens scanned at a time (a few hundred MB of temporaries)
CHUNK_BYTES = 1 << 24  # at most as many bytes at a time (a crafted vocabulary's entries may be long)
SEPARATOR = b"\x00"  # what a document's end and an id without bytes of its own read as: no word
_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_TABLE_BITS = 26  # the lookup table: one byte per value of a hash's top 26 bits (64 MiB)
_FORMS = ("NFC", "NFD", "NFKC", "NFKD")  # the Unicode forms a tokenizer's normalizer may give text
_WORD = re.compile(r"\w+")


class TokenizerUnreadable(ValueError):
    """The bytes of a tokenizer's ids cannot be read from its vocabulary."""


# --- hashing ---------------------------------------------------------------------------------------

def _powers(base: int, count: int) -> np.ndarray:
    """base**0 .. base**(count - 1) modulo 2**64."""
    out = np.empty(count, dtype=np.uint64)
    out[0] = 1
    if count > 1:
        out[1:] = np.cumprod(np.full(count - 1, base, dtype=np.uint64))  # uint64 products wrap modulo 2**64
    return out


_UP = _DOWN = np.ones(1, dtype=np.uint64)


def _power_tables(count: int) -> tuple[np.ndarray, np.ndarray]:
    """B**i and B**-i for i < count (at least; grown by doubling, kept)."""
    global _UP, _DOWN
    if len(_UP) < count:
        size = max(count, 2 * len(_UP))
        _UP, _DOWN = _powers(_BASE, size), _powers(pow(_BASE, -1, 2**64), size)
    return _UP, _DOWN


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


def ngram_hashes(values: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit polynomial hash of each of the len(values) - n + 1 runs of n consecutive values:
    prefix sums of v_i * B**i, differenced and shifted back by B**-i (arithmetic modulo 2**64)."""
    count = len(values) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    up, down = _power_tables(len(values))
    prefix = np.zeros(len(values) + 1, dtype=np.uint64)
    np.cumsum(np.asarray(values, dtype=np.uint64) * up[:len(values)], out=prefix[1:])
    return (prefix[n:] - prefix[:count]) * down[:count]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a word's hash as a run's value, unrelated to its letters' polynomial."""
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# --- text as characters and words --------------------------------------------------------------------

@cache
def _word_characters() -> np.ndarray:
    """Per code point: whether `\\w` matches it (alphanumeric, or `_`), as `curation.words` splits."""
    table = np.fromiter((chr(c).isalnum() for c in range(0x110000)), dtype=bool, count=0x110000)
    table[ord("_")] = True
    return table


def code_points(data: bytes) -> np.ndarray:
    """The characters of UTF-8 `data`; a byte that is no part of a valid character is one
    non-word character of its own (Python's `surrogateescape`)."""
    return np.frombuffer(data.decode("utf-8", "surrogateescape").encode("utf-32-le", "surrogatepass"), np.uint32)


def text_code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


def words(chars: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each word of `chars` (a maximal run of word characters): its first character, its end
    (exclusive) and its hash."""
    edges = np.flatnonzero(np.diff(_word_characters()[chars], prepend=False, append=False))
    starts, ends = edges[0::2], edges[1::2]
    if not len(starts):
        return starts, ends, np.empty(0, dtype=np.uint64)
    up, down = _power_tables(len(chars))
    weighted = np.zeros(len(chars) + 1, dtype=np.uint64)  # a last 0, so that a word may end at the end
    np.multiply(chars, up[:len(chars)], out=weighted[:-1], casting="unsafe")
    sums = np.add.reduceat(weighted, edges)[0::2]  # each word's characters x B**i
    return starts, ends, _mix(sums * down[starts])


def text_ngrams(texts: list[str], n: int = NGRAM_WORDS) -> np.ndarray:
    """The hashes of every run of `n` consecutive words of each text (none across two texts),
    sorted, unique; the texts also in each Unicode form a tokenizer's normalizer may give them."""
    texts = list(texts) + [unicodedata.normalize(form, text) for text in texts if not text.isascii()
                           for form in _FORMS]
    if not texts:
        return np.empty(0, dtype=np.uint64)
    chars = text_code_points("\x00".join(texts))
    ends_of_texts = np.cumsum([len(text) + 1 for text in texts])
    starts, _, hashes = words(chars)
    runs = ngram_hashes(hashes, n)
    text_of = np.searchsorted(ends_of_texts, starts, side="right")
    return sorted_unique(runs[text_of[:len(runs)] == text_of[n - 1:]])


# --- the bytes of token ids ---------------------------------------------------------------------------

@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (`tokenizers`' ByteLevel): the character each byte is written as
    in a vocabulary: printable Latin-1 bytes as themselves, the others as 256, 257, ..."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


def tokenizer_json(tokenizer) -> dict | None:
    """The tokenizer.json of a `tokenizers`-backed tokenizer (a JsonBPE's, a fast transformers
    tokenizer's backend); None for the GPT-2 BPE (tiktoken)."""
    from onenode.data.tokenizer import TiktokenGPT2

    if isinstance(tokenizer, TiktokenGPT2):
        return None
    backend = _backend(tokenizer)
    if not hasattr(backend, "to_str"):
        raise TokenizerUnreadable(f"tokenizer {tokenizer.name!r} has no tokenizer.json to read its vocabulary from "
                                  "(use a fast tokenizer)")
    return json.loads(backend.to_str())


def _kinds(component) -> list[dict]:
    """A normalizer's or pre-tokenizer's steps (a Sequence's members, recursively)."""
    if not isinstance(component, dict):
        return []
    members = component.get("normalizers") or component.get("pretokenizers")
    return [step for member in members for step in _kinds(member)] if members is not None else [component]


def _byte_fallback(piece: str) -> int | None:
    return int(piece[3:5], 16) if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") else None


def _backend(tokenizer):
    """The `tokenizers` object behind a tokenizer (a JsonBPE's, a fast transformers tokenizer's), or None."""
    backend = getattr(tokenizer, "_tok", None)
    return getattr(backend, "backend_tokenizer", backend)


def _normalizer(tokenizer):
    """The tokenizer's normalizer as a function of text (the identity where it has none)."""
    normalizer = getattr(_backend(tokenizer), "normalizer", None)
    return normalizer.normalize_str if normalizer is not None else (lambda text: text)


def token_bytes(tokenizer) -> list[bytes]:
    """Per token id, the bytes it stands for, read from the vocabulary alone: the GPT-2 BPE's ranks;
    a tokenizer.json's entries through the byte-level alphabet (a byte-level tokenizer) or as text
    with `▁` a space and `<0xNN>` byte fallbacks (SentencePiece-like ones); an added token's text.
    A `normalized` added token is matched in the normalized text, so it stands for its content as
    the normalizer writes it (a red team's fullwidth vowels under NFKC stood for plain ones). The
    end of a document (the EOS id), an entry the alphabet cannot write and an id without an entry
    read as SEPARATOR (the list ends with one, for ids past the vocabulary)."""
    spec = tokenizer_json(tokenizer)
    if spec is None:  # tiktoken: the ranks file holds each id's bytes
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(tokenizer._file))
        table = [SEPARATOR] * (max(max(ranks.values()) + 1, tokenizer.vocab_size) + 1)
        for piece, rank in ranks.items():
            table[rank] = piece
        table[tokenizer.eos_id] = SEPARATOR
        return table
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    entries = {piece: i for i, (piece, _) in enumerate(vocab)} if isinstance(vocab, list) else dict(vocab)
    added = {token["id"] for token in spec.get("added_tokens") or []}
    size = max([*entries.values(), *added, tokenizer.eos_id, tokenizer.vocab_size - 1]) + 1
    table: list[bytes | None] = [None] * size
    byte_level = any(step.get("type") == "ByteLevel"
                     for step in _kinds(spec.get("normalizer")) + _kinds(spec.get("pre_tokenizer")))
    alphabet = byte_level_alphabet()
    for piece, i in entries.items():
        if byte_level:
            table[i] = bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else SEPARATOR
        elif model.get("byte_fallback") and _byte_fallback(piece) is not None:
            table[i] = bytes([_byte_fallback(piece)])
        else:
            table[i] = piece.replace("▁", " ").encode("utf-8", "surrogatepass")
    normalize = _normalizer(tokenizer)
    for token in spec.get("added_tokens") or []:  # the encoder writes an added token wherever its text occurs:
        content = token["content"]  # in the normalized text for a `normalized` one, so it stands for that text
        text = normalize(content) if token.get("normalized") else content
        table[token["id"]] = text.encode("utf-8", "surrogatepass")
    table[tokenizer.eos_id] = SEPARATOR
    return [SEPARATOR if entry is None else entry for entry in table] + [SEPARATOR]


_KEEPS_TEXT = {"normalizer": {"NFC", "NFD", "NFKC", "NFKD", "Prepend", "Strip", "ByteLevel"},
               "pre_tokenizer": {"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts"}}


def rewrites_text(tokenizer, table: list[bytes], texts: list[str]) -> str | None:
    """Why the tokenizer does not keep text as it is given, or None: a normalizer or pre-tokenizer
    step that rewrites or drops text (a `Replace` other than SentencePiece's space to `▁`, a split
    that removes what it matches, lower case, ...), or an encoding of one of `texts` whose bytes
    do not give its words back (unknown tokens, stripped spaces). What a model trained on a
    tokenizer's ids learns of a text is what the tokenizer's encoding of it says; a tokenizer that
    rewrites the evaluation text could hold it in the shards rewritten."""
    spec = tokenizer_json(tokenizer)
    for part, kept in _KEEPS_TEXT.items():
        for step in _kinds((spec or {}).get(part)):
            kind = step.get("type")
            space = kind == "Replace" and step.get("pattern") == {"String": " "} and step.get("content") == "▁"
            if (kind not in kept and not space) or str(step.get("behavior", "")).lower() == "removed":
                return f"its {part} has a {kind} step{' that removes what it matches' if kind in kept else ''}"
    for text, ids in zip(texts, tokenizer.encode_batch(texts)):
        got = b"".join(table[min(i, len(table) - 1)] for i in ids).decode("utf-8", "surrogateescape")
        forms = [text, *(unicodedata.normalize(form, text) for form in _FORMS)]  # the forms the scan looks for
        if all(_WORD.findall(got) != _WORD.findall(form) for form in forms):
            return f"its encoding of the evaluation text {text[:60]!r} reads back as {got[:60]!r}"
    return None


# --- the scan ------------------------------------------------------------------------------------------

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


_state: tuple[_Wanted, np.ndarray, np.ndarray, np.ndarray] | None = None  # a scanning process's copy (_start_worker)


def _start_worker(wanted: _Wanted, table: list[bytes]) -> None:
    """The scan's state: the wanted hashes, and `table` as one array of bytes, where each id's start and length."""
    global _state
    lengths = np.array([len(entry) for entry in table], dtype=np.int64)
    _state = wanted, np.frombuffer(b"".join(table), dtype=np.uint8), np.cumsum(lengths) - lengths, lengths


def _bytes_of(ids: np.ndarray, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> bytes:
    """The bytes `ids` stand for, gathered at once (what b"".join(table[i] for i in ids) gives)."""
    size = lengths[ids]
    ends = np.cumsum(size)
    return flat[np.repeat(starts[ids] - (ends - size), size) + np.arange(ends[-1] if len(ends) else 0)].tobytes()


@cache
def _shard(prefix: Path, dtype: str):
    from onenode.data.shards import Shard

    return Shard(prefix, np.dtype(dtype))


def _boundary(data: bytes, at: int) -> int:
    """The first character boundary at or after byte `at` (a UTF-8 continuation byte is inside a character)."""
    while at < len(data) and data[at] & 0xC0 == 0x80:
        at += 1
    return at


def _char_lengths(chars: np.ndarray) -> np.ndarray:
    """Bytes each character of `code_points` came from (an escaped byte: one)."""
    escaped = (chars >= 0xDC80) & (chars < 0xDD00)
    return 1 + (chars >= 0x80) + (chars >= 0x800) + (chars >= 0x10000) - 2 * escaped.astype(np.int64)


def _scan(task: tuple[Path, str, int, int, int]) -> np.ndarray:
    """The documents of one chunk of a shard (tokens `start` to `stop`) in which a wanted run of `n`
    words starts, read in parts of at most CHUNK_BYTES bytes (a vocabulary's entries may be long)."""
    prefix, dtype, n, start, stop = task
    lengths = _state[3]
    sizes = np.cumsum(lengths[np.minimum(np.asarray(_shard(prefix, dtype).tokens[start:stop]), len(lengths) - 1)])
    cuts = np.unique(np.searchsorted(sizes, np.arange(1, int(sizes[-1]) // CHUNK_BYTES + 1) * CHUNK_BYTES) + start)
    edges = [start, *[int(c) for c in cuts if start < c < stop], stop]
    found = [_scan_part(prefix, dtype, n, a, b) for a, b in zip(edges, edges[1:])]
    return sorted_unique(np.concatenate(found))


def _scan_part(prefix: Path, dtype: str, n: int, start: int, stop: int) -> np.ndarray:
    """The documents in which a wanted run of `n` words starts between tokens `start` and `stop`.
    The part is read with a few tokens before it (so that it knows whether its first word began
    earlier: that word's runs are the part before's) and enough after it for its last runs to end
    (grown until `n` words end past it)."""
    wanted, flat, starts_of, lengths = _state
    tokens = _shard(prefix, dtype).tokens
    last = len(lengths) - 1

    def ids(a: int, b: int) -> np.ndarray:
        chunk = np.asarray(tokens[a:b])
        return np.minimum(chunk, last) if len(chunk) and chunk.max() > last else chunk

    back = 8
    while start - back > 0 and lengths[ids(start - back, start)].sum() < 4:  # a character is at most 4 bytes
        back *= 2
    low, ahead = max(start - back, 0), min(1024, stop - start)
    while True:
        high = min(stop + ahead, len(tokens))
        window = ids(low, high)
        data = _bytes_of(window, flat, starts_of, lengths)
        chars = code_points(data)
        starts, ends, hashes = words(chars)
        before = int(lengths[window[:start - low]].sum())  # the chunk's bytes: data[before:after]
        after = before + int(lengths[window[start - low:stop - low]].sum())
        first = len(data[:_boundary(data, before)].decode("utf-8", "surrogateescape"))  # its characters: first to end
        end = len(chars) - len(data[_boundary(data, after):].decode("utf-8", "surrogateescape"))
        complete = len(ends) if high == len(tokens) else int(np.searchsorted(ends, len(chars)))  # words that ended
        if high == len(tokens) or complete - np.searchsorted(ends, end, side="right") >= n:
            break
        ahead *= 4
    runs = ngram_hashes(hashes[:complete], n)
    owned = np.searchsorted(starts, first), np.searchsorted(starts, end)  # runs whose first word starts in the chunk
    hits = wanted.positions(runs[owned[0]:min(owned[1], len(runs))]) + owned[0]
    if not len(hits):
        return np.empty(0, dtype=np.int64)
    char_at = np.concatenate(([0], np.cumsum(_char_lengths(chars[:starts[hits].max() + 1]))))
    token_at = np.concatenate(([0], np.cumsum(lengths[window])))
    at = low + np.searchsorted(token_at, char_at[starts[hits]], side="right") - 1
    return sorted_unique(np.searchsorted(_shard(prefix, dtype).offsets, at, side="right") - 1)


def flagged_documents(shards: dict[str, Path], dtype: str, wanted: np.ndarray, table: list[bytes],
                      n: int = NGRAM_WORDS, workers: int = 1) -> dict[str, int]:
    """Per source, how many of its documents hold a run of `n` words whose hash is in `wanted`,
    their tokens read as `table`'s bytes."""
    tasks = []
    for name, path in shards.items():
        size = len(_shard(path.with_suffix(""), dtype).tokens)
        tasks += [(name, (path.with_suffix(""), dtype, n, start, min(start + CHUNK_TOKENS, size)))
                  for start in range(0, size, CHUNK_TOKENS)]
    state = _Wanted(wanted), table
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(workers, initializer=_start_worker, initargs=state) as pool:
            found = list(pool.map(_scan, [task for _, task in tasks]))
    else:
        _start_worker(*state)
        found = [_scan(task) for _, task in tasks]
    documents: dict[str, set] = {name: set() for name in shards}
    for (name, _), docs in zip(tasks, found):
        documents[name].update(docs.tolist())
    return {name: len(docs) for name, docs in documents.items()}


# --- what is not counted -------------------------------------------------------------------------------

_CORPUS_RUNS: dict[tuple[int, tuple[str, ...]], np.ndarray] = {}


def corpus_parts(manifest: dict) -> tuple[str, ...]:
    """The kit corpus's parts a data folder was built from, as its manifest names them."""
    from onenode.data.corpus import PARTS

    specs = [source.get("spec") for source in (manifest.get("sources") or {}).values() if isinstance(source, dict)]
    return tuple(sorted({spec["part"] for spec in specs
                         if isinstance(spec, dict) and spec.get("kind") == "corpus" and spec.get("part") in PARTS}))


def corpus_runs(n: int, parts: tuple[str, ...]) -> np.ndarray:
    """The runs of `n` words that `parts` of the kit's corpus hold outside the documents the
    offline suite holds out (sorted, unique; computed once)."""
    from onenode.data.build import is_validation
    from onenode.data.corpus import corpus_part
    from onenode.eval.suite import HELDOUT_FRACTION

    key = (n, parts)
    if key not in _CORPUS_RUNS:
        texts = []
        for part in parts:
            with corpus_part(part).open(encoding="utf-8") as f:
                texts += [d["text"] for d in map(json.loads, f) if not is_validation(d["text"], HELDOUT_FRACTION)]
        _CORPUS_RUNS[key] = text_ngrams(texts, n)
    return _CORPUS_RUNS[key]


# --- the check -----------------------------------------------------------------------------------------

def data_tokenizer(data: Path, manifest: dict):
    """The tokenizer the shards were built with: data/tokenizer.json, or the one the manifest names."""
    from onenode.data.tokenizer import load_tokenizer

    own = data / "tokenizer.json"
    return load_tokenizer(str(own) if own.is_file() else manifest["tokenizer"]["name"])


def contamination(sub: A2Submission, shards: dict[str, Path], eval_texts: list[str], workers: int = 1) -> Check:
    """Training documents of the shards the run trained on whose bytes share 13 words with the
    evaluation text; `shards` as `audit.trained_shards` verified them (none: synthetic)."""
    from onenode.data.shards import Shard

    if not shards:
        return Check("contamination", True, "no text trained on (synthetic tokens)")
    manifest = sub.data_manifest
    tokenizer = data_tokenizer(sub.data, manifest)
    if tokenizer.content_hash() != manifest["tokenizer"]["sha256"]:
        return Check("contamination", False, "data/ holds another tokenizer than the one its shards were built with")
    try:
        table = token_bytes(tokenizer)
    except TokenizerUnreadable as e:
        return Check("contamination", False, f"not checked: {e}")
    problem = rewrites_text(tokenizer, table, eval_texts)
    if problem:
        return Check("contamination", False, f"the data's tokenizer does not keep text as it is given ({problem}): "
                     "the check reads the shards' bytes, so the tokenizer must not rewrite text")
    wanted = text_ngrams(eval_texts, NGRAM_WORDS)
    parts, exempt = corpus_parts(manifest), ""
    if parts and len(wanted):
        shared = in_sorted(wanted, corpus_runs(NGRAM_WORDS, parts))
        wanted = wanted[~shared]
        exempt = (f"; {int(shared.sum())} of the evaluation text's runs that the kit corpus's {', '.join(parts)} "
                  "hold outside the suite's held-out documents not counted")
    flagged = flagged_documents(shards, manifest["dtype"], wanted, table, NGRAM_WORDS, workers) if len(wanted) else {}
    total = sum(Shard(path.with_suffix(""), np.dtype(manifest["dtype"])).num_docs for path in shards.values())
    sources = ", ".join(f"{name}: {count}" for name, count in sorted(flagged.items(), key=lambda x: -x[1]) if count)
    return Check("contamination", not sources,
                 f"{sum(flagged.values())} of {total} training documents share {NGRAM_WORDS} words "
                 "with the evaluation text" + (f" ({sources})" if sources else "") + exempt)


def evaluated_tokenizer(sub: A2Submission, eval_texts: list[str] | None) -> Check:
    """Whether final/'s tokenizer, the one the evaluation reads, is the tokenizer the run trained
    with (the hash its last checkpoint's loader names; that loader is the checkpoint's own and the
    data's, by the replay's data order check) and keeps text as it is given (`rewrites_text`, on
    `eval_texts`; None: not read here). A tokenizer swapped in after training, or one whose
    normalizer rewrites the evaluation's answers, scores what the model never learnt."""
    from onenode.data.tokenizer import TokenizerError
    from onenode.eval.model import checkpoint_tokenizer

    loader = sub.chain[-1].meta.get("loader") if sub.chain else None
    settings = loader.get("settings") if isinstance(loader, dict) else None
    trained = settings.get("tokenizer") if isinstance(settings, dict) else None
    try:
        tokenizer = checkpoint_tokenizer(sub.checkpoint)
        found = tokenizer.content_hash()
    except (TokenizerError, OSError, ValueError) as e:
        if trained is None and "carries no tokenizer" in str(e):
            return Check("tokenizer", True, "final/ carries no tokenizer (the run trained on synthetic tokens)")
        return Check("tokenizer", False, f"final/'s tokenizer does not load ({' '.join(str(e).split())[:200]})")
    if trained is not None and found != trained:
        return Check("tokenizer", False, f"final/'s tokenizer (sha256 {found[:12]}) is not the one the run trained "
                                         f"with ({str(trained)[:12]}): submit final/ as `onenode train` wrote it")
    if eval_texts is None:
        return Check("tokenizer", True, "final/'s tokenizer is the one the run trained with (whether it keeps text as "
                                        "given is checked where the suite's text is read)")
    try:
        problem = rewrites_text(tokenizer, token_bytes(tokenizer), eval_texts)
    except TokenizerUnreadable as e:
        return Check("tokenizer", False, f"not checked: {e}")
    if problem:
        return Check("tokenizer", False, f"final/'s tokenizer does not keep text as it is given ({problem}): the "
                                         "evaluation would score text the model never saw")
    return Check("tokenizer", True, "final/'s tokenizer is the one the run trained with and keeps text as it is given")
