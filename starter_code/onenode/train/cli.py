"""`onenode train RECIPE`: one token-budgeted run (alone, or under torchrun on one or more nodes).

    onenode train a2_pretrain/recipes/tiny.yaml --out runs/tiny
    onenode train a2_pretrain/recipes/tiny.yaml --set optimizer.name=muon --set train.token_budget=4096
    torchrun --nproc-per-node 8 -m onenode.cli train a2_pretrain/recipes/baseline.yaml --out runs/baseline

A run resumes from the latest checkpoint in its output folder unless `--fresh` is given.
"""

from __future__ import annotations

import argparse
import sys

from .checkpoint import CheckpointError
from .logging import log_help
from .recipe import RecipeError, load_recipe, parse_override


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set train.token_budget=1e6 (repeatable)")


def overrides_from(args: argparse.Namespace) -> dict:
    return dict(parse_override(text) for text in args.overrides)


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a model from a recipe to its token budget",
                                   description=__doc__, epilog=log_help(),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML (see a2_pretrain/recipes/)")
    parser.add_argument("--out", default=None, help="run folder (default: runs/<recipe name>)")
    add_recipe_arguments(parser)
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--fresh", action="store_true", help="ignore checkpoints already in --out")
    resume.add_argument("--resume", default=None, metavar="CHECKPOINT",
                        help="resume from this step_* folder (or the latest one of this run folder)")
    parser.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                        help="stop (with a checkpoint) after this many steps; a later run resumes")
    parser.add_argument("--check", action="store_true", help="validate the recipe, print the plan and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe, overrides_from(args))
        if args.check:
            print(describe(recipe))
            return 0
        from .trainer import Trainer

        resume = None if args.fresh else (args.resume or "auto")
        trainer = Trainer(recipe, args.out or f"runs/{recipe.name}", resume=resume)
        manifest = trainer.fit(stop_after_steps=args.stop_after)
    except (RecipeError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if trainer.rank == 0:
        losses = manifest["final_losses"]
        print(f"{manifest['status']}: {manifest['steps']} steps, {manifest['tokens_seen']:,} of "
              f"{manifest['token_budget']:,} budgeted tokens, train loss {losses['train']:.4f}"
              + (f", val loss {losses['val']:.4f}" if losses["val"] is not None else "")
              + f" -> {trainer.out_dir}")
        speed = manifest["throughput"]
        if speed:
            print(f"throughput: {speed['tokens_per_s']:,.0f} tokens/s ({speed['tokens_per_s_per_rank']:,.0f} per rank)"
                  + (f", MFU {speed['mfu']:.1%}" if "mfu" in speed else ""))
    return 0


def describe(recipe) -> str:
    """The plan in a few lines: what `--check` prints."""
    from ..model import count_parameters

    config = recipe.model_config()
    total, active = count_parameters(config)
    t = recipe.train
    d = recipe.parallel.diloco
    # cluster/train_diloco.sh reads the DiLoCo line: how many replica groups (nodes) the run needs
    diloco = ([f"DiLoCo: {d.replicas} replica groups, a sync every {d.inner_steps} inner steps "
               f"(outer lr {d.outer_lr:g}, momentum {d.outer_momentum:g})"] if d.inner_steps else [])
    return "\n".join([
        f"recipe {recipe.name}: model {config.name} ({config.hybrid_override_pattern}), "
        f"{total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active",
        f"budget {t.token_budget:,} tokens = {recipe.total_steps:,} steps of {recipe.tokens_per_step:,} "
        f"({t.global_batch_size} x {t.seq_len}); {recipe.total_steps * recipe.tokens_per_step:,} tokens trained",
        f"optimizer {recipe.optimizer.name} lr {recipe.optimizer.lr:g}, schedule {recipe.schedule.name}, "
        f"precision {t.precision}, data {recipe.data.source}"
        + (f" ({recipe.data.path})" if recipe.data.source != "synthetic" else ""),
        *diloco,
    ])
