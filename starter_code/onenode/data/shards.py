"""Tokenized shards on disk: one flat memmap of token ids per (source, split), plus an index.

Layout of a built data folder:

    manifest.json                     sources, curation counts, token counts, hashes, tokenizer
    <source>/<split>.bin              token ids, uint16 (vocab <= 65536) or uint32, each
                                      document followed by the tokenizer's EOS id
    <source>/<split>.idx.npy          int64 document offsets into .bin: n_docs + 1 entries
                                      (`--format megatron`: <split>.idx, Megatron's index)

A flat file plus offsets is what nanoGPT and Megatron's indexed datasets use: reading a document
is one slice of a memmap, and nothing is loaded until the loader touches it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from onenode.data.megatron import indexed_dataset, megatron_dtype, read_index

MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class TokenOverflowError(ValueError):
    """A token id does not fit the shard's integer type."""


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends tokenized documents (EOS added) to `<prefix>.bin`; `close()` writes the index: the
    kit's `<prefix>.idx.npy`, or with `megatron=True` Megatron's `<prefix>.idx`, the `.bin` then
    written by megatron-core's `IndexedDatasetBuilder` (one document one sequence)."""

    def __init__(self, prefix: Path, dtype: np.dtype, eos_id: int, megatron: bool = False):
        self.prefix, self.eos_id = Path(prefix), eos_id
        self.dtype = megatron_dtype(dtype) if megatron else np.dtype(dtype)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        bin_path = str(self.prefix.with_suffix(".bin"))
        self._builder = indexed_dataset().IndexedDatasetBuilder(bin_path, dtype=self.dtype.type) if megatron else None
        self._file = None if megatron else open(bin_path, "wb")
        self._offsets = [0]
        self._limit = np.iinfo(self.dtype).max
        self._check(np.array([eos_id]))

    def _check(self, ids: np.ndarray) -> None:
        if ids.size and (ids.max() > self._limit or ids.min() < 0):
            bad = int(ids.max() if ids.max() > self._limit else ids.min())
            raise TokenOverflowError(f"token id {bad} does not fit {self.dtype.name} (max "
                                     f"{self._limit}); use a tokenizer whose vocabulary matches "
                                     "`vocab_size`, or store uint32")

    def write(self, ids: list[int]) -> None:
        arr = np.asarray([*ids, self.eos_id], dtype=np.int64)
        self._check(arr)
        if self._builder is not None:
            self._builder.add_document(arr, [len(arr)])
        else:
            self._file.write(arr.astype(self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + len(arr))

    def close(self) -> dict:
        """Finish the files; returns the split's counts and content hash for the manifest."""
        if self._builder is not None:
            self._builder.finalize(str(self.prefix.with_suffix(".idx")))
        else:
            self._file.close()
            np.save(self.prefix.with_suffix(".idx.npy"), np.asarray(self._offsets, dtype=np.int64))
        return {"documents": len(self._offsets) - 1, "tokens": self._offsets[-1],
                "sha256": file_sha256(self.prefix.with_suffix(".bin"))}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class Shard:
    """Read side of one (source, split): `tokens` memmap and document `offsets`."""

    def __init__(self, prefix: Path, dtype: np.dtype):
        bin_path, idx_path = Path(prefix).with_suffix(".bin"), Path(prefix).with_suffix(".idx.npy")
        megatron_idx = Path(prefix).with_suffix(".idx")
        if not bin_path.exists() or not (idx_path.exists() or megatron_idx.exists()):
            raise FileNotFoundError(f"shard {prefix} is missing; rebuild with `onenode data build`")
        if idx_path.exists():
            self.offsets = np.load(idx_path)
        else:  # Megatron's index (`onenode data build --format megatron`)
            stored, self.offsets = read_index(Path(prefix))
            if stored != np.dtype(dtype):
                raise ValueError(f"{megatron_idx} stores {stored.name} tokens where the manifest says "
                                 f"{np.dtype(dtype).name}: the folder is corrupt, rebuild it")
        size = bin_path.stat().st_size // np.dtype(dtype).itemsize
        if size != self.offsets[-1]:
            raise ValueError(f"shard {bin_path} holds {size} tokens but its index says "
                             f"{self.offsets[-1]}: the folder is corrupt, rebuild it")
        self.tokens = (np.memmap(bin_path, dtype=dtype, mode="r") if size
                       else np.zeros(0, dtype=dtype))

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def read_manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{data_dir} has no {MANIFEST}: build it with `onenode data build`")
    return json.loads(path.read_text())


def open_shards(data_dir: Path, split: str = "train") -> tuple[dict, dict[str, Shard]]:
    """The manifest and one Shard per source for `split`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose from {SPLITS}")
    manifest = read_manifest(data_dir)
    dtype = np.dtype(manifest["dtype"])
    return manifest, {name: Shard(Path(data_dir) / name / split, dtype) for name in manifest["sources"]}
