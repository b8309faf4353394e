"""`onenode-grade a2`: the budget audit accepts a consistent run and rejects one past its budget,
doctored logs, and a manifest that disagrees with its checkpoint; submitted data that contains
the evaluation text is caught; a cohort is graded end to end against the baseline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_eval import load_make_reference

from grader.a2 import A2
from grader.a2.audit import audit_run
from grader.a2.contamination import contamination
from grader.a2.intake import load_submission as load_a2_submission
from grader.a2.job import new_job as new_a2_job
from grader.a2.rubric import load_rubric as load_a2_rubric
from grader.cohort import grade_cohort
from grader.errors import SubmissionError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"
SMALL = {"train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.token_budget": 768, "checkpoint.every_steps": 0, "eval.every_steps": 0, "eval.batches": 1,
         "log.every_steps": 1, "log.tensorboard": False, "log.progress_bar": False}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 6-step run of the tiny recipe on synthetic data (seconds), as a submission folder."""
    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    out = tmp_path_factory.mktemp("run")
    Trainer(load_recipe(TINY, SMALL), out / "run", resume=None).fit()
    sub = out / "submission"
    sub.mkdir()
    shutil.copytree(out / "run" / "final", sub / "final")
    for name in ("recipe.yaml", "run_manifest.json", "metrics.jsonl"):
        shutil.copy2(out / "run" / name, sub / name)
    return sub


@pytest.fixture
def submission(run, tmp_path):
    copy = tmp_path / "sub"
    shutil.copytree(run, copy)
    return copy


def _failed(checks) -> set[str]:
    return {c.name for c in checks if not c.ok}


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_consistent_run_within_budget_is_verified(submission):
    checks = audit_run(load_a2_submission(submission), token_budget=768)
    assert {c.name for c in checks} >= {"budget", "logs", "checkpoint", "manifest arithmetic", "final manifest"}
    assert not _failed(checks), [c.detail for c in checks if not c.ok]


def test_run_past_the_budget_is_rejected(submission):
    assert _failed(audit_run(load_a2_submission(submission), token_budget=512)) == {"budget"}


def test_hiding_tokens_in_the_manifest_is_caught(submission):
    for path in (submission / "run_manifest.json", submission / "final" / "run_manifest.json"):
        _edit_json(path, lambda m: m.update(tokens_seen=384, steps=3))
    assert _failed(audit_run(load_a2_submission(submission), token_budget=512)) >= {"logs", "manifest arithmetic"}


def test_manifest_that_disagrees_with_its_checkpoint_is_rejected(submission, tmp_path):
    make_reference = load_make_reference()
    mismatch = make_reference.make_manifest_mismatch(submission, tmp_path / "mismatch")
    assert _failed(audit_run(load_a2_submission(mismatch), token_budget=768)) == {"checkpoint"}
    _edit_json(submission / "final" / "run_manifest.json", lambda m: m.update(data_digest="0" * 64))
    assert _failed(audit_run(load_a2_submission(submission), token_budget=768)) == {"final manifest"}


def test_incomplete_submission_is_one_line(submission):
    (submission / "metrics.jsonl").unlink()
    with pytest.raises(SubmissionError, match="metrics.jsonl is missing"):
        load_a2_submission(submission)
    shutil.rmtree(submission / "final")
    with pytest.raises(SubmissionError, match="final/config.json"):
        load_a2_submission(submission)


def test_data_containing_the_evaluation_text_is_caught(submission, tmp_path):
    from onenode.data import build

    passage = ("Now is the winter of our discontent made glorious summer by this sun of York and all the clouds "
               "that lour'd upon our house in the deep bosom of the ocean buried")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "onenode_heldout.jsonl").write_text(json.dumps({"text": passage}) + "\n")
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "clean.txt").write_text("An entirely different text about ships, sealing wax and kings. " * 5)
    (corpus / "leak.txt").write_text("Prologue. " + passage + " And more words follow here. " * 3)
    config = {"tokenizer": {"train_bpe": {"vocab_size": 300}}, "val_fraction": 0.0,
              "sources": {"notes": {"kind": "files", "paths": [str(corpus / "*.txt")]}}}
    build(config, submission / "data", log=lambda *a: None)
    shutil.copy2(submission / "data" / "tokenizer.json", submission / "final" / "tokenizer.json")
    found = contamination(load_a2_submission(submission), suite)
    assert not found.ok and found.detail.startswith("1 of 2 training documents")
    (corpus / "leak.txt").unlink()
    build(config, submission / "data", log=lambda *a: None)
    assert contamination(load_a2_submission(submission), suite).ok


@pytest.mark.slow  # trains the reference (cached) and the baseline, then five sandboxed evaluations
def test_cohort_is_graded_against_the_baseline(tmp_path):
    pytest.importorskip("lm_eval")
    make_reference = load_make_reference()
    cohort = tmp_path / "cohort"
    reference = make_reference.make_submission(cohort / "reference")
    make_reference.make_untrained(reference, cohort / "untrained")
    make_reference.make_manifest_mismatch(reference, cohort / "manifest-mismatch")
    rubric = load_a2_rubric()
    profile = rubric.profiles["cpu-tiny"]
    rubric.profiles["cpu-tiny"] = type(profile)(**{**profile.as_dict(), "limit": 20, "max_length": 128})
    job = new_a2_job(rubric, "cpu-tiny", tmp_path / "work")
    (tmp_path / "work").mkdir()
    out = tmp_path / "out"
    results = {r["extra_data"]["submission"]: r for r in grade_cohort(A2, cohort, job, out)}

    def entries(name, tag):
        return [t for t in results[name]["tests"] if tag in t["tags"]]

    assert results["reference"]["extra_data"]["numbers"]["verified"]
    assert results["untrained"]["extra_data"]["numbers"]["verified"]
    assert not results["manifest-mismatch"]["extra_data"]["numbers"]["verified"]
    assert sum(t["score"] for t in entries("manifest-mismatch", "benchmarks")) == 0  # evaluated, but earns nothing
    assert results["manifest-mismatch"]["leaderboard"]
    assert results["reference"]["score"] > results["untrained"]["score"]
    assert any(c["name"] == "contamination" and c["ok"] for c in results["reference"]["extra_data"]["audit"])
    for name in results:
        assert (out / name / "feedback.md").is_file() and (out / name / "env.json").is_file()
    assert (out / "reference" / "logs" / "metrics.jsonl").is_file()
    assert len((out / "cohort.csv").read_text().splitlines()) == 4


def test_cli_gives_an_unreadable_submission_its_zero_and_reason(tmp_path, capsys):
    from grader.cli import main

    (tmp_path / "cohort" / "empty-team").mkdir(parents=True)
    cohort, out = str(tmp_path / "cohort"), str(tmp_path / "out")
    assert main(["a2", "--cohort", cohort, "--profile", "cpu-tiny", "--out", out]) == 0
    results = json.loads((tmp_path / "out" / "empty-team" / "results.json").read_text())
    assert results["score"] == 0 and "final/config.json" in results["output"]
    assert results["extra_data"]["assignment"] == "A2"
    assert main(["a2", str(tmp_path), "--profile", "no-such", "--out", str(tmp_path / "out")]) == 2
    assert "unknown A2 profile 'no-such'" in capsys.readouterr().err
