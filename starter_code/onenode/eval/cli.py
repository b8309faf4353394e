"""`onenode eval CHECKPOINT`: benchmarks (lm-eval) and held-out loss of one checkpoint folder.

    onenode eval runs/tiny/final                                   # the offline suite, no hub needed
    onenode eval runs/tiny/final --val-data data/default --out eval.json
    onenode eval runs/baseline/final --suite standard --device cuda --batch-size 64
    onenode eval runs/tiny/final --route hf                        # the transformers export (same numbers)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..data.tokenizer import TokenizerError
from .model import DEFAULT_MAX_LENGTH
from .run import ROUTES


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a checkpoint: lm-eval suite and held-out loss",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder in the transformers layout (a run's final/)")
    parser.add_argument("--suite", default="offline",
                        help="offline (the kit's tasks), standard (HellaSwag, ARC, PIQA, SciQ, WinoGrande, MMLU), "
                             "or TASK[,TASK...]")
    parser.add_argument("--tasks-dir", default=None, help="folder of local lm-eval task YAML files")
    parser.add_argument("--route", choices=ROUTES, default="onenode",
                        help="onenode: the kit's model; hf: transformers.AutoModelForCausalLM on the same folder")
    parser.add_argument("--limit", type=int, default=None, help="at most this many items per task")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH, help="longest input in tokens")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the checkpoint's)")
    parser.add_argument("--tokenizer", default=None,
                        help="override the checkpoint's tokenizer (gpt2, a tokenizer.json)")
    held = parser.add_mutually_exclusive_group()
    held.add_argument("--val-data", default=None, help="data folder whose val split gives the held-out loss")
    held.add_argument("--val-text", default=None, help="text file whose documents give the held-out loss")
    parser.add_argument("--val-seq-len", type=int, default=512)
    parser.add_argument("--val-max-tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the report here as JSON")


def summary(report: dict) -> str:
    lines = [f"{report['checkpoint']} ({report['route']} route, suite {report['suite']}"
             + (f", limit {report['limit']}" if report["limit"] else "") + ")"]
    for task, entry in report["headline"].items():
        value, stderr = entry["value"], entry.get("stderr")
        shown = "-" if value is None else f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")
        lines.append(f"  {task:<20} {entry['metric']:<16} {shown}")
    if report["heldout"]:
        h = report["heldout"]
        lines.append(f"  held-out loss {h['loss']:.4f}, perplexity {h['perplexity']:.2f} over {h['tokens']:,} tokens")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from .run import evaluate

    try:
        report = evaluate(args.checkpoint, suite=args.suite, route=args.route, tasks_dir=args.tasks_dir,
                          limit=args.limit, batch_size=args.batch_size, max_length=args.max_length,
                          device=args.device, dtype=args.dtype, tokenizer=args.tokenizer, val_data=args.val_data,
                          val_text=args.val_text, val_seq_len=args.val_seq_len, val_max_tokens=args.val_max_tokens)
    except (FileNotFoundError, ValueError, TokenizerError) as e:
        print(f"onenode eval: {e}", file=sys.stderr)
        return 2
    print(summary(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m onenode.eval.cli CHECKPOINT ...`: the grader runs this inside its sandbox."""
    parser = argparse.ArgumentParser(prog="onenode eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
