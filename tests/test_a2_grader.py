"""`onenode-grade a2`: a run is verified only when its checkpoint chain, partly replayed on the
grader's own A2 stack, ties its weights to the recipe's initialisation, to the data submitted
and to the tokens it claims. An honest run passes (the replay's cost is printed); a run trained
past its budget with every file edited, re-initialised or swapped weights, a run continued from
a foreign checkpoint and a run trained on other data than submitted each fail with one line;
doctored logs and a manifest that disagrees with its checkpoint are caught by the audit;
evaluation text in the shards trained on is caught on every profile; a cohort is graded end to
end against the baseline."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from redteam.a2_forgeries import BUDGET, SMALL, STEPS, TINY, TOKENS_PER_STEP
from test_eval import load_make_reference

from grader.a2 import A2
from grader.a2.intake import load_submission as load_a2_submission
from grader.a2.job import new_job as new_a2_job
from grader.a2.job import train_on_stack, trained_run
from grader.a2.rubric import load_rubric as load_a2_rubric
from grader.a2.scoring import verify
from grader.cohort import grade_cohort
from grader.errors import SubmissionError
from grader.rubric import KIT_ROOT
from grader.sandbox import Limits, make_scratch, run_sandboxed
from onenode.verify.audit import audit_run, trained_shards
from onenode.verify.contamination import contamination
from onenode.verify.replay import _replayed

PASSAGE = ("Now is the winter of our discontent made glorious summer by this sun of York and all the clouds "
           "that lour'd upon our house in the deep bosom of the ocean buried")
make_reference = load_make_reference()


@pytest.fixture(scope="module")
def run() -> Path:
    """A real run of the tiny recipe on synthetic data, trained once (cached) on the A2 stack."""
    return trained_run(TINY, SMALL)


@pytest.fixture
def submission(run, tmp_path) -> Path:
    return make_reference.assemble(run, tmp_path / "sub")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A cpu-tiny grading job whose suite text is PASSAGE (the real suite's: the cohort test)."""
    job = new_a2_job(load_a2_rubric(), "cpu-tiny", tmp_path_factory.mktemp("job"), seed=0)
    job.eval_texts = [PASSAGE]
    return job


def _failed(checks) -> set[str]:
    return {c.name for c in checks if not c.ok}


def verified(job, path: Path, threads: int | None = None) -> tuple[dict, dict]:
    """Every verification check of the submission at `path` by name, and the replay's cost."""
    logs = path.with_name(f"{path.name}-logs")
    logs.mkdir(exist_ok=True)
    checks, cost = verify(job, load_a2_submission(path), logs, threads)
    assert all("\n" not in c.detail for c in checks), "every reason is one line"
    return {c.name: c for c in checks}, cost


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _metas(sub: Path) -> list[Path]:
    return sorted((sub / "checkpoints").glob("step_*/meta.json"))


# -- an honest run -------------------------------------------------------------------------------
def test_consistent_run_within_budget_is_verified(submission):
    checks = audit_run(load_a2_submission(submission), token_budget=BUDGET)
    assert {c.name for c in checks} >= {"chain", "budget", "logs", "checkpoint", "manifest arithmetic",
                                        "final manifest"}
    assert not _failed(checks), [c.detail for c in checks if not c.ok]


def test_honest_run_is_verified_by_replay_and_its_cost_measured(job, submission, capsys):
    checks, cost = verified(job, submission)
    assert all(c.ok for c in checks.values()), [c.detail for c in checks.values() if not c.ok]
    assert "bit for bit" in checks["replay"].detail
    assert "the first, the last and 1 drawn at random were replayed" in checks["replay"].detail
    first_and_last = 2 * SMALL["checkpoint.every_steps"] / STEPS
    assert 0 < cost["replay_fraction"] <= job.profile.replay_fraction + first_and_last
    with capsys.disabled():
        print(f"\nreplay cost: {cost['replay_steps']} of {STEPS} steps ({cost['replay_fraction']:.0%}) replayed in "
              f"{cost['replay_seconds']:.2f} s; the whole sandboxed verification {cost['verify_seconds']:.1f} s; "
              f"the run itself {cost['run_seconds']:.1f} s")


def test_replay_on_other_threads_passes(job, submission, capsys):
    """One CPU thread trained it, two replay it: the same training, bit for bit or within the
    tolerance (whether the bits move depends on the kernels torch picks for the thread count)."""
    checks, _ = verified(job, submission, threads=2)
    assert checks["replay"].ok, checks["replay"].detail
    with capsys.disabled():
        print(f"\nreplay on 2 threads of a 1-thread run: {checks['replay'].detail}")


def test_a_profile_that_needs_deterministic_runs_replays_only_those(job, submission, tmp_path):
    """On a GPU profile two default runs part after a few steps, so a run without
    `train.deterministic` is refused with the reason and the fix; a run with it is replayed."""
    strict = dataclasses.replace(job, profile=dataclasses.replace(job.profile, deterministic_runs=True))
    checks, cost = verified(strict, submission)
    assert not checks["replay"].ok and "train.deterministic: true" in checks["replay"].detail, checks["replay"].detail
    assert not cost
    deterministic = make_reference.assemble(trained_run(TINY, {**SMALL, "train.deterministic": True}),
                                            tmp_path / "deterministic")
    checks, _ = verified(strict, deterministic)
    assert all(c.ok for c in checks.values()), [c.detail for c in checks.values() if not c.ok]
    assert "bit for bit" in checks["replay"].detail


def test_replay_tolerance_passes_float_noise_and_fails_other_training():
    """The weights and the optimizer state a span replays to are both held to the tolerance."""
    tolerance = 1e-3
    span = {"start": "step_00000010", "end": "step_00000012", "steps": 2, "seconds": 0.1,
            "optimizer_bitwise": True, "optimizer_relative_error": 0.0}
    ok, detail = _replayed([{**span, "bitwise": False, "relative_error": 2e-5}], 20, tolerance)
    assert ok and "within the tolerance (relative error up to 2.0e-05" in detail, detail
    ok, detail = _replayed([{**span, "bitwise": True, "relative_error": 0.0}], 20, tolerance)
    assert ok and "bit for bit" in detail, detail
    ok, detail = _replayed([{**span, "bitwise": False, "relative_error": 0.3}], 20, tolerance)
    assert not ok and "step_00000010 -> step_00000012 replayed does not give step_00000012 back" in detail, detail
    moments = {**span, "bitwise": True, "relative_error": 0.0, "optimizer_bitwise": False}
    ok, detail = _replayed([{**moments, "optimizer_relative_error": 3e-5}], 20, tolerance)
    assert ok and "within the tolerance (relative error up to 3.0e-05" in detail, detail
    ok, detail = _replayed([{**moments, "optimizer_relative_error": 0.2}], 20, tolerance)
    assert not ok and detail.startswith("step_00000010 -> step_00000012 replayed does not give the optimizer state "
                                        "step_00000012 stores back (relative error 0.2"), detail


# -- the audit -----------------------------------------------------------------------------------
def test_run_past_the_budget_is_rejected(submission):
    assert _failed(audit_run(load_a2_submission(submission), token_budget=BUDGET - TOKENS_PER_STEP)) == {"budget"}


def test_hiding_tokens_in_the_manifest_is_caught(submission):
    for path in (submission / "run_manifest.json", submission / "final" / "run_manifest.json"):
        _edit_json(path, lambda m: m.update(tokens_seen=BUDGET // 2, steps=STEPS // 2))
    failed = _failed(audit_run(load_a2_submission(submission), token_budget=BUDGET // 2))
    assert failed >= {"logs", "manifest arithmetic", "budget"}  # the chain counts the tokens, not the manifest


def test_manifest_that_disagrees_with_its_checkpoint_is_rejected(submission, tmp_path):
    mismatch = make_reference.make_manifest_mismatch(submission, tmp_path / "mismatch")
    assert _failed(audit_run(load_a2_submission(mismatch), token_budget=BUDGET)) == {"checkpoint"}
    _edit_json(submission / "final" / "run_manifest.json", lambda m: m.update(data_digest="0" * 64))
    assert _failed(audit_run(load_a2_submission(submission), token_budget=BUDGET)) == {"final manifest"}
    _edit_json(submission / "run_manifest.json", lambda m: m.pop("data_tokens_served"))
    assert "manifest arithmetic" in _failed(audit_run(load_a2_submission(submission), token_budget=BUDGET))


def test_incomplete_submission_is_one_line(submission):
    (submission / "metrics.jsonl").unlink()
    with pytest.raises(SubmissionError, match="lacks metrics.jsonl: hand in the run folder"):
        load_a2_submission(submission)
    shutil.rmtree(submission / "final")
    with pytest.raises(SubmissionError, match="lacks final/config.json, metrics.jsonl: "):
        load_a2_submission(submission)



def test_a_submission_others_could_change_while_graded_is_refused_in_one_line(submission):
    """The grader reads a run several times (audit, replay, the copy it evaluates): the red team
    swapped final/ between the replay's read and the evaluation's. A file or folder of it, or a
    folder above it, that another user can write is refused; a sticky folder above (/tmp) is not."""
    target = submission / "checkpoints" / "step_00000000" / "meta.json"
    target.chmod(0o646)
    with pytest.raises(SubmissionError, match=r"meta.json is writable by other users: copy the submission into a "
                                              r"folder of the grader's own"):
        load_a2_submission(submission)
    target.chmod(0o644)
    submission.parent.chmod(0o777)
    with pytest.raises(SubmissionError, match=rf"{submission.parent} is writable by other users"):
        load_a2_submission(submission)
    submission.parent.chmod(0o1777)
    assert load_a2_submission(submission).chain
    submission.parent.chmod(0o755)


def test_a_meta_json_loader_other_than_the_checkpoints_own_fails_the_data_order(job, submission):
    """The audit finds the shards it hashes and scans by the last meta.json's loader; the red team
    dropped a contaminated source from it (the trainer state's copy, which the replay compares,
    left alone). The harness compares the two."""
    _edit_json(_metas(submission)[-1], lambda m: m["loader"].update(edited=True))
    checks, _ = verified(job, submission)
    assert not checks["data order"].ok and "meta.json names another loader state" in checks["data order"].detail
    assert checks["replay"].ok and checks["weights"].ok  # the weights are honest: only the copy lies


def test_a_span_takes_the_kernel_tiles_its_end_records(job, submission):
    """Each replayed span takes the tiles mamba_ssm's kernels chose during it, from its end
    checkpoint's `kernel_tiles` (`Trainer.take_kernel_tiles`, in the sandboxed harness); a record it
    cannot take, here one for two processes where the run had one, fails that span in one line
    whatever the weights."""
    _edit_json(_metas(submission)[-1], lambda m: m.update(kernel_tiles=[[], []]))
    checks, _ = verified(job, submission)
    assert not checks["replay"].ok and checks["weights"].ok
    assert "could not be replayed: RecipeError" in checks["replay"].detail
    assert "recorded for 2 processes, this run has 1" in checks["replay"].detail


def _claim_diloco(sub: Path) -> None:
    """The run's recipe turned to DiLoCo (two groups, a sync every checkpoint interval), each
    checkpoint's recipe hash updated to it: the chain intact, the run a DiLoCo run by its files."""
    import yaml

    from onenode.train.recipe import load_recipe

    recipe = yaml.safe_load((sub / "recipe.yaml").read_text())
    recipe["parallel"]["diloco"] = {"inner_steps": SMALL["checkpoint.every_steps"], "replicas": 2}
    (sub / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    claimed = load_recipe(sub / "recipe.yaml").training_sha256
    for meta in _metas(sub):
        _edit_json(meta, lambda m: m.update(training_sha256=claimed))


def test_a_plain_run_claimed_as_diloco_is_not_verified(job, submission):
    """A plain run's files claimed as a DiLoCo run of two groups: without replica_1/ the audit
    refuses it in one line that says what to hand in; with group 0's own folder copied in as
    replica_1/ (its manifest naming group 1) the audit's file checks pass, and the grader, reading
    each group's slice of the data and taking the outer steps, gets none of the chain back. (A
    real DiLoCo run verified, and one hiding a group: tests/test_diloco_launch.py, with torchft.)"""
    _claim_diloco(submission)
    failed = {c.name: c.detail for c in audit_run(load_a2_submission(submission), BUDGET) if not c.ok}
    assert list(failed) == ["replica groups"] and failed["replica groups"].startswith(
        "recipe.yaml trains 2 DiLoCo replica groups, so the run folder holds replica_1/"), failed
    group = submission / "replica_1"
    group.mkdir()
    for name in ("checkpoints", "metrics.jsonl", "run_manifest.json"):
        (shutil.copytree if name == "checkpoints" else shutil.copy2)(submission / name, group / name)
    _edit_json(group / "run_manifest.json", lambda m: m.update(diloco={"replica_group": 1}))
    for path in (submission / "run_manifest.json", submission / "final" / "run_manifest.json"):
        _edit_json(path, lambda m: m.update(diloco={"replica_group": 0}))
    assert "replica groups" not in _failed(audit_run(load_a2_submission(submission), BUDGET))
    checks, _ = verified(job, submission)
    assert {"data order", "logged losses", "replay"} <= _failed(checks.values()), \
        {name: check.detail for name, check in checks.items()}


def test_another_replica_group_without_a_diloco_recipe_fails_in_one_line(submission):
    """A replica_*/ folder, or a manifest naming a DiLoCo replica group, where the recipe trains one
    group: tokens of a group the budget does not count."""
    (submission / "replica_1" / "checkpoints").mkdir(parents=True)
    failed = {c.name: c.detail for c in audit_run(load_a2_submission(submission), BUDGET) if not c.ok}
    assert list(failed) == ["replica groups"] and failed["replica groups"].startswith(
        "the run holds replica_1/, but recipe.yaml trains one replica group"), failed
    shutil.rmtree(submission / "replica_1")
    for path in (submission / "run_manifest.json", submission / "final" / "run_manifest.json"):
        _edit_json(path, lambda m: m.update(diloco={"replica_group": 0}))
    failed = {c.name: c.detail for c in audit_run(load_a2_submission(submission), BUDGET) if not c.ok}
    assert list(failed) == ["replica groups"] and failed["replica groups"].startswith(
        "run_manifest.json names DiLoCo {'replica_group': 0}, but recipe.yaml trains one replica group"), failed
    assert all("\n" not in detail for detail in failed.values())


# -- forgeries (more in tests/test_a2_verification.py) -------------------------------------------
def test_reinitialised_or_swapped_weights_fail(job, submission, tmp_path):
    untrained = make_reference.make_untrained(submission, tmp_path / "untrained")
    checks, _ = verified(job, untrained)
    assert _failed(checks.values()) == {"final weights"}, checks["final weights"].detail
    assert "does NOT hold the weights of the chain's last checkpoint" in checks["final weights"].detail
    last, before = sorted((submission / "checkpoints").glob("step_*"))[-1:-3:-1]
    for name in [".metadata", *(p.name for p in before.glob("*.distcp"))]:  # last checkpoint's weights swapped
        shutil.copy2(before / name, last / name)
    checks, _ = verified(job, submission)
    assert not checks["weights"].ok and checks["weights"].detail.startswith(f"{last.name}/meta.json records weights")


def test_run_continued_from_a_foreign_checkpoint_fails(job, tmp_path):
    """Another run (seed 1) to half the budget, then this recipe resumed from it to the end."""
    continued = tmp_path / "continued"
    shutil.copytree(trained_run(TINY, {**SMALL, "seed": 1, "train.token_budget": BUDGET // 2}), continued)
    train_on_stack(TINY, continued, SMALL)
    sub = make_reference.assemble(continued, tmp_path / "sub")
    chain = next(c for c in audit_run(load_a2_submission(sub), token_budget=BUDGET) if c.name == "chain")
    assert not chain.ok and "trained with another recipe" in chain.detail
    from onenode.train.recipe import load_recipe

    ours = load_recipe(sub / "recipe.yaml").training_sha256
    for meta_path in _metas(sub):  # the foreign checkpoints made to claim this recipe
        _edit_json(meta_path, lambda m: m.update(training_sha256=ours))
    checks, _ = verified(job, sub)
    assert checks["chain"].ok and not checks["initialisation"].ok
    assert "is NOT the recipe's seeded initialisation" in checks["initialisation"].detail
    for early in sorted((sub / "checkpoints").glob("step_*"))[:STEPS // 4 + 1]:  # only this run's checkpoints
        shutil.rmtree(early)
    assert "the chain starts at step_00000012" in next(
        c.detail for c in audit_run(load_a2_submission(sub), token_budget=BUDGET) if c.name == "chain")


def _build_data(folder: Path, docs: dict[str, str], tokenizer: str | dict) -> Path:
    from onenode.data import build

    corpus = folder.with_name(f"{folder.name}-text")
    corpus.mkdir()
    for name, text in docs.items():
        (corpus / name).write_text(text)
    config = {"tokenizer": tokenizer, "val_fraction": 0.0,
              "sources": {"notes": {"kind": "files", "paths": [str(corpus / "*.txt")]}}}
    build(config, folder, log=lambda *a: None)
    return folder


CLEAN = "An entirely different text about ships, sealing wax and kings, and why the sea is boiling hot. " * 5


def _trained_on(data: Path) -> Path:
    return trained_run(TINY, {**SMALL, "data.source": "shards", "data.path": str(data)})


def test_run_trained_on_other_data_than_submitted_fails(job, tmp_path):
    data = _build_data(tmp_path / "data", {"clean.txt": CLEAN}, {"train_bpe": {"vocab_size": 300}})
    other = _build_data(tmp_path / "other", {"clean.txt": CLEAN.upper()}, str(data / "tokenizer.json"))
    shutil.copy2(data / "tokenizer.json", other / "tokenizer.json")
    sub = make_reference.assemble(_trained_on(data), tmp_path / "sub")
    shutil.rmtree(sub / "data")
    shutil.copytree(other, sub / "data")
    _, found = trained_shards(load_a2_submission(sub))
    assert not found.ok and "it trained on other data than submitted" in found.detail
    shard = json.loads((other / "manifest.json").read_text())["sources"]["notes"]["splits"]["train"]["sha256"]
    for meta_path in _metas(sub):  # the checkpoints made to name the submitted shards
        _edit_json(meta_path, lambda m: m["loader"]["settings"]["shards"].update(notes=shard))
    checks, _ = verified(job, sub)
    assert checks["data"].ok and not checks["data order"].ok
    assert "settings.shards" in checks["data order"].detail


def test_evaluation_text_in_the_trained_shards_is_caught_on_every_profile(tmp_path):
    data = _build_data(tmp_path / "data", {"clean.txt": CLEAN, "leak.txt": "Prologue. " + PASSAGE + " And more. " * 3},
                       {"train_bpe": {"vocab_size": 300}})
    sub = make_reference.assemble(_trained_on(data), tmp_path / "sub")
    for profile in ("cpu-tiny", "h100x8"):
        job = new_a2_job(load_a2_rubric(), profile, tmp_path / profile, seed=0)
        job.eval_texts = [PASSAGE]
        checks, _ = verified(job, sub)
        assert not checks["contamination"].ok, profile
        assert checks["contamination"].detail.startswith("1 of 2 training documents share 13 words")
    loaded = load_a2_submission(sub)
    assert contamination(loaded, {"notes": sub / "data" / "notes" / "train.bin"}, [CLEAN.upper()]).ok


HEADING = ("SCENE I. Padua. A room in BAPTISTA'S house, where the suitors wait with their servants, and "
           "enter Katharina and Bianca with musicians")


def _data_said_to_be_built_from_the_corpus(data: Path) -> SimpleNamespace:
    """`data` as contamination() reads it, its manifest naming the kit corpus's shakespeare as its source."""
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["sources"] = {"shakespeare": {"spec": {"kind": "corpus", "part": "shakespeare"}}}
    return SimpleNamespace(data=data, data_manifest=manifest)


def test_what_the_kit_corpus_repeats_outside_its_held_out_documents_is_not_contamination(tmp_path, monkeypatch):
    """A heading that the corpus's training side holds (in another scene) and the suite repeats is
    every honest build's: not counted for a data folder built from that part; a passage the corpus
    does not hold outside its held-out documents still is, and without the part nothing is exempt."""
    from onenode.data import corpus
    from onenode.data.build import is_validation

    scene = HEADING + ". Enter Petruchio, and the rest of the scene goes on in words of its own."
    assert not is_validation(scene, 0.01)  # the corpus's training side
    part = tmp_path / "shakespeare.jsonl"
    part.write_text(json.dumps({"title": "The Taming of the Shrew", "text": scene}) + "\n")
    monkeypatch.setattr(corpus, "corpus_part", lambda name: part)
    data = _build_data(tmp_path / "data", {"scene.txt": scene + " " + CLEAN, "leak.txt": CLEAN + PASSAGE},
                       {"train_bpe": {"vocab_size": 300}})
    shards = {"notes": data / "notes" / "train.bin"}
    eval_texts = [HEADING + ". " + PASSAGE]

    check = contamination(_data_said_to_be_built_from_the_corpus(data), shards, eval_texts)
    assert not check.ok and check.detail.startswith("1 of 2 training documents"), check.detail  # the leak alone
    assert "the kit corpus's shakespeare hold outside the suite's held-out documents not counted" in check.detail
    check = contamination(_data_said_to_be_built_from_the_corpus(data), shards, [HEADING + " and more words"])
    assert check.ok, check.detail
    files_only = SimpleNamespace(data=data, data_manifest=json.loads((data / "manifest.json").read_text()))
    assert contamination(files_only, shards, eval_texts).detail.startswith("2 of 2 training documents")


def test_runs_of_whitespace_are_not_contamination(tmp_path):
    """Indentation that a training document and the suite share is not evaluation text; the same
    run with words in it is."""
    indented = "A poem, set as poems are:" + " " * 80 + "and its last line."
    data = _build_data(tmp_path / "data", {"indented.txt": CLEAN + indented}, {"train_bpe": {"vocab_size": 300}})
    sub = SimpleNamespace(data=data, data_manifest=json.loads((data / "manifest.json").read_text()))
    shards = {"notes": data / "notes" / "train.bin"}
    assert contamination(sub, shards, ["Other words entirely." + " " * 80 + "Still others."]).ok
    assert not contamination(sub, shards, [CLEAN[:200]]).ok


def test_a_checkpoint_naming_the_gpt2_bpe_finds_it_in_the_offline_evaluation_sandbox():
    """The evaluation's sandbox has no network: the GPT-2 BPE a checkpoint names (what every run
    on the default data carries) is staged from the grader's cache into the sandbox's own, where
    the kit's loader finds it, its sha256 the grader's."""
    from grader.a2.evaluation import _stage_named_tokenizer
    from onenode.data.tokenizer import load_tokenizer

    scratch = make_scratch()
    try:
        shutil.copytree(KIT_ROOT / "starter_code", scratch / "starter_code",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (scratch / "checkpoint").mkdir()
        (scratch / "checkpoint" / "onenode_tokenizer.json").write_text(json.dumps({"spec": "gpt2"}))
        cache = _stage_named_tokenizer(scratch / "checkpoint", scratch / ".cache" / "onenode")
        code = ("from onenode.eval.model import checkpoint_tokenizer; "
                "print(checkpoint_tokenizer('checkpoint').content_hash())")
        result = run_sandboxed([sys.executable, "-c", code], cwd=scratch, env={"ONENODE_CACHE": str(cache)},
                               limits=Limits(wall_s=120, cpu_s=120, memory_mb=None))
        assert result.ok, result.stderr.decode()[-1500:]
        assert result.stdout.decode().strip() == load_tokenizer("gpt2").content_hash()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_grader_without_the_named_tokenizer_says_how_to_get_it(tmp_path, monkeypatch):
    """Offline, and without the GPT-2 BPE in its cache, the grader fails the evaluation in one line
    that says what to run, before anything starts in the sandbox."""
    from grader.a2.evaluation import evaluate_sandboxed
    from onenode.data import tokenizer
    from onenode.data.corpus import FetchError

    def offline():
        raise FetchError("pip could not download openai-whisper==20250625 from PyPI")

    monkeypatch.setattr(tokenizer, "gpt2_ranks_file", offline)
    checkpoint = tmp_path / "final"
    checkpoint.mkdir()
    (checkpoint / "onenode_tokenizer.json").write_text(json.dumps({"spec": "gpt2"}))
    report, error = evaluate_sandboxed(checkpoint, load_a2_rubric().profile("cpu-tiny"), None, tmp_path, "x")
    assert report is None and "\n" not in error
    assert error.startswith("the grader has no copy of the tokenizer") and "`onenode data fetch`" in error


def _chain(steps: list[int], device: str = "cpu") -> list:
    from onenode.verify.intake import Link

    layout = {"device": device, "world_size": 1, "threads": 1}
    return [Link(Path(f"step_{s:08d}"), {"step": s, "layout": layout}) for s in steps]


def test_a_chain_of_uneven_intervals_is_not_replayed(job):
    """A long span among short ones (drawn within a budget less often than its steps say: where
    forged steps hide) and a short one among long ones are refused in one line naming the span;
    one interval with a shorter last span is replayed."""
    from types import SimpleNamespace

    from onenode.verify.replay import replay_plan

    profile = dataclasses.replace(job.profile, replay_fraction=0.1)
    long_among_short = [*range(0, 46), *range(55, 101)]  # 1-step spans, one of 10 steps in the middle
    spans, problem = replay_plan(SimpleNamespace(chain=_chain(long_among_short)), profile, "seed", 100)
    assert spans == [] and "\n" not in problem, problem
    assert problem.startswith("step_00000045 -> step_00000055 is 10 steps, where the chain's first span is 1: the "
                              "grader replays only runs checkpointed at one interval"), problem
    short_among_long = [*range(0, 50, 10), 41, *range(50, 101, 10)]
    _, problem = replay_plan(SimpleNamespace(chain=_chain(sorted(short_among_long))), profile, "seed", 100)
    assert problem.startswith("step_00000040 -> step_00000041 is 1 steps"), problem
    spans, problem = replay_plan(SimpleNamespace(chain=_chain([*range(0, 110, 10), 107])), profile, "seed", 100)
    assert problem is None and (0, 1) in spans and (10, 11) in spans, problem


def test_each_middle_span_is_drawn_as_often_as_the_detection_figures_say():
    """Spans of one interval, the first and the last always, the others drawn uniformly within the
    budget: how often a forged set of middle spans is drawn is `detection_probability` of the
    run's own spans and draws, which the feedback states."""
    from onenode.verify.replay import choose_spans, detection_line, detection_probability

    chain = _chain(list(range(0, 101, 5)))  # 20 spans of 5 steps: 18 in the middle
    draws = [choose_spans(chain, 15, f"seed-{i}") for i in range(3000)]  # 3 random spans a run
    assert all({(0, 1), (19, 20)} <= set(spans) and len(spans) == 5 for spans in draws)
    assert draws[0] == choose_spans(chain, 15, "seed-0") != draws[1]
    counts = [sum((i, i + 1) in spans for spans in draws) for i in range(1, 19)]
    assert all(abs(count - 500) < 80 for count in counts), counts  # each in 3 of 18: 500 of 3000, sd 20
    for forged in ([(9, 10)], [(3, 4), (12, 13)], [(i, i + 1) for i in range(2, 7)]):
        caught = sum(any(span in spans for span in forged) for spans in draws) / len(draws)
        assert caught == pytest.approx(detection_probability(20, 3, len(forged)), abs=0.03), (forged, caught)
    assert "of its 20 spans (every 5 steps) the first, the last and 3 drawn at random were replayed" in \
        detection_line(chain, draws[0])


def test_the_node_time_for_a_replay_bounds_its_plan(job):
    """With `replay_minutes` at `replay_tokens_per_s`, the first and last spans must fit the time
    (else the run is refused with the interval that would), and the random spans get what they leave."""
    from types import SimpleNamespace

    from onenode.verify.intake import Link
    from onenode.verify.replay import replay_plan

    layout = {"device": "cpu", "world_size": 1, "threads": 1}
    chain = [Link(Path(f"step_{s:08d}"), {"step": s, "layout": layout}) for s in range(0, 1001, 10)]  # 100 spans
    sub = SimpleNamespace(chain=chain)
    timed = dataclasses.replace(job.profile, replay_fraction=0.1, replay_minutes=1.0, replay_tokens_per_s=100.0)
    spans, problem = replay_plan(sub, timed, "seed", tokens_per_step=100)  # 60 steps in the time: 20 + 40 random
    assert problem is None and len(spans) == 2 + 4, spans
    spans, problem = replay_plan(sub, dataclasses.replace(timed, replay_minutes=0.25), "seed", tokens_per_step=100)
    assert spans == [] and "first and last spans (20 steps)" in problem and "every 7 steps" in problem, problem
    spans, _ = replay_plan(sub, dataclasses.replace(timed, replay_minutes=None, replay_tokens_per_s=None), "seed",
                           tokens_per_step=100)
    assert len(spans) == 2 + 10  # replay_fraction alone: 100 random steps
    with pytest.raises(ValueError, match="together"):
        dataclasses.replace(timed, replay_tokens_per_s=None)


def test_detection_probability_is_the_chance_a_forged_middle_span_is_drawn():
    from onenode.verify.replay import detection_line, detection_probability

    assert detection_probability(12, 1, 1) == pytest.approx(0.1)  # 1 of the 10 middle spans drawn
    assert detection_probability(12, 2, 1) == pytest.approx(0.2)
    assert detection_probability(12, 2, 2) == pytest.approx(1 - 28 / 45)  # 1 - C(8,2)/C(10,2)
    assert detection_probability(12, 1, 11) == 1.0 and detection_probability(12, 3, 0) == 0.0
    chain = _chain(list(range(0, 121, 10)))
    assert detection_line(chain, [(0, 1), (5, 6), (11, 12)]) == (
        "of its 12 spans (every 10 steps) the first, the last and 1 drawn at random were replayed: a forgery inside "
        "the movement bound and the recorded losses is caught 10% if it forged one span, 20% if it forged 10% of "
        "them, 30% if it forged 25% of them")


def test_the_rubrics_detection_figures_are_the_course_baselines_plan():
    """a2_pretrain/rubric.toml's h100x8 comment quotes the odds for the baseline's 19,073 steps
    checkpointed every 100 (and every 50): they are what the grader's plan for those spans gives."""
    from types import SimpleNamespace

    from onenode.verify.replay import detection_line, replay_plan

    profile = load_a2_rubric().profile("h100x8")
    for every, odds in ((100, "1% if it forged one span, 11% if it forged 10% of them, 25% if it forged 25%"),
                        (50, "1% if it forged one span, 35% if it forged 10% of them, 69% if it forged 25%")):
        chain = _chain([*range(0, 19073, every), 19073], device="cuda")
        spans, problem = replay_plan(SimpleNamespace(chain=chain), profile, "seed", tokens_per_step=1_048_576)
        assert problem is None, problem
        assert odds in detection_line(chain, spans), detection_line(chain, spans)


# -- scores above the noise ----------------------------------------------------------------------
def _report(accuracy: float, perplexity: float, accuracy_error: float = 0.05, perplexity_error: float = 2.0) -> dict:
    return {"suite": "offline", "headline": {
        "onenode_cloze": {"metric": "acc_norm", "value": accuracy, "stderr": accuracy_error, "higher_is_better": True},
        "onenode_heldout": {"metric": "word_perplexity", "value": perplexity, "stderr": perplexity_error,
                            "higher_is_better": False}}}


def test_a_difference_inside_two_standard_errors_cannot_move_the_points(job):
    from grader.a2.scoring import score
    from onenode.verify.audit import Check

    job._baseline = _report(0.50, 100.0)

    def points(report):
        graded = score(job, [Check("audit", True, "verified")], report, None)
        return {t["tags"][0]: t["score"] for t in graded.tests if t["tags"][0] != "budget"}, graded
    # two standard errors of the difference: 2 x hypot(0.05, 0.05) = 0.141 accuracy, about 6% perplexity
    par, graded = points(_report(0.50, 100.0))
    assert "0.5 ± 0.05 vs baseline 0.5 ± 0.05" in graded.tests[1]["output"]
    assert graded.extra_data["stderr"]["onenode_cloze acc_norm"] == 0.05
    for inside in (_report(0.63, 97.0), _report(0.37, 103.0), _report(0.5, 100.0, 0.0, 0.0)):
        assert points(inside)[0] == par
    better, worse = points(_report(0.65, 94.0))[0], points(_report(0.35, 106.5))[0]
    assert all(better[k] > par[k] > worse[k] for k in par), (better, par, worse)


# -- a cohort ------------------------------------------------------------------------------------
@pytest.mark.slow  # trains the reference (cached) and the baseline, then five sandboxed evaluations
def test_cohort_is_graded_against_the_baseline(tmp_path):
    pytest.importorskip("lm_eval")
    cohort = tmp_path / "cohort"
    reference = make_reference.make_submission(cohort / "reference")
    make_reference.make_untrained(reference, cohort / "untrained")
    rubric = load_a2_rubric()
    profile = rubric.profiles["cpu-tiny"]
    rubric.profiles["cpu-tiny"] = type(profile)(**{**profile.as_dict(), "limit": 20, "max_length": 128})
    job = new_a2_job(rubric, "cpu-tiny", tmp_path / "work", notebooks=False)  # the notebook has its own tests
    (tmp_path / "work").mkdir()
    out = tmp_path / "out"
    results = {r["extra_data"]["submission"]: r for r in grade_cohort(A2, cohort, job, out)}

    def entries(name, tag):
        return [t for t in results[name]["tests"] if tag in t["tags"]]

    assert results["reference"]["extra_data"]["numbers"]["verified"]
    assert not results["untrained"]["extra_data"]["numbers"]["verified"]  # final/ is not the chain's end
    assert sum(t["score"] for t in entries("untrained", "benchmarks")) == 0  # evaluated, but earns nothing
    assert results["untrained"]["leaderboard"]
    assert results["reference"]["score"] > results["untrained"]["score"]
    audit = {c["name"]: c for c in results["reference"]["extra_data"]["audit"]}
    assert audit["contamination"]["ok"] and audit["replay"]["ok"], audit
    first_and_last = 2 * 4 / 48  # the reference checkpoints every 4 of its 48 steps
    replayed = results["reference"]["extra_data"]["numbers"]["replay_fraction"]
    assert 0 < replayed <= profile.replay_fraction + first_and_last
    for name in results:
        assert (out / name / "feedback.md").is_file() and (out / name / "env.json").is_file()
    assert (out / "reference" / "logs" / "metrics.jsonl").is_file()
    assert len((out / "cohort.csv").read_text().splitlines()) == 3


def test_grading_without_lm_eval_stops_before_any_run_with_what_to_install(tmp_path, monkeypatch, capsys):
    import importlib.util

    from grader.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    for extra in ([], ["--verify-only"]):
        assert main(["a2", str(tmp_path / "never-read"), "--profile", "cpu-tiny", "--out", str(tmp_path / "out"),
                     *extra]) == 3  # grading stopped: the machine cannot grade
        error = capsys.readouterr().err
        assert "needs lm-eval" in error and "pip install -e '.[eval]'" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_verify_only_checks_a_run_without_evaluating_it(submission, tmp_path):
    """What a group runs on a short run of its recipe before the long one: every verification
    check, no evaluation, no baseline."""
    from grader.cli import main

    out = tmp_path / "out"
    assert main(["a2", str(submission), "--profile", "cpu-tiny", "--out", str(out), "--verify-only",
                 "--no-notebook", "--seed", "0"]) == 0
    results = json.loads(next(out.glob("*/results.json")).read_text())
    assert results["extra_data"]["numbers"]["verified"] is True
    budget, *others = sorted(results["tests"], key=lambda t: t["tags"] != ["budget"])
    assert budget["score"] == budget["max_score"] > 0 and "replay: ok" in budget["output"]
    assert others and all(t["score"] == 0 and "--verify-only" in t["output"] for t in others)
    assert not list(out.rglob("eval-report.json"))  # an evaluation leaves its report beside the results


def test_cli_gives_an_unreadable_submission_its_zero_and_reason(tmp_path, capsys):
    from grader.cli import main

    (tmp_path / "cohort" / "empty-team").mkdir(parents=True)
    cohort, out = str(tmp_path / "cohort"), str(tmp_path / "out")
    assert main(["a2", "--cohort", cohort, "--profile", "cpu-tiny", "--out", out]) == 1  # not graded
    results = json.loads((tmp_path / "out" / "empty-team" / "results.json").read_text())
    assert results["score"] == 0 and "final/config.json" in results["output"]
    assert f"empty-team: {results['extra_data']['not_graded']}" in " ".join(capsys.readouterr().out.split())
    assert results["extra_data"]["assignment"] == "A2"
    assert main(["a2", str(tmp_path), "--profile", "no-such", "--out", str(tmp_path / "out")]) == 2
    assert "unknown A2 profile 'no-such'" in capsys.readouterr().err
