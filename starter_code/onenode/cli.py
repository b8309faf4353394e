"""`onenode`: the student stack's command line. Each subcommand lives beside the code it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module that defines `register(subparsers)`; imported only when listed here, so a
# missing optional dependency of one subcommand never breaks the others.
SUBCOMMANDS = {
    "bench": "onenode.bench",
    "train": "onenode.train.cli",
    "sweep": "onenode.train.sweep",
    "data": "onenode.data.cli",
    "eval": "onenode.eval.cli",
    "convert": "onenode.model.hf_io",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onenode", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("onenode"):
                help_text = f"(unavailable: needs the missing package {e.name!r}; pip install it)"
                subparsers.add_parser(name, help=help_text)
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # e.g. "expert parallelism on"
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        if args.command:
            parser.error(f"`onenode {args.command}` is unavailable here: see `onenode --help`")
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
