"""Megatron's indexed dataset format both ways, through megatron-core itself: what the kit writes
with `--format megatron` is what megatron-core reads, token for token; what megatron-core's builder
wrote (documents of several sequences, as Megatron-LM's preprocessing splits sentences) the kit
trains on in the seeded, resumable order of its own shards; the A2 audit and contamination check
read it as the kit's shards; without megatron-core both routes stop with one line saying what to
install.

CI installs the [megatron] extra, so there a missing megatron-core fails these tests instead of
skipping them."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from synthetic_sources import write_sources

from onenode.cli import main
from onenode.data.build import build
from onenode.data.loader import MixtureLoader
from onenode.data.shards import Shard, ShardWriter
from onenode.data.tokenizer import train_bpe

WEIGHTS = {"alpha": 0.6, "beta": 0.4}
TINY = Path(__file__).resolve().parents[1] / "a2_pretrain" / "recipes" / "tiny.yaml"
SMALL = {"train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.token_budget": 384, "checkpoint.every_steps": 0, "eval.every_steps": 0,
         "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False}
NO_MEGATRON = {"megatron": None, "megatron.core": None, "megatron.core.datasets": None}


def megatron_indexed_dataset():
    if os.environ.get("CI") == "true":
        from megatron.core.datasets import indexed_dataset
    else:
        indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                              reason="megatron-core is not installed (extra [megatron])")
    return indexed_dataset


@pytest.fixture(scope="module")
def both_formats(tmp_path_factory):
    """One data config built twice: the kit's own shards, and Megatron's format."""
    megatron_indexed_dataset()
    root = tmp_path_factory.mktemp("megatron")
    config = {"tokenizer": {"train_bpe": {"vocab_size": 300}}, "val_fraction": 0.15,
              "sources": write_sources(root, WEIGHTS, docs=30, vocabulary=150, max_words=90)}
    manifests = {fmt: build({**config, "format": fmt}, root / fmt, command="test", log=lambda *_: None)
                 for fmt in ("onenode", "megatron")}
    return root, manifests


def test_megatron_core_reads_what_the_kit_wrote_token_for_token(both_formats):
    indexed_dataset = megatron_indexed_dataset()
    root, manifests = both_formats
    kit, megatron = manifests["onenode"], manifests["megatron"]
    assert (kit["format"], megatron["format"]) == ("onenode-shards/1", "megatron/1")
    assert megatron["tokenizer"] == kit["tokenizer"] and megatron["curation"] == kit["curation"]
    assert megatron["dtype"] == "uint16"
    for name in WEIGHTS:
        for split in ("train", "val"):
            assert megatron["sources"][name]["splits"][split] == kit["sources"][name]["splits"][split]
            shard = Shard(root / "onenode" / name / split, np.uint16)
            dataset = indexed_dataset.IndexedDataset(str(root / "megatron" / name / split))
            assert len(dataset) == shard.num_docs == len(dataset.document_indices) - 1 > 0
            for i in range(shard.num_docs):
                assert dataset[i].dtype == np.uint16
                np.testing.assert_array_equal(dataset[i], shard.document(i))
                assert dataset[i][-1] == kit["tokenizer"]["eos_id"]  # one sequence a document, EOS last


def test_the_loader_serves_both_formats_in_the_same_order(both_formats):
    root, _ = both_formats
    kit = MixtureLoader(root / "onenode", batch_size=4, seq_len=24, seed=5)
    megatron = MixtureLoader(root / "megatron", batch_size=4, seq_len=24, seed=5)
    for _ in range(5):
        for a, b in zip(next(kit), next(megatron)):
            assert (a == b).all()
    assert kit.order_digest == megatron.order_digest
    assert kit.state_dict() == megatron.state_dict()  # the same shards by hash: the .bin files are identical


def _megatron_lm_prefix(tmp_path, dtype=np.uint16):
    """A prefix as Megatron-LM's preprocessing writes it (split sentences, --append-eod), with the
    tokenizer it was made with beside it; and the same documents in the kit's own format."""
    indexed_dataset = megatron_indexed_dataset()
    folder = tmp_path / "megatron_lm"
    texts = [f"doc {d}. " + ". ".join(f"sentence {s} of {d} with words w{(d * s) % 17}" for s in range(1 + d % 4))
             for d in range(40)]
    tokenizer = train_bpe(texts, 280, folder / "tokenizer.json")
    prefix = folder / "corpus_text_document"
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    kit = ShardWriter(tmp_path / "kit" / "corpus_text_document" / "train", np.dtype(dtype), tokenizer.eos_id)
    documents = []
    for text in texts:
        sentences = tokenizer.encode_batch([s + "." for s in text.split(". ")])
        sentences[-1] = [*sentences[-1], tokenizer.eos_id]
        tokens = [t for s in sentences for t in s]
        builder.add_document(np.array(tokens), [len(s) for s in sentences])
        kit.write(tokens[:-1])  # the kit's writer adds the EOS itself
        documents.append(tokens)
    builder.finalize(f"{prefix}.idx")
    kit.close()
    return prefix, tokenizer, documents


def test_the_kit_reads_megatron_lm_data_in_its_seeded_resumable_order(tmp_path, monkeypatch):
    from onenode.data.megatron_source import megatron_data_folder

    monkeypatch.setenv("ONENODE_CACHE", str(tmp_path / "cache"))
    prefix, tokenizer, documents = _megatron_lm_prefix(tmp_path)
    folder = megatron_data_folder(prefix)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["tokenizer"]["sha256"] == tokenizer.content_hash()
    shard = Shard(folder / "corpus_text_document" / "train", np.uint16)
    assert [shard.document(i).tolist() for i in range(shard.num_docs)] == documents  # sentences joined

    def loader():
        return MixtureLoader(folder, batch_size=2, seq_len=16, seed=3, rank=1, world_size=2)

    straight = loader()
    batches = [next(straight) for _ in range(6)]
    first = loader()
    for _ in range(3):
        next(first)
    resumed = loader()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for expected in batches[3:]:
        for a, b in zip(expected, next(resumed)):
            assert (a == b).all()
    # the same documents in the kit's own shards: the same seeded order
    (tmp_path / "kit" / "manifest.json").write_text(json.dumps({**manifest, "format": "onenode-shards/1"}))
    (tmp_path / "kit" / "tokenizer.json").write_bytes((prefix.parent / "tokenizer.json").read_bytes())
    ShardWriter(tmp_path / "kit" / "corpus_text_document" / "val", np.uint16, tokenizer.eos_id).close()
    own = MixtureLoader(tmp_path / "kit", batch_size=2, seq_len=16, seed=3, rank=1, world_size=2)
    for expected in batches:
        for a, b in zip(expected, next(own)):
            assert (a == b).all()


def test_the_trainer_trains_on_a_megatron_prefix(tmp_path, monkeypatch):
    import torch

    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    monkeypatch.setenv("ONENODE_CACHE", str(tmp_path / "cache"))
    prefix, _, _ = _megatron_lm_prefix(tmp_path)
    recipe = load_recipe(TINY, {**SMALL, "data.source": "megatron", "data.path": str(prefix)})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        manifest = Trainer(recipe, tmp_path / "run", resume=None).fit()
    finally:
        torch.set_num_threads(threads)
    assert manifest["status"] == "finished" and manifest["data_tokens_served"] == manifest["tokens_seen"]
    meta = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert set(meta["loader"]["settings"]["shards"]) == {"corpus_text_document"}
    assert (tmp_path / "run" / "final" / "tokenizer.json").is_file()  # evaluation finds the tokenizer


def test_a_megatron_prefix_needs_its_tokenizer_and_the_kit_train_split(tmp_path, monkeypatch, both_formats):
    from onenode.data.megatron_source import megatron_data_folder

    monkeypatch.setenv("ONENODE_CACHE", str(tmp_path / "cache"))
    prefix, _, _ = _megatron_lm_prefix(tmp_path)
    (prefix.parent / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="carries no tokenizer"):
        megatron_data_folder(prefix)
    root, _ = both_formats
    with pytest.raises(ValueError, match="name the train split"):
        megatron_data_folder(root / "megatron" / "alpha" / "val")
    kit_view = megatron_data_folder(root / "megatron" / "alpha" / "train")
    assert set(json.loads((kit_view / "manifest.json").read_text())["sources"]) == {"alpha"}
    assert next(MixtureLoader(kit_view, batch_size=1, seq_len=8, split="val"))[0].shape == (1, 8)


def test_a_corrupt_megatron_index_is_one_clear_error(tmp_path, both_formats):
    root, _ = both_formats
    prefix = tmp_path / "train"
    (tmp_path / "train.bin").write_bytes((root / "megatron" / "alpha" / "train.bin").read_bytes())
    index = (root / "megatron" / "alpha" / "train.idx").read_bytes()
    for broken in (b"not an index at all", index[:30], index[:9] + b"\x07" + index[10:]):
        (tmp_path / "train.idx").write_bytes(broken)
        with pytest.raises(ValueError, match="not a Megatron index"):
            Shard(prefix, np.uint16)


def test_the_a2_audit_and_contamination_check_read_megatron_shards(both_formats, tmp_path):
    """The run's loader names the shards; the audit finds and hashes them in the submitted data/,
    and the contamination check finds a training document that the evaluation text quotes."""
    from onenode.data.tokenizer import data_tokenizer
    from onenode.verify.audit import trained_shards
    from onenode.verify.contamination import contamination
    from onenode.verify.intake import A2Submission, Link

    root, manifests = both_formats
    found = {}
    for fmt in ("onenode", "megatron"):
        data = root / fmt
        settings = MixtureLoader(data, batch_size=2, seq_len=16).state_dict()["settings"]
        sub = A2Submission(fmt, tmp_path, tmp_path, tmp_path, tmp_path, tmp_path, None, data,
                           [Link(tmp_path / "step_00000001", {"step": 1, "loader": {"settings": settings}})],
                           {}, [], manifests[fmt])
        shards, check = trained_shards(sub)
        assert check.ok and set(shards) == set(WEIGHTS), check.detail
        quoted = data_tokenizer(data).decode(Shard(data / "beta" / "train", np.dtype(manifests[fmt]["dtype"]))
                                             .document(4).tolist()[:-1])
        clean, dirty = contamination(sub, shards, ["nothing of the data here"]), contamination(sub, shards, [quoted])
        assert clean.ok and not dirty.ok, (clean.detail, dirty.detail)
        found[fmt] = dirty.detail
    assert found["onenode"] == found["megatron"]


def test_without_megatron_core_both_routes_say_what_to_install(tmp_path, monkeypatch, capsys):
    from onenode.train.recipe import RecipeError, load_recipe
    from onenode.train.trainer import Trainer

    for name, module in NO_MEGATRON.items():
        monkeypatch.setitem(sys.modules, name, module)
    config = tmp_path / "data.yaml"
    config.write_text(json.dumps({"sources": write_sources(tmp_path, WEIGHTS, docs=30, vocabulary=150, max_words=90)}))
    assert main(["data", "build", str(config), "--out", str(tmp_path / "out"), "--format", "megatron"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "pip install -e '.[megatron]'" in error
    assert not (tmp_path / "out").exists()  # it stopped before curating anything
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.idx").write_bytes(b"")
    recipe = load_recipe(TINY, {**SMALL, "data.source": "megatron", "data.path": str(tmp_path / "x")})
    with pytest.raises(RecipeError, match=r"needs megatron-core: pip install -e '\.\[megatron\]'") as caught:
        Trainer(recipe, tmp_path / "run", resume=None)
    assert "\n" not in str(caught.value)
