"""Megatron's indexed dataset format (PREFIX.bin + PREFIX.idx), through megatron-core itself.

`shards.ShardWriter(..., megatron=True)` writes it and `shards.Shard` reads it. A `.bin` is the
same flat array of token ids as the kit's own shard; the `.idx` (megatron-core's `_IndexWriter`)
holds the dtype, every sequence's length and byte offset, and which sequences make up each
document. The kit writes one document as one sequence ending in EOS (what
Megatron-LM's `tools/preprocess_data.py --append-eod` writes), so a Megatron recipe can take
`--train-data-path OUT/<source>/train`. Reading takes any such prefix, Megatron-LM's own
included: a document is the tokens of all its sequences, which the builder stores contiguously.

megatron-core is the optional extra `[megatron]`: it needs only torch, numpy and packaging on a
CPU (its Transformer Engine and Apex are optional and unused here).
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np

INSTALL = ("Megatron's data format needs megatron-core: pip install -e '.[megatron]' "
           "(or pip install --no-deps megatron-core)")


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
