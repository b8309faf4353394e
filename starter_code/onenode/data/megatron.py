"""Megatron's indexed dataset format (PREFIX.bin + PREFIX.idx), through megatron-core itself.

A `.bin` is the same flat array of token ids as the kit's own shard; the `.idx` (megatron-core's
`_IndexWriter`) holds the dtype, every sequence's length and byte offset, and which sequences
make up each document. The kit writes one document as one sequence ending in EOS (what
Megatron-LM's `tools/preprocess_data.py --append-eod` writes), so a Megatron recipe can take
`--train-data-path OUT/<source>/train`. Reading takes any such prefix, Megatron-LM's own
included: a document is the tokens of all its sequences, which the builder stores contiguously.

megatron-core is the optional extra `[megatron]`: it needs only torch, numpy and packaging on a
CPU (its Transformer Engine and Apex are optional and unused here).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import warnings
from pathlib import Path

import numpy as np

from onenode.data.shards import MANIFEST, SPLITS, ShardWriter, file_sha256, read_manifest

INSTALL = ("Megatron's data format needs megatron-core: pip install -e '.[megatron]' "
           "(or pip install --no-deps megatron-core)")
TOKENIZER_FILES = ("tokenizer.json", "onenode_tokenizer.json")  # what a checkpoint carries, too
_SOURCE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


class MegatronMissing(RuntimeError):
    """megatron-core is not installed."""


def indexed_dataset():
    """megatron-core's `indexed_dataset` module (its import warns that Transformer Engine and Apex
    are absent, which nothing here needs)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset as module
    except ImportError:
        raise MegatronMissing(INSTALL) from None
    return module


def megatron_dtype(dtype: np.dtype) -> np.dtype:
    """Megatron's index has no uint32: a vocabulary over 65536 tokens is stored as int32."""
    return np.dtype(np.int32) if np.dtype(dtype) == np.uint32 else np.dtype(dtype)


class MegatronWriter(ShardWriter):
    """`ShardWriter` through megatron-core's `IndexedDatasetBuilder`: each document (EOS added)
    is one sequence; `close()` writes `<prefix>.idx`."""

    def __init__(self, prefix: Path, dtype: np.dtype, eos_id: int):
        self.prefix, self.dtype, self.eos_id = Path(prefix), megatron_dtype(dtype), eos_id
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._builder = indexed_dataset().IndexedDatasetBuilder(f"{self.prefix}.bin", dtype=self.dtype.type)
        self._offsets = [0]
        self._limit = np.iinfo(self.dtype).max
        self._check(np.array([eos_id]))

    def write(self, ids: list[int]) -> None:
        arr = np.asarray([*ids, self.eos_id], dtype=np.int64)
        self._check(arr)
        self._builder.add_document(arr, [len(arr)])
        self._offsets.append(self._offsets[-1] + len(arr))

    def close(self) -> dict:
        self._builder.finalize(f"{self.prefix}.idx")
        return {"documents": len(self._offsets) - 1, "tokens": self._offsets[-1],
                "sha256": file_sha256(Path(f"{self.prefix}.bin"))}


def read_index(prefix: Path) -> tuple[np.dtype, np.ndarray]:
    """The token dtype and the documents' token offsets (n_docs + 1 entries) of a Megatron
    dataset, as megatron-core's `IndexedDataset(prefix)` reads its index."""
    prefix = Path(prefix)
    for suffix in (".bin", ".idx"):
        if not Path(f"{prefix}{suffix}").is_file():
            raise FileNotFoundError(f"no Megatron dataset at {prefix}: {prefix}{suffix} is missing "
                                    "(a prefix names PREFIX.bin and PREFIX.idx)")
    module = indexed_dataset()
    _check_index_header(Path(f"{prefix}.idx"))
    try:
        dataset = module.IndexedDataset(str(prefix), mmap=True)
        dtype = np.dtype(dataset.index.dtype)
        lengths = np.asarray(dataset.index.sequence_lengths, dtype=np.int64)
        pointers = np.asarray(dataset.index.sequence_pointers, dtype=np.int64)
        documents = np.asarray(dataset.document_indices, dtype=np.int64)
    except (AssertionError, struct.error, ValueError, KeyError) as e:  # megatron-core asserts on a bad header
        raise ValueError(f"{prefix}.idx is not a Megatron index ({e or type(e).__name__}): rebuild it with "
                         "megatron-core's IndexedDatasetBuilder") from None
    starts = np.concatenate([[0], np.cumsum(lengths)])
    if not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        raise ValueError(f"{prefix}.idx: its sequences are not stored one after another in {prefix}.bin; "
                         "rewrite it with megatron-core's IndexedDatasetBuilder")
    if documents[0] != 0 or documents[-1] != len(lengths) or np.any(np.diff(documents) < 0):
        raise ValueError(f"{prefix}.idx: its documents do not cover its sequences in order; rebuild it")
    return dtype, starts[documents]


def _check_index_header(path: Path) -> None:
    """Refuse a file that is not a version-1 index holding the arrays its header counts, before
    megatron-core reads it (which asserts, and warns again as it is collected)."""
    with path.open("rb") as f:
        head = f.read(34)  # magic (9), version <Q, dtype code <B, sequence count <Q, document count <Q
    size = path.stat().st_size
    ok = len(head) == 34 and head[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<Q", head[9:17])[0] == 1
    if ok:
        sequences, documents = struct.unpack("<QQ", head[18:34])
        ok = size >= 34 + sequences * 12 + documents * 8
    if not ok:
        raise ValueError(f"{path} is not a Megatron index (no version-1 header with its arrays): rebuild it with "
                         "megatron-core's IndexedDatasetBuilder")


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
