"""Where documents come from: the default corpus, local files, or a Hugging Face dataset stream.

A source spec is a small mapping from the data config, e.g.
`{kind: corpus, part: shakespeare}`, `{kind: files, paths: [notes/*.txt]}`,
`{kind: hf, dataset: HuggingFaceFW/fineweb-edu, name: sample-10BT, split: train}`.
Every kind yields plain document strings; `max_docs` caps any of them.
"""

from __future__ import annotations

import glob
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from onenode.data.corpus import cap_length, corpus_part


class SourceError(ValueError):
    """A source cannot be read; the message names it and says what to do."""


def source_name(spec: dict) -> str:
    return spec.get("name") or spec.get("part") or str(spec.get("dataset", "files")).split("/")[-1]


def iter_source(spec: dict) -> Iterator[str]:
    """The documents of one source, as strings, in their stored order."""
    kind = spec.get("kind", "corpus")
    readers = {"corpus": _corpus, "files": _files, "hf": _hf}
    if kind not in readers:
        raise SourceError(f"source {source_name(spec)!r}: unknown kind {kind!r} "
                          f"(choose from {', '.join(readers)})")
    docs = readers[kind](spec)
    return itertools.islice(docs, spec["max_docs"]) if spec.get("max_docs") else docs


def _corpus(spec: dict) -> Iterator[str]:
    with corpus_part(spec.get("part", spec.get("name", ""))).open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def _files(spec: dict) -> Iterator[str]:
    """.txt/.md: one document per file (cut at paragraphs when long); .jsonl: one per record;
    .parquet: one per row (needs pyarrow). `text_field` names the text column (default text)."""
    name, field = source_name(spec), spec.get("text_field", "text")
    patterns = spec.get("paths") or []
    if isinstance(patterns, str):
        patterns = [patterns]
    paths = sorted({p for pattern in patterns for p in glob.glob(str(pattern), recursive=True)})
    if not paths:
        raise SourceError(f"source {name!r}: no file matches {patterns}; check `paths:`")
    for path in map(Path, paths):
        if path.stat().st_size == 0:
            raise SourceError(f"source {name!r}: {path} is empty; remove it or fill it")
        if path.suffix == ".jsonl":
            yield from _jsonl(path, field, name)
        elif path.suffix == ".parquet":
            yield from _parquet(path, field, name)
        else:
            yield from cap_length(path.read_text(encoding="utf-8", errors="replace").strip())


def _jsonl(path: Path, field: str, name: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise SourceError(f"source {name!r}: {path}:{number} is not valid JSON") from None
            if field not in record:
                raise SourceError(f"source {name!r}: {path}:{number} has no field {field!r}; "
                                  "set `text_field:`")
            yield record[field]


def _parquet(path: Path, field: str, name: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise SourceError(f"source {name!r}: reading {path} needs pyarrow: pip install pyarrow") from None
    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise SourceError(f"source {name!r}: {path} has no column {field!r}; set `text_field:`")
    for batch in table.iter_batches(columns=[field]):
        yield from batch.column(0).to_pylist()


def _hf(spec: dict) -> Iterator[str]:
    """A Hugging Face dataset, streamed (no full download), e.g. FineWeb-Edu on the course node.
    Extra keys `name`, `split`, `data_files`, `revision` go to `datasets.load_dataset`."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise SourceError(f"source {source_name(spec)!r}: Hugging Face datasets need the "
                          "`datasets` package: pip install datasets") from None
    kwargs = {k: spec[k] for k in ("name", "data_files", "revision") if k in spec}
    try:
        stream = datasets.load_dataset(spec["dataset"], split=spec.get("split", "train"),
                                       streaming=spec.get("streaming", True), **kwargs)
    except Exception as e:  # the hub client raises many types; all mean "cannot open"
        raise SourceError(f"source {source_name(spec)!r}: cannot open dataset "
                          f"{spec['dataset']!r}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    field = spec.get("text_field", "text")
    for record in stream:
        yield record[field]
