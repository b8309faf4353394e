"""`onenode eval`: the offline suite is well formed and held out, tells a trained tiny model from
an untrained one, and the lm-eval model and the transformers export give the same numbers."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest

from onenode.data.build import is_validation
from onenode.eval.suite import HELDOUT_FRACTION, OFFLINE_TASKS, build_offline_suite, heldout_documents

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 20  # items per task: enough to separate trained from untrained, small enough for CPU


def load_make_reference():
    spec = importlib.util.spec_from_file_location("make_reference", ROOT / "solutions" / "a2" / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs():
    return heldout_documents()


@pytest.fixture(scope="module")
def suite(docs, tmp_path_factory):
    return build_offline_suite(tmp_path_factory.mktemp("suite"), docs, items=LIMIT)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The reference run (trained once, cached) and the same run with untrained weights."""
    make_reference = load_make_reference()
    from grader.a2.job import trained_run

    root = tmp_path_factory.mktemp("runs")
    trained = root / "trained"
    shutil.copytree(trained_run(make_reference.RECIPE), trained)
    untrained = make_reference.make_untrained(trained, root / "untrained")
    return trained / "final", untrained / "final"


def _records(suite: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (suite / f"{task}.jsonl").read_text().splitlines()]


def test_offline_suite_items_are_well_formed_and_held_out(suite, docs):
    assert all((suite / f"{t}.yaml").is_file() for t in OFFLINE_TASKS)
    assert all(is_validation(d, HELDOUT_FRACTION) for d in docs)  # any build with val_fraction >= 0.01 holds them out
    text = "\n".join(" ".join(line.split()) for d in docs for line in d.splitlines())
    cloze = _records(suite, "onenode_cloze")
    assert len(cloze) == LIMIT
    for item in cloze:
        assert len(item["choices"]) == len(set(item["choices"])) == 4
        assert all(line in text for line in item["context"].splitlines() + item["choices"])
    for item in _records(suite, "onenode_order"):
        real, other = item["choices"][item["label"]], item["choices"][1 - item["label"]]
        assert real in text and real != other and Counter(real.split()) == Counter(other.split())
    passages = _records(suite, "onenode_heldout")
    assert passages and all(p["text"] in "\n".join(docs) for p in passages)


def test_suite_is_deterministic(suite, docs, tmp_path):
    again = build_offline_suite(tmp_path, docs, items=LIMIT)
    for task in OFFLINE_TASKS:
        assert (again / f"{task}.jsonl").read_bytes() == (suite / f"{task}.jsonl").read_bytes()


def _onenode_eval(*argv: str) -> int:
    from onenode.eval.cli import register

    parser = argparse.ArgumentParser(prog="onenode")
    register(parser.add_subparsers())
    args = parser.parse_args(["eval", *argv])
    return args.func(args)


def test_bad_checkpoint_or_missing_tokenizer_is_one_line(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    assert _onenode_eval(str(tmp_path / "nowhere")) == 2
    assert "no config.json" in capsys.readouterr().err
    from onenode.data.tokenizer import TokenizerError
    from onenode.eval.model import checkpoint_tokenizer

    with pytest.raises(TokenizerError, match="carries no tokenizer"):
        checkpoint_tokenizer(tmp_path)


def test_perplexity_standard_error_is_the_documents_spread():
    """lm-eval gives no standard error for perplexity: with documents of equal length, the kit's
    is the standard error of the mean of their per-token rates (then through the metric)."""
    import statistics

    from onenode.eval.run import _perplexity_stderr

    rates = [1.0, 1.5, 0.5, 1.2, 0.8]
    samples = [{"bits_per_byte": (-r * 100, 100), "word_perplexity": (-r * 100, 100)} for r in rates]
    expected = statistics.stdev(rates) / math.sqrt(len(rates))
    assert math.isclose(_perplexity_stderr(samples, "bits_per_byte"), expected / math.log(2))
    assert math.isclose(_perplexity_stderr(samples, "word_perplexity"), math.exp(1.0) * math.sinh(expected))
    assert _perplexity_stderr(samples[:1], "bits_per_byte") is None


@pytest.mark.slow  # trains the reference run once (cached), then three lm-eval passes
def test_trained_beats_untrained_and_routes_agree(checkpoints, suite, tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")  # lm-eval's HFLM imports it
    from onenode.eval import evaluate

    trained, untrained = checkpoints
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("\n\n".join(p["text"] for p in _records(suite, "onenode_heldout")))
    common = dict(tasks_dir=suite, limit=LIMIT, max_length=128, batch_size=32, val_text=heldout, val_seq_len=64)
    ours = evaluate(trained, **common)
    fresh = evaluate(untrained, **common)
    assert ours["tasks"]["onenode_order"]["acc"] > fresh["tasks"]["onenode_order"]["acc"]
    assert ours["tasks"]["onenode_heldout"]["bits_per_byte"] < fresh["tasks"]["onenode_heldout"]["bits_per_byte"]
    assert ours["heldout"]["loss"] < fresh["heldout"]["loss"]
    assert math.isclose(ours["heldout"]["perplexity"], math.exp(ours["heldout"]["loss"]))
    assert all(entry["stderr"] > 0 for entry in ours["headline"].values())  # every figure with its error

    hf = evaluate(trained, route="hf", **common)
    for task, metrics in ours["tasks"].items():
        for metric, value in metrics.items():
            if metric.startswith("acc"):
                assert hf["tasks"][task][metric] == value, (task, metric)
            else:
                assert math.isclose(hf["tasks"][task][metric], value, rel_tol=1e-3), (task, metric)
    assert math.isclose(hf["heldout"]["loss"], ours["heldout"]["loss"], rel_tol=1e-4)


@pytest.mark.slow  # needs the reference run (trained once, cached)
def test_validation_split_loss_separates_trained_from_untrained(checkpoints):
    from onenode import load_pretrained
    from onenode.eval.heldout import heldout_loss, val_split_tokens
    from onenode.eval.model import recipe_data_dir
    from onenode.train.recipe import load_recipe

    data = recipe_data_dir(load_recipe(load_make_reference().RECIPE), ROOT)  # built by the fixture's run
    tokens = val_split_tokens(data)
    losses = [heldout_loss(load_pretrained(c), tokens, seq_len=64, max_tokens=4096)["loss"] for c in checkpoints]
    assert losses[0] < losses[1] - 0.5  # a trained model beats a uniform guess (ln 512 = 6.24) by far
