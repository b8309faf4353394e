"""`data.source: megatron`: a Megatron dataset prefix as a one-source data folder, so the loader,
the evaluation and the A2 grader read it like any other."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from onenode.data.megatron import read_index
from onenode.data.shards import MANIFEST, SPLITS, ShardWriter, file_sha256, read_manifest

TOKENIZER_FILES = ("tokenizer.json", "onenode_tokenizer.json")  # what a checkpoint carries, too
_SOURCE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def megatron_data_folder(prefix: str | Path) -> Path:
    """A data folder for `data.source: megatron`: the Megatron dataset `prefix` as the one source
    of a folder the loader, the evaluation and the A2 grader read like any other.

    A prefix the kit built (`OUT/<source>/train` of `onenode data build --format megatron`) keeps
    its manifest (tokenizer, curation counts) and its `val` split. Any other prefix (Megatron-LM's
    preprocessing) trains on all its documents, has no validation split, and needs the tokenizer
    it was made with beside it: a `tokenizer.json`, or `onenode_tokenizer.json` naming one
    (`{"spec": "gpt2"}`). The folder lives in $ONENODE_CACHE/datasets/ and links to the prefix's
    files (copy it with `cp -rL` to hand it in)."""
    from onenode.data.corpus import cache_dir, cache_lock

    prefix = Path(os.path.abspath(prefix))
    dtype, offsets = read_index(prefix)
    kit = _kit_manifest(prefix)
    identity = f"{prefix}\n{file_sha256(Path(f'{prefix}.idx'))}\n{Path(f'{prefix}.bin').stat().st_size}"
    if kit is not None:  # a rebuilt folder gets a fresh view
        identity += "\n" + file_sha256(prefix.parent.parent / MANIFEST)
    folder = cache_dir() / "datasets" / f"megatron-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    with cache_lock(f"datasets-{folder.name}"):
        if not (folder / MANIFEST).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            manifest = (_kit_view(prefix, kit, folder) if kit is not None
                        else _foreign_view(prefix, dtype, offsets, folder))
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


def _kit_manifest(prefix: Path) -> dict | None:
    """The manifest of the kit folder that `prefix` is the train split of, if it is one."""
    folder, source = prefix.parent.parent, prefix.parent.name
    if not (folder / MANIFEST).is_file():
        return None
    manifest = read_manifest(folder)
    if source not in manifest.get("sources", {}):
        return None
    if prefix.name != "train":
        raise ValueError(f"data.path: {prefix} is the {prefix.name} split of {folder}; name the train split "
                         f"({prefix.parent / 'train'}), its val split is used for validation")
    return manifest


def _link(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(target)


def _kit_view(prefix: Path, manifest: dict, folder: Path) -> dict:
    source = prefix.parent.name
    for split in SPLITS:
        for suffix in (".bin", ".idx"):
            _link(prefix.parent / f"{split}{suffix}", folder / source / f"{split}{suffix}")
    if (prefix.parent.parent / "tokenizer.json").is_file():
        _link(prefix.parent.parent / "tokenizer.json", folder / "tokenizer.json")
    return {**manifest, "sources": {source: {**manifest["sources"][source], "weight": 1.0}}}


def _foreign_view(prefix: Path, dtype: np.dtype, offsets: np.ndarray, folder: Path) -> dict:
    from onenode.data.tokenizer import load_tokenizer

    found = [prefix.parent / name for name in TOKENIZER_FILES if (prefix.parent / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{prefix} carries no tokenizer: put the one it was made with beside it, as "
                                f"{prefix.parent / TOKENIZER_FILES[0]} or {prefix.parent / TOKENIZER_FILES[1]} "
                                '({"spec": "gpt2"})')
    if found[0].name == TOKENIZER_FILES[0]:
        spec, tokenizer = {"file": str(found[0])}, load_tokenizer(str(found[0]))
        _link(found[0], folder / "tokenizer.json")
    else:
        spec = json.loads(found[0].read_text()).get("spec")
        tokenizer = load_tokenizer(spec)
    tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype)
    largest = max((int(tokens[i:i + (1 << 26)].max()) for i in range(0, len(tokens), 1 << 26)), default=-1)
    if largest >= tokenizer.vocab_size:
        raise ValueError(f"{prefix}.bin holds token id {largest}, beyond {tokenizer.name!r}'s {tokenizer.vocab_size} "
                         f"tokens: the tokenizer beside it is not the one that made it")
    source = _SOURCE_NAME.sub("_", prefix.name).lstrip(".-") or "megatron"
    for suffix in (".bin", ".idx"):
        _link(Path(f"{prefix}{suffix}"), folder / source / f"train{suffix}")
    empty = ShardWriter(folder / source / "val", dtype, tokenizer.eos_id)
    empty.close()
    return {
        "format": "megatron/1",
        "command": f"data.source: megatron, data.path: {prefix}",
        "config": {"tokenizer": spec, "format": "megatron"},
        "tokenizer": tokenizer.describe(),
        "dtype": dtype.name,
        "val_fraction": 0.0,
        "sources": {source: {"spec": {"kind": "megatron", "prefix": str(prefix)}, "weight": 1.0,
                             "documents_read": len(offsets) - 1,
                             "splits": {"train": {"documents": len(offsets) - 1, "tokens": int(offsets[-1]),
                                                  "sha256": file_sha256(Path(f"{prefix}.bin"))},
                                        "val": {"documents": 0, "tokens": 0, "sha256": hashlib.sha256().hexdigest()}}}},
        "curation": {},
    }
