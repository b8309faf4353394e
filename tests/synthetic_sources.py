"""Small text sources for data tests: each a JSONL file of documents of random words that start
with the source's name and number, so every document is distinct and traceable to its source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_sources(root: Path, weights: dict[str, float], docs: int, vocabulary: int, max_words: int) -> dict:
    """One JSONL file per source under `root`; the data config's `sources` for them."""
    rng = np.random.default_rng(0)
    words_of = [f"w{i}" for i in range(vocabulary)]
    sources = {}
    for name, weight in weights.items():
        path = root / f"{name}.jsonl"
        with path.open("w") as f:
            for doc in range(docs):
                words = rng.choice(words_of, size=int(rng.integers(5, max_words)))
                f.write(json.dumps({"text": f"{name} {doc} " + " ".join(words)}) + "\n")
        sources[name] = {"kind": "files", "paths": [str(path)], "weight": weight}
    return sources
