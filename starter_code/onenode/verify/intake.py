"""An A2 submission: a run folder of `onenode train`, checked for what verifying it needs.
Nothing of it runs. Its JSON files are parsed here, once: the run manifest, the training log, the
data manifest and the checkpoints' meta.json (the chain). Every later step reads them from
`A2Submission`. `onenode verify` and the grader's intake (`grader/a2/intake.py`, which turns a
`RunFolderError` into the submission's zero) both load a run through `load_submission`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class RunFolderError(ValueError):
    """A run folder that cannot be verified, with a one-line reason that says what to do."""


@dataclass
class Link:
    """One checkpoint of the run's chain: its step_* folder and its meta.json (as submitted)."""

    path: Path
    meta: dict

    @property
    def step(self) -> int | None:
        step = self.meta.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None

    @property
    def weights(self) -> str | None:
        return self.meta.get("weights_sha256")


@dataclass
class ReplicaGroup:
    """Another replica group of a DiLoCo run (`parallel.diloco`): the folder `replica_{r}/` the
    trainer wrote for group r > 0 under the run's, with its own chain, manifest and log."""

    index: int
    root: Path
    chain: list[Link]
    manifest: dict | None  # None: no run_manifest.json
    metrics: list[dict]


@dataclass
class A2Submission:
    name: str
    root: Path
    checkpoint: Path
    recipe: Path
    manifest_path: Path
    metrics_path: Path
    notebook: Path | None
    data: Path | None
    chain: list[Link]  # the complete checkpoints (with meta.json), oldest first
    manifest: dict  # run_manifest.json
    metrics: list[dict]  # metrics.jsonl, one record a line
    data_manifest: dict | None  # data/manifest.json (None: no data folder)
    replicas: list[ReplicaGroup] = field(default_factory=list)  # every replica_*/ folder, by group (DiLoCo)


def load_submission(path: str | Path, notebook: bool = True, data: Path | None = None) -> A2Submission:
    """The run folder at `path`, refused in one line unless it holds every entry of the hand-in
    list (`onenode.handin.A2_HAND_IN`, which `onenode pack a2` checks too); report.ipynb only
    with `notebook` (a job that grades notebooks); `data`: the data folder it trained on, where
    that is not its data/ (a run folder before `onenode pack a2` copies the data in)."""
    from ..handin import a2_incomplete, a2_missing

    root = Path(path)
    if not root.is_dir():
        raise RunFolderError(f"{root} is not a folder: an A2 submission is a run folder (final/, checkpoints/, "
                              "recipe.yaml, run_manifest.json, metrics.jsonl, report.ipynb, data/)")
    links = [p for p in root.rglob("*") if p.is_symlink()]
    if links:
        raise RunFolderError(f"{links[0].relative_to(root)} is a symbolic link: copy the file itself")
    missing = [found for found in a2_missing(root, notebook) if data is None or not found.startswith("data/")]
    if missing:
        raise RunFolderError(a2_incomplete(missing))
    found = {name: root / name for name in ("recipe.yaml", "run_manifest.json", "metrics.jsonl")}
    notebook_path = root / "report.ipynb"
    if data is None and (root / "data" / "manifest.json").is_file():
        data = root / "data"
    return A2Submission(root.name, root, root / "final", found["recipe.yaml"], found["run_manifest.json"],
                        found["metrics.jsonl"], notebook_path if notebook_path.is_file() else None, data,
                        read_chain(root / "checkpoints"), read_json(found["run_manifest.json"]),
                        read_metrics(found["metrics.jsonl"]), read_json(data / "manifest.json") if data else None,
                        read_replicas(root))


def read_replicas(root: Path) -> list[ReplicaGroup]:
    """The other replica groups of a DiLoCo run: every `replica_*/` folder under `root`, by group
    number (a folder not named replica_<number> counts as group -1, which the audit refuses)."""
    groups = []
    for folder in root.glob("replica_*"):
        suffix = folder.name.removeprefix("replica_")
        manifest = folder / "run_manifest.json"
        metrics = folder / "metrics.jsonl"
        groups.append(ReplicaGroup(int(suffix) if suffix.isdigit() else -1, folder, read_chain(folder / "checkpoints"),
                                   read_json(manifest) if manifest.is_file() else None,
                                   read_metrics(metrics) if metrics.is_file() else []))
    return sorted(groups, key=lambda group: (group.index, group.root.name))


def read_chain(folder: Path) -> list[Link]:
    """The complete checkpoints under `folder` (those with meta.json), by step, oldest first."""
    links = [Link(path.parent, read_json(path)) for path in folder.glob("step_*/meta.json")] if folder.is_dir() else []
    return sorted(links, key=lambda link: (link.step is None, link.step or 0, link.path.name))


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunFolderError(f"{path.name} is not valid JSON ({e}): submit the file the trainer wrote") from None
    if not isinstance(data, dict):
        raise RunFolderError(f"{path.name} is not a JSON object")
    return data


def read_metrics(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise RunFolderError(f"metrics.jsonl has a line that is not JSON ({e})") from None
