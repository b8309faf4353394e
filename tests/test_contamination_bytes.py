"""The contamination check decides on the bytes the shards stand for, never on token ids and never
through the submission's tokenizer's encoder: the suite's text written with other ids (a merge's
two halves) is found, a data tokenizer whose normalizer rewrites the suite's text when the check
hands it over is refused and its shards still read as the text they hold; an honest shard and a
document sharing a few words pass; a run across two chunks of the scan is found, and the chunked
scan finds what one reading of the whole shard finds."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from onenode.data.shards import ShardWriter
from onenode.data.tokenizer import load_tokenizer, train_bpe

C = importlib.import_module("onenode.verify.contamination")  # the package exports the function by that name

SUITE = ("Now is the winter of our discontent made glorious summer by this sun of York, and all the clouds "
         "that lour’d upon our house — in the deep bosom of the ocean buried. Now are our brows bound with "
         "victorious wreaths; our bruisèd arms hung up for monuments; our stern alarums changed to merry "
         "meetings, our dreadful marches to delightful measures.")
CLEAN = ("An entirely different text about ships, sealing wax and kings, and why the sea is boiling hot, "
         "whether pigs have wings, and what the carpenter said to the walrus on the sands. ")
TWELVE = " ".join(SUITE.split()[:12])  # the suite's first 12 words: one short of a run


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE with merges enough that the suite's words are several tokens and one."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe([SUITE, CLEAN, SUITE.upper(), CLEAN.upper()] * 3, 400, path)
    return path


def _data(folder: Path, tokenizer_file: Path, documents: list[list[int]], sources: dict | None = None):
    """A data folder holding `documents` (token ids) as one shard, its tokenizer `tokenizer_file`:
    the submission contamination() reads and the shards it scans."""
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(tokenizer_file.read_text())
    tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
    writer = ShardWriter(folder / "notes" / "train", np.dtype("uint16"), tokenizer.eos_id)
    for ids in documents:
        writer.write(ids)
    writer.close()
    manifest = {"dtype": "uint16", "tokenizer": {**tokenizer.describe(), "name": str(folder / "tokenizer.json")},
                "sources": sources or {"notes": {"spec": {"kind": "files"}}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return SimpleNamespace(data=folder, data_manifest=manifest), {"notes": folder / "notes" / "train.bin"}


def _encode(tokenizer_file: Path, *texts: str) -> list[list[int]]:
    return load_tokenizer(str(tokenizer_file)).encode_batch(list(texts))


def _split_every(ids: list[int], tokenizer_file: Path, k: int) -> list[int]:
    """The red team's non-canonical ids: at least every k-th token that a merge made written as the
    two tokens the merge joined (the same bytes, other ids)."""
    model = json.loads(tokenizer_file.read_text())["model"]
    vocab = model["vocab"]
    parts = {}
    for merge in model["merges"]:
        a, b = merge if isinstance(merge, list) else merge.split(" ")
        parts[vocab[a + b]] = (vocab[a], vocab[b])
    out, since = [], 0
    for t in ids:
        if since >= k - 1 and t in parts:
            out += parts[t]
            since = 0
        else:
            out.append(t)
            since += 1
    return out


def test_an_honest_shard_passes_and_the_suite_in_it_is_flagged(tokenizer_file, tmp_path):
    clean, leak = _encode(tokenizer_file, CLEAN, "Prologue. " + SUITE + " And more.")
    sub, shards = _data(tmp_path / "clean", tokenizer_file, [clean, clean])
    check = C.contamination(sub, shards, [SUITE])
    assert check.ok, check.detail
    assert check.detail == "0 of 2 training documents share 13 words with the evaluation text"
    sub, shards = _data(tmp_path / "leak", tokenizer_file, [clean, leak, clean])
    check = C.contamination(sub, shards, [SUITE])
    assert not check.ok and check.detail == ("1 of 3 training documents share 13 words with the evaluation text "
                                             "(notes: 1)"), check.detail


def test_a_document_sharing_a_few_words_with_the_suite_passes(tokenizer_file, tmp_path):
    twelve, thirteen = _encode(tokenizer_file, CLEAN + TWELVE + " and then " + CLEAN,
                               CLEAN + " ".join(SUITE.split()[:13]) + " and then " + CLEAN)
    sub, shards = _data(tmp_path / "data", tokenizer_file, [twelve])
    assert C.contamination(sub, shards, [SUITE]).ok
    sub, shards = _data(tmp_path / "thirteen", tokenizer_file, [thirteen])
    assert not C.contamination(sub, shards, [SUITE]).ok  # one word more is a run


def test_the_suite_written_with_non_canonical_ids_is_flagged(tokenizer_file, tmp_path):
    """Every 8th token split into the two its merge joined: no run of the canonical ids is left,
    the bytes are the suite's."""
    canonical = _encode(tokenizer_file, SUITE)[0]
    for k in (8, 1):
        split = _split_every(canonical, tokenizer_file, k)
        assert load_tokenizer(str(tokenizer_file)).decode(split) == SUITE and len(split) > len(canonical)
        if k == 1:  # no run of 13 of the canonical ids is left: a check on ids would pass it
            assert not set(zip(*[split[i:] for i in range(13)])) & set(zip(*[canonical[i:] for i in range(13)]))
        sub, shards = _data(tmp_path / f"split{k}", tokenizer_file, [_encode(tokenizer_file, CLEAN)[0], split])
        check = C.contamination(sub, shards, [SUITE])
        assert not check.ok and check.detail.startswith("1 of 2 training documents share 13 words"), check.detail


def _rewriting(tokenizer_file: Path, folder: Path, normalizer: dict) -> Path:
    spec = json.loads(tokenizer_file.read_text())
    spec["normalizer"] = normalizer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder / "tokenizer.json"


def test_a_data_tokenizer_that_rewrites_the_suite_is_refused_and_its_shards_read_as_their_bytes(tokenizer_file,
                                                                                               tmp_path):
    """The red team's data tokenizer: a normalizer that rewrites the suite's text to "e" when it is
    handed to the tokenizer, over shards holding the suite tokenized as usual (the merges are the
    same, so are the ids). The check does not read the suite through it: the shards' bytes are the
    suite's, and the tokenizer, which rewrites text, is refused."""
    crafted = _rewriting(tokenizer_file, tmp_path / "crafted",
                         {"type": "Sequence", "normalizers": [
                             {"type": "Replace", "pattern": {"Regex": r"\A[\s\S]*discontent[\s\S]*"}, "content": "e"}]})
    assert load_tokenizer(str(crafted)).encode_batch([SUITE])[0] == _encode(tokenizer_file, "e")[0]
    sub, shards = _data(tmp_path / "data", crafted, [_encode(tokenizer_file, CLEAN)[0],
                                                     _encode(tokenizer_file, SUITE)[0]])
    check = C.contamination(sub, shards, [SUITE])
    assert not check.ok and "does not keep text as it is given" in check.detail and "Replace" in check.detail
    table = C.token_bytes(load_tokenizer(str(crafted)))  # the scan, by the vocabulary alone
    assert C.flagged_documents(shards, "uint16", C.text_ngrams([SUITE]), table) == {"notes": 1}


def test_a_tokenizer_that_loses_text_is_refused_and_an_honest_one_is_not(tokenizer_file, tmp_path):
    lower = _rewriting(tokenizer_file, tmp_path / "lower", {"type": "Lowercase"})
    assert "Lowercase" in C.rewrites_text(load_tokenizer(str(lower)), C.token_bytes(load_tokenizer(str(lower))),
                                          [SUITE])
    spec = json.loads(tokenizer_file.read_text())  # "o" unknown: the encoder drops it (no byte-level alphabet)
    spec["pre_tokenizer"] = None
    spec["decoder"] = None
    spec["model"]["vocab"] = {piece: i for piece, i in spec["model"]["vocab"].items() if "o" not in piece}
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "o" not in "".join(m)]
    (tmp_path / "lossy.json").write_text(json.dumps(spec))
    lossy = load_tokenizer(str(tmp_path / "lossy.json"))
    assert "reads back as" in C.rewrites_text(lossy, C.token_bytes(lossy), ["Now is the winter of our discontent"])
    honest = load_tokenizer(str(tokenizer_file))
    assert C.rewrites_text(honest, C.token_bytes(honest), [SUITE, CLEAN, "ünïcödé — 漢字 😀 text"]) is None


def test_an_added_token_reads_as_its_text(tokenizer_file, tmp_path):
    """A token added for a word is written wherever the word occurs: it reads as the word, or
    adding one for "the" would cut every run."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.add_special_tokens(["the", "our"])
    tok.save(str(tmp_path / "added.json"))
    added = load_tokenizer(str(tmp_path / "added.json"))
    ids = added.encode_batch([SUITE])[0]
    assert tok.token_to_id("the") in ids
    sub, shards = _data(tmp_path / "data", tmp_path / "added.json", [ids])
    check = C.contamination(sub, shards, [SUITE])
    assert check.detail.startswith("1 of 1 training documents share 13 words"), check.detail


def _reference(table: list[bytes], documents: list[list[int]], eval_texts: list[str], eos: int) -> set[int]:
    """The documents holding a run of 13 of the suite's words, found by reading the whole shard as one text."""
    runs = set()
    for text in eval_texts:
        found = re.findall(r"\w+", text)
        runs |= {tuple(found[i:i + 13]) for i in range(len(found) - 12)}
    tokens = [t for ids in documents for t in [*ids, eos]]
    doc_of = [d for d, ids in enumerate(documents) for _ in range(len(ids) + 1)]
    data = b"".join(table[t] for t in tokens)
    token_of = [i for i, t in enumerate(tokens) for _ in table[t]]
    text = data.decode("utf-8", "surrogateescape")
    byte_of, at = [], 0
    for ch in text:
        byte_of.append(at)
        at += len(ch.encode("utf-8", "surrogateescape"))
    matches = list(re.finditer(r"\w+", text))
    return {doc_of[token_of[byte_of[matches[i].start()]]] for i in range(len(matches) - 12)
            if tuple(m.group() for m in matches[i:i + 13]) in runs}


@pytest.mark.parametrize("chunk,chunk_bytes", [(5, 1 << 24), (16, 1 << 24), (61, 1 << 24), (1 << 20, 1 << 24),
                                               (1 << 20, 37)])
def test_runs_across_chunk_boundaries_are_found_as_in_one_reading(tokenizer_file, tmp_path, monkeypatch, chunk,
                                                                  chunk_bytes):
    """Chunks of a few tokens (or of a few bytes): most runs cross a boundary, many characters
    (`’`, `—`, `è`: several bytes, several byte-level tokens) too; the scan finds the documents
    one reading finds."""
    monkeypatch.setattr(C, "CHUNK_TOKENS", chunk)
    monkeypatch.setattr(C, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(chunk)
    words = SUITE.split()
    pieces = [CLEAN, SUITE, " ".join(words[:13]), " ".join(words[5:17]), "—".join(words[20:34]), SUITE.upper(),
              CLEAN + " ".join(words[-13:]), "   \n\n  ", "x"]
    texts = [" ".join(rng.choice(pieces, size=rng.integers(1, 4))) for _ in range(40)]
    tokenizer = load_tokenizer(str(tokenizer_file))
    documents = [_split_every(ids, tokenizer_file, int(rng.integers(1, 9))) for ids in tokenizer.encode_batch(texts)]
    table = C.token_bytes(tokenizer)
    expected = _reference(table, documents, [SUITE], tokenizer.eos_id)
    assert 0 < len(expected) < len(documents)
    sub, shards = _data(tmp_path / "data", tokenizer_file, documents)
    assert C.flagged_documents(shards, "uint16", C.text_ngrams([SUITE]), table) == {"notes": len(expected)}
    check = C.contamination(sub, shards, [SUITE])
    assert check.detail.startswith(f"{len(expected)} of 40 training documents share 13 words"), check.detail


def test_a_run_across_one_chunk_boundary_is_found_by_the_chunk_it_starts_in(tokenizer_file, tmp_path, monkeypatch):
    """One document, its only run of the suite's 13 words straddling the boundary between the
    scan's first chunk and its second, wherever it is cut (two worker processes scan the chunks
    once); a chunk starting inside a word reads the word whole ("XNow" is not "Now")."""
    doc = _encode(tokenizer_file, CLEAN + " ".join(SUITE.split()[:13]) + ". " + CLEAN)[0]
    sub, shards = _data(tmp_path / "data", tokenizer_file, [doc])
    glued = _encode(tokenizer_file, CLEAN + "X" + " ".join(SUITE.split()[:13]) + ". " + CLEAN)[0]
    glued_sub, glued_shards = _data(tmp_path / "glued", tokenizer_file, [glued])
    before = len(_encode(tokenizer_file, CLEAN)[0])
    for chunk in range(before - 2, before + 12):
        monkeypatch.setattr(C, "CHUNK_TOKENS", chunk)
        assert not C.contamination(sub, shards, [SUITE], workers=2 if chunk == before + 4 else 1).ok, chunk
        assert C.contamination(glued_sub, glued_shards, [SUITE]).ok, chunk
    monkeypatch.setattr(C, "CHUNK_TOKENS", 7)
    assert C.contamination(sub, shards, [SUITE + " and", " ".join(SUITE.split()[1:])]).ok is False
    assert C.contamination(sub, shards, [" ".join(SUITE.split()[1:])]).ok  # the run less its first word: 12 words


def test_text_ngrams_never_cross_two_texts():
    words = SUITE.split()
    assert len(C.text_ngrams([" ".join(words[:7]), " ".join(words[7:13])])) == 0
    assert len(C.text_ngrams([" ".join(words[:13])])) == 1


def _run_with_final(folder: Path, tokenizer: Path | None, trained: str | None) -> SimpleNamespace:
    """What `evaluated_tokenizer` reads of a run: final/ (with `tokenizer` as its tokenizer.json, or
    none) and the last checkpoint's loader, naming the tokenizer hash `trained` (None: synthetic)."""
    final = folder / "final"
    final.mkdir(parents=True)
    if tokenizer is not None:
        (final / "tokenizer.json").write_text(tokenizer.read_text())
    loader = {"settings": {"tokenizer": trained}} if trained else {"batches": 4}
    return SimpleNamespace(checkpoint=final, chain=[SimpleNamespace(meta={"loader": loader})])


def test_the_evaluated_tokenizer_is_the_one_trained_with_and_keeps_text(tokenizer_file, tmp_path):
    """The red team's swap: final/'s tokenizer replaced after training by one whose normalizer
    rewrites the suite's answers (80/80 before). Refused whether the run trained on shards (another
    hash than its loader names) or on synthetic tokens (a tokenizer that rewrites text); the
    tokenizer the run trained with passes, as does a synthetic run's final/ without one."""
    honest = load_tokenizer(str(tokenizer_file)).content_hash()
    crafted = _rewriting(tokenizer_file, tmp_path / "crafted",
                         {"type": "Replace", "pattern": {"Regex": r"discontent"}, "content": "e"})
    assert C.evaluated_tokenizer(_run_with_final(tmp_path / "a", tokenizer_file, honest), [SUITE]).ok
    swapped = C.evaluated_tokenizer(_run_with_final(tmp_path / "b", crafted, honest), [SUITE])
    assert not swapped.ok and "is not the one the run trained with" in swapped.detail
    synthetic = C.evaluated_tokenizer(_run_with_final(tmp_path / "c", crafted, None), [SUITE])
    assert not synthetic.ok and "does not keep text as it is given" in synthetic.detail
    assert C.evaluated_tokenizer(_run_with_final(tmp_path / "d", None, None), [SUITE]).ok
    assert not C.evaluated_tokenizer(_run_with_final(tmp_path / "e", None, honest), [SUITE]).ok


def test_a_normalized_added_token_stands_for_its_normalized_text(tokenizer_file, tmp_path):
    """The red team's second data tokenizer: an NFKC normalizer (allowed) and added tokens whose
    content is a fullwidth vowel, matched in the normalized text, so every plain vowel in the shards
    is one of them; read as its content's bytes, no run of the suite matched (0 of 14 held-out
    documents, verified). Read as what the normalizer makes of it, the suite in the shards is found."""
    spec = json.loads(tokenizer_file.read_text())
    spec["normalizer"] = {"type": "NFKC"}
    model = spec["model"]
    for a, b in model["merges"][-5:]:  # room in the vocabulary for the added tokens
        del model["vocab"][a + b]
    model["merges"] = model["merges"][:-5]
    top = max(model["vocab"].values())
    spec["added_tokens"] += [{"id": top + 1 + k, "content": chr(0xFF00 + ord(c) - 0x20), "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": True, "special": False}
                             for k, c in enumerate("aeiou")]
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(spec))
    tokenizer = load_tokenizer(str(crafted))
    assert tokenizer.decode(tokenizer.encode_batch([SUITE])[0]) == SUITE  # it round-trips: an honest-looking one
    sub, shards = _data(tmp_path / "data", crafted, tokenizer.encode_batch([CLEAN, SUITE]))
    check = C.contamination(sub, shards, [SUITE])
    assert not check.ok and check.detail.startswith("1 of 2 training documents share 13 words")
