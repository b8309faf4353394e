"""Resumable training state with `torch.distributed.checkpoint` (DCP), and the final export.

One checkpoint is a folder `step_00000100/`:
- the DCP files: model and optimizer state, each rank writing its own shards (FSDP2 DTensors are
  saved sharded and can be loaded into another layout);
- `trainer_state_rank{r}.pt`: what is per rank and not a tensor of the model: the step, the tokens
  seen, the data loader's position and digest, the RNG states;
- `meta.json`, written last by rank 0: its presence marks the checkpoint complete.
DCP also runs in a single process without a process group. The final model leaves the run in the
transformers layout (`model.save_pretrained`), with `run_manifest.json` beside it.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..parallel import ParallelModel
from .optim import optimizers_of

META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or unreadable; one line says what to do."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call that runs without a process group, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _stateful(parallel: ParallelModel) -> torch.nn.Module:
    """What DCP saves: the model, or this rank's pipeline stages as one module list (so a
    pipeline run resumes with the same layout)."""
    return parallel.model if parallel.pipeline is None else torch.nn.ModuleList(parallel.stage_modules)


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}"


def save_checkpoint(folder: str | Path, step: int, parallel: ParallelModel, optimizer, trainer_state: dict, meta: dict,
                    keep_last: int = 2) -> Path:
    """Write the checkpoint of `step` (collective: every rank calls it) and prune old ones."""
    path = step_dir(Path(folder), step)
    model_sd, optim_sd = get_state_dict(_stateful(parallel), optimizers_of(optimizer))
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=_world() == 1)
    torch.save(trainer_state, path / f"trainer_state_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (path / META).write_text(json.dumps({**meta, "step": step, "world_size": _world()}, indent=2) + "\n")
        for old in complete_checkpoints(folder)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def complete_checkpoints(folder: str | Path) -> list[Path]:
    """Complete checkpoints under `folder`, oldest first."""
    folder = Path(folder)
    return sorted(p.parent for p in folder.glob(f"step_*/{META}")) if folder.is_dir() else []


def latest_checkpoint(folder: str | Path) -> Path | None:
    found = complete_checkpoints(folder)
    return found[-1] if found else None


def load_checkpoint(path: str | Path, parallel: ParallelModel, optimizer) -> tuple[dict, dict]:
    """Load model and optimizer in place; return (meta, this rank's trainer state)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist: point --resume at a step_* folder or a run folder")
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {META}; the run died while saving): "
                              "delete it and resume from the one before")
    try:
        meta = json.loads((path / META).read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint {path}: {META} is corrupt; delete the folder and resume from an "
                              "earlier one") from None
    if meta.get("world_size", 1) != _world():
        raise CheckpointError(f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has "
                              f"{_world()}: resume with the same number of processes")
    state_file = path / f"trainer_state_rank{_rank()}.pt"
    optimizers, module = optimizers_of(optimizer), _stateful(parallel)
    model_sd, optim_sd = get_state_dict(module, optimizers)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=_world() == 1)
        trainer_state = torch.load(state_file, weights_only=False)
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        message = " ".join(str(e).split())[:200]
        raise CheckpointError(f"checkpoint {path} is corrupt ({type(e).__name__}: {message}): "
                              "delete it and resume from an earlier one") from None
    set_state_dict(module, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta, trainer_state


def full_model_state_dict(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, unsharded, on CPU (collective; the result is complete on rank 0)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def export_final(parallel: ParallelModel, config, folder: str | Path, manifest: dict) -> Path | None:
    """The final model in the transformers layout plus the run manifest (collective).

    Rank 0 loads the full state into a fresh unsharded model and saves it with
    `save_pretrained`. Pipeline runs (whose stages live on different ranks)
    write only the manifest, which says so: the kit exports models trained with pp = 1.
    """
    from ..model import build_model

    folder = Path(folder)
    pipeline = parallel.pipeline is not None
    state = None if pipeline else full_model_state_dict(parallel.model)
    if _rank() != 0:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    if pipeline:
        manifest = {**manifest, "export": "skipped: a pipeline run's stages live on different ranks"}
    else:
        plain = build_model(config, device="meta")
        plain.to_empty(device="cpu")
        plain.tie_weights()
        plain.load_state_dict(state)
        plain.save_pretrained(folder)
    write_json(folder / "run_manifest.json", manifest)
    return folder


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
