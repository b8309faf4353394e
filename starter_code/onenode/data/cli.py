"""`onenode data`: fetch the default corpus, build tokenized shards, inspect a data folder."""

from __future__ import annotations

import functools
import json
import shlex
import sys
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
SOURCE_KINDS = ("corpus", "files", "hf")


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="build and inspect training data (A2)",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    fetch = sub.add_parser("fetch", help="download and clean the default offline corpus")
    fetch.add_argument("--parts", nargs="+", help="corpus parts (default: all that can be fetched)")
    fetch.set_defaults(func=_fetch)

    build = sub.add_parser("build", help="sources -> curation -> tokenizer -> shards + manifest")
    build.add_argument("config", nargs="?", default=str(CONFIGS / "offline_default.yaml"),
                       help="data config YAML (default: the offline default corpus)")
    build.add_argument("--out", required=True, help="output folder")
    build.add_argument("--source", action="append", metavar="KIND:WHAT",
                       help="replace the config's sources (repeatable, equal weights): "
                            "corpus:shakespeare, files:'notes/*.txt', hf:HuggingFaceFW/fineweb-edu")
    build.add_argument("--tokenizer", help="gpt2, a tokenizer.json path, or a transformers name")
    build.add_argument("--max-docs", type=int, help="read at most this many documents per source")
    build.add_argument("--val-fraction", type=float, help="held-out fraction of documents")
    build.add_argument("--format", choices=("onenode", "megatron"),
                       help="shard format: the kit's own (default), or Megatron's indexed dataset "
                            "<source>/<split>.bin/.idx through megatron-core (extra [megatron])")
    build.set_defaults(func=_build)

    inspect = sub.add_parser("inspect", help="summarise a built data folder")
    inspect.add_argument("data_dir")
    inspect.add_argument("--sample", type=int, default=0, metavar="N",
                         help="also decode the first N tokens of one training batch")
    inspect.set_defaults(func=_inspect)


def _one_line_errors(func):
    """Bad input ends in one line that says what to do, never a traceback."""

    @functools.wraps(func)
    def wrapper(args) -> int:
        try:
            return func(args) or 0
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return wrapper


@_one_line_errors
def _fetch(args) -> int:
    from onenode.data.corpus import fetch_default_corpus
    from onenode.data.tokenizer import gpt2_ranks_file

    got = fetch_default_corpus(args.parts)
    for name, path in got.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        print(f"{name:12s} {len(lines):6d} documents  {path}")
    print(f"{'gpt2 BPE':12s} {gpt2_ranks_file()}")
    return 0 if got else 1


def _parse_source(text: str) -> tuple[str, dict]:
    kind, _, what = text.partition(":")
    if kind not in SOURCE_KINDS or not what:
        raise ValueError(f"--source {text!r}: write KIND:WHAT with KIND one of {SOURCE_KINDS}")
    key = {"corpus": "part", "files": "paths", "hf": "dataset"}[kind]
    name = (Path(what).stem.replace("*", "") or "files") if kind == "files" else what.split("/")[-1]
    return name, {"kind": kind, key: [what] if kind == "files" else what}


@_one_line_errors
def _build(args) -> int:
    from onenode.data.build import build, load_config

    config = load_config(args.config)
    if args.source:
        config["sources"] = dict(map(_parse_source, args.source))
    if args.tokenizer:
        config["tokenizer"] = args.tokenizer
    if args.val_fraction is not None:
        config["val_fraction"] = args.val_fraction
    if args.format:
        config["format"] = args.format
    if args.max_docs:
        for spec in config["sources"].values():
            spec["max_docs"] = args.max_docs
    manifest = build(config, args.out, command=shlex.join(["onenode", "data", *sys.argv[2:]]))
    _print_summary(manifest)
    print(f"wrote {Path(args.out) / 'manifest.json'}")
    return 0


def _print_summary(manifest: dict) -> None:
    tok = manifest["tokenizer"]
    print(f"tokenizer {tok['name']} (vocab {tok['vocab_size']}, eos {tok['eos_id']}, "
          f"sha256 {tok['sha256'][:12]}), shards {manifest['dtype']} ({manifest.get('format', 'onenode-shards/1')})")
    print(f"{'source':14s} {'weight':>6s} {'read':>8s} {'train docs':>10s} {'train tokens':>13s} "
          f"{'val docs':>8s} {'val tokens':>11s}")
    for name, s in manifest["sources"].items():
        train, val = s["splits"]["train"], s["splits"]["val"]
        print(f"{name:14s} {s['weight']:6.3g} {s['documents_read']:8d} {train['documents']:10d} "
              f"{train['tokens']:13d} {val['documents']:8d} {val['tokens']:11d}")
    for name, report in manifest["curation"].items():
        print(f"curation {name:14s} removed {report['removed']:6d} of {report['seen']:6d}  "
              f"{json.dumps(report['reasons'])}")


@_one_line_errors
def _inspect(args) -> int:
    from onenode.data.shards import read_manifest

    manifest = read_manifest(Path(args.data_dir))
    print(f"built {manifest['created']} by: {manifest['command']}")
    _print_summary(manifest)
    if args.sample:
        from onenode.data.loader import MixtureLoader
        from onenode.data.tokenizer import data_tokenizer

        tokenizer = data_tokenizer(args.data_dir)
        input_ids, _ = next(MixtureLoader(args.data_dir, batch_size=1, seq_len=args.sample))
        print(repr(tokenizer.decode(input_ids[0].tolist())))
    return 0
