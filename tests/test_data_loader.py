"""The mixture loader: proportions, rank slices, exact resume, next-token labels."""

import json

import numpy as np
import pytest
import torch
from synthetic_sources import write_sources

from onenode.data.build import build
from onenode.data.loader import MixtureLoader
from onenode.data.tokenizer import data_tokenizer

WEIGHTS = {"alpha": 0.5, "beta": 0.3, "gamma": 0.2}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Three sources of distinct synthetic documents, tokenized by a tiny trained BPE."""
    root = tmp_path_factory.mktemp("mixture")
    sources = write_sources(root, WEIGHTS, docs=40, vocabulary=200, max_words=120)
    manifest = build({"tokenizer": {"train_bpe": {"vocab_size": 400}}, "val_fraction": 0.1,
                      "sources": sources}, root / "data", command="test")
    trained = data_tokenizer(root / "data")  # trained on the curated text, hash-checked
    assert manifest["tokenizer"]["sha256"] == trained.content_hash()
    return root / "data"


def train_tokens(data_dir, source):
    manifest = json.loads((data_dir / "manifest.json").read_text())
    return manifest["sources"][source]["splits"]["train"]["tokens"]


def take(loader, steps):
    return [next(loader) for _ in range(steps)]


def test_batches_are_next_token_pairs_packed_with_eos(data_dir):
    loader = MixtureLoader(data_dir, batch_size=4, seq_len=32)
    input_ids, labels = next(loader)
    assert input_ids.shape == labels.shape == (4, 32)
    assert input_ids.dtype == labels.dtype == torch.long
    assert torch.equal(input_ids[:, 1:], labels[:, :-1])
    assert loader.tokens_served == 4 * 32
    later = torch.cat([x for x, _ in take(loader, 10)])
    assert (later == loader.eos_id).any()  # documents are packed across EOS boundaries


def test_mixture_matches_configured_weights(data_dir):
    loader = MixtureLoader(data_dir, batch_size=8, seq_len=16, seed=3)
    take(loader, 25)
    served = sum(loader.tokens_per_source.values())
    assert served == loader.tokens_served == 25 * 8 * 16
    for name, weight in WEIGHTS.items():
        assert abs(loader.tokens_per_source[name] / served - weight) < 0.01
    custom = MixtureLoader(data_dir, batch_size=8, seq_len=16, weights={"alpha": 1, "gamma": 3})
    take(custom, 10)
    assert custom.tokens_per_source == {"alpha": 320, "gamma": 960}


def test_ranks_get_disjoint_slices_of_the_same_stream(data_dir):
    whole = MixtureLoader(data_dir, batch_size=6, seq_len=16, seed=1)
    ranks = [MixtureLoader(data_dir, batch_size=3, seq_len=16, seed=1, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(5):
        both = torch.cat([next(r)[0] for r in ranks])
        assert torch.equal(both, next(whole)[0])
        rows = [tuple(row.tolist()) for row in both]
        assert not set(rows[:3]) & set(rows[3:])
    assert ranks[0].order_digest != ranks[1].order_digest
    # with two equal sources and one row per rank, each rank still sees both sources
    pair = [MixtureLoader(data_dir, batch_size=1, seq_len=16, weights={"alpha": 1, "beta": 1},
                          rank=r, world_size=2) for r in range(2)]
    for loader in pair:
        take(loader, 12)
        assert min(loader.tokens_per_source.values()) > 0


@pytest.mark.parametrize("stop", [0, 1, 4, 9])
def test_resume_at_any_step_replays_the_same_stream(data_dir, stop):
    def make():
        return MixtureLoader(data_dir, batch_size=2, seq_len=256, seed=7, rank=1, world_size=2)

    straight = make()
    expected = take(straight, 12)
    first = make()
    take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoint-friendly plain values
    resumed = make()
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(take(resumed, 12 - stop), expected[stop:]):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert resumed.order_digest == straight.order_digest
    assert resumed.tokens_served == straight.tokens_served
    assert resumed.tokens_per_source == straight.tokens_per_source
    # the run crossed into alpha's second epoch, so resuming across a reshuffle is covered
    alpha = train_tokens(data_dir, "alpha")
    assert int(np.asarray(straight.state_dict()["sequences_drawn"])[0]) * 256 > alpha


def test_streams_wrap_into_new_epochs(data_dir):
    loader = MixtureLoader(data_dir, batch_size=4, seq_len=64, weights={"beta": 1})
    total = train_tokens(data_dir, "beta")
    steps = total // (4 * 64) + 2
    take(loader, steps)
    assert loader.tokens_served > total  # a second, reshuffled epoch was served without error


def test_state_from_other_settings_is_refused(data_dir):
    state = MixtureLoader(data_dir, batch_size=2, seq_len=16, seed=0).state_dict()
    with pytest.raises(ValueError, match="seed"):
        MixtureLoader(data_dir, batch_size=2, seq_len=16, seed=1).load_state_dict(state)


def test_validation_split_is_its_own_stream(data_dir):
    train = next(MixtureLoader(data_dir, batch_size=2, seq_len=16))[0]
    val = next(MixtureLoader(data_dir, batch_size=2, seq_len=16, split="val"))[0]
    assert not torch.equal(train, val)
    with pytest.raises(ValueError, match="unknown source"):
        MixtureLoader(data_dir, batch_size=2, seq_len=16, weights={"delta": 1})
