"""`onenode`: the student stack's command line. Each subcommand lives beside the code it runs."""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys

# subcommand -> module that defines `register(subparsers)`
SUBCOMMANDS = {
    "bench": "onenode.bench.cli",
    "train": "onenode.train.cli",
    "sweep": "onenode.train.sweep",
    "data": "onenode.data.cli",
    "eval": "onenode.eval.cli",
    "convert": "onenode.model.cli",
    "pack": "onenode.pack",
    "verify": "onenode.verify.cli",
}

# The optional dependencies (pyproject.toml's extras), by the module a missing one fails to import.
EXTRAS = {
    "transformers": "hf",
    "tokenizers": "data", "tiktoken": "data", "py3langid": "data", "pyarrow": "data",
    "datasets": "hub",
    "lm_eval": "eval", "accelerate": "eval",
    "nbgrader": "course", "jupyter": "course", "matplotlib": "course", "nbformat": "course", "nbclient": "course",
    "megatron": "megatron",  # megatron-core
    "torchft": "diloco",
    "torchao": "float8",
}


def install_hint(error: ModuleNotFoundError) -> str | None:
    """What to install for a missing optional dependency; None when `error` is anything else (a
    broken import in the kit itself, or a missing core dependency): that one keeps its traceback."""
    package = (error.name or "").split(".")[0]
    extra = EXTRAS.get(package)
    return extra and f"needs {package}, which is not installed: pip install 'onenode[{extra}]'"


def _raise(error: ModuleNotFoundError, args: argparse.Namespace) -> int:
    raise error


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand, or, given `command`, that one's module alone imported (the others are
    listed by name): a run pays for its own subcommand's imports, not for every module's. One
    whose module lacks an optional dependency is listed as unavailable (and says what to install
    when run), so it never breaks the others."""
    parser = argparse.ArgumentParser(prog="onenode", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        if command is not None and name != command:
            subparsers.add_parser(name)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            hint = install_hint(e)
            if hint is None:
                raise
            # takes any arguments (no option syntax: "+" prefixes none of them), to say what to install
            unavailable = subparsers.add_parser(name, help=f"(unavailable: {hint})", prefix_chars="+")
            unavailable.add_argument("ignored", nargs="*")
            unavailable.set_defaults(func=functools.partial(_raise, e))
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # e.g. "expert parallelism on"
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    from .data.corpus import FetchError
    from .model.mamba_ssm_scan import KernelUnavailableError

    try:
        return int(args.func(args) or 0)
    except KernelUnavailableError as e:
        print(f"onenode {args.command}: {e}", file=sys.stderr)
        return 2
    except FetchError as e:  # a corpus part this machine has not got and cannot download
        print(f"onenode {args.command}: {e} (run `onenode data fetch` where the network is, then copy its "
              f"cache folder, $ONENODE_CACHE or ~/.cache/onenode, to this machine)", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        hint = install_hint(e)
        if hint is None:
            raise
        print(f"onenode {args.command}: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
