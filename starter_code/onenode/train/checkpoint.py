"""Resumable training state with `torch.distributed.checkpoint` (DCP), and the final export.

One checkpoint is a folder `step_00000100/`:
- the DCP files: model and optimizer state, each rank writing its own shards (FSDP2 DTensors are
  saved sharded and can be loaded into another layout);
- `trainer_state_rank{r}.pt`: what is per rank and not a tensor of the model: the step, the tokens
  seen, the data loader's position and digest, the RNG states;
- `meta.json`, written last by rank 0: its presence marks the checkpoint complete. The trainer
  puts there what a replay of the span up to the next checkpoint needs besides the files (seed,
  layout, versions, data position, the tiles mamba_ssm's tuned kernels chose, `kernel_tiles`) and
  the chain: the hash of this checkpoint's weights
  (`weights_sha256`) and the step and weights hash of the checkpoint before it.
DCP also runs in a single process without a process group. The final model leaves the run in the
transformers layout (`model.save_pretrained`), with `run_manifest.json` beside it.

Loading never runs code from the files: DCP's metadata is unpickled with an allow-list of the
classes DCP writes, and every other pickle (trainer state, DCP's non-tensor values) through
`torch.load(weights_only=True)`. A checkpoint is input the grader replays, so it must not be
able to take over the process that reads it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import pathlib
import pickle
import random
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
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


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's tensors (name, dtype, shape and bytes, names sorted): the
    checkpoint chain's record of a model, which the grader's replay recomputes the same way."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


# What DCP's .metadata pickle may name: its own metadata classes, and the torch and pathlib values
# they hold. Anything else in that file was not written by DCP.
_DCP_METADATA_GLOBALS = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        value = _DCP_METADATA_GLOBALS.get((module, name))
        if value is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            value = getattr(torch, name)
        if value is None:
            raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which DCP never writes")
        return value


class _SafeReader(dcp_filesystem.FileSystemReader):
    """DCP's file reader, with the metadata unpickled through the allow-list."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's planner, whose non-tensor values (optimizer settings) must unpickle as plain data."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # raises on anything but plain values and tensors
        value.seek(0)
        super().load_bytes(read_item, value)


def _dcp_load(state: dict, path: Path) -> None:
    with _single_process_quiet():
        dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafePlanner(), no_dist=_world() == 1)


def _stateful(parallel: ParallelModel) -> torch.nn.Module:
    """What DCP saves: the model, or this rank's pipeline stages as one module list (so a
    pipeline run resumes with the same layout)."""
    return parallel.model if parallel.pipeline is None else torch.nn.ModuleList(parallel.stage_modules)


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}"


def save_checkpoint(folder: str | Path, step: int, parallel: ParallelModel, optimizer, trainer_state: dict, meta: dict,
                    keep_last: int = 0) -> Path:
    """Write the checkpoint of `step` (collective: every rank calls it); with `keep_last`, delete
    all but that many (0 keeps every one: the chain the grader replays)."""
    path = step_dir(Path(folder), step)
    model_sd, optim_sd = get_state_dict(_stateful(parallel), optimizers_of(optimizer))
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=_world() == 1)
    torch.save(trainer_state, path / f"trainer_state_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (path / META).write_text(json.dumps({**meta, "step": step, "world_size": _world()}, indent=2) + "\n")
        for old in complete_checkpoints(folder)[:-keep_last] if keep_last else ():
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
        _dcp_load(state, path)
        trainer_state = torch.load(state_file, weights_only=True)
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        message = " ".join(str(e).split())[:200]
        raise CheckpointError(f"checkpoint {path} is corrupt ({type(e).__name__}: {message}): "
                              "delete it and resume from an earlier one") from None
    set_state_dict(module, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta, trainer_state


def load_weights(path: str | Path, module: torch.nn.Module) -> None:
    """Only the model weights of a checkpoint, into `module` (collective), through the safe loader."""
    path = Path(path)
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {META})")
    model_sd = get_model_state_dict(module)
    try:
        _dcp_load({"model": model_sd}, path)
    except (Exception, CheckpointException) as e:
        message = " ".join(str(e).split())[:200]
        raise CheckpointError(f"checkpoint {path} is corrupt ({type(e).__name__}: {message})") from None
    set_model_state_dict(module, model_sd)


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
