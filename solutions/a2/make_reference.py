"""Make the reference A2 submission, and the example A2 cohort, by training on CPU (minutes).

Nothing large is committed: the recipe (recipe.yaml) and the data config (data.yaml) are; the
report is the completed A2 notebook (assignments/source/a2/report.ipynb); the checkpoint is
trained here, once per content (cached under $ONENODE_CACHE/a2-runs/).

    python solutions/a2/make_reference.py --out build/a2-reference      # one submission folder
    python solutions/a2/make_reference.py --cohort examples/a2-cohort/build

The example cohort (for the demo and for calibrating the grader):
- `reference`: this recipe, within the cpu-tiny budget: verified, beats the baseline;
- `untrained`: the reference's run with the weights of a fresh initialisation in final/: not
  verified (final/ is not the chain's last checkpoint), loses;
- `over-budget`: the reference resumed and trained on past the profile's budget: evaluated, not verified;
- `manifest-mismatch`: the reference with a manifest claiming another model: not verified.
A submission is the run folder with its checkpoints (the chain the grader replays) and the data
folder it trained on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KIT_ROOT = HERE.parents[1]
RECIPE = HERE / "recipe.yaml"
NOTEBOOK = KIT_ROOT / "assignments" / "source" / "a2" / "report.ipynb"  # the completed report (nbgrader source)
OVER_BUDGET = {"train.token_budget": 32768}  # 16 steps more than the cpu-tiny budget of 24,576 tokens

if str(KIT_ROOT) not in sys.path:
    sys.path.insert(0, str(KIT_ROOT))


def make_submission(dest: str | Path) -> Path:
    """The reference submission at `dest` (see `assemble`)."""
    from grader.a2 import trained_run

    return assemble(trained_run(RECIPE), Path(dest))


def assemble(run: Path, dest: Path) -> Path:
    """A submission at `dest` from a run folder, copied as `onenode pack a2` copies one but
    without its checks (the forgeries are assembled so too): its final/, checkpoints/, recipe,
    manifest and log, the report, and the data folder it trained on, which the grader replays the
    run on and checks for evaluation text."""
    from onenode.eval.model import recipe_data_dir
    from onenode.pack import copy_a2
    from onenode.train.recipe import load_recipe

    shutil.rmtree(dest, ignore_errors=True)
    return copy_a2(run, dest, NOTEBOOK, recipe_data_dir(load_recipe(run / "recipe.yaml"), KIT_ROOT))


def make_over_budget(dest: str | Path) -> Path:
    """The reference run resumed from its last checkpoint and trained on to a larger budget: a
    real run, internally consistent, past the profile's budget."""
    from grader.a2 import trained_run
    from grader.a2.job import train_on_stack

    dest = Path(dest)
    run = dest.with_name(f".{dest.name}-run")
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(trained_run(RECIPE), run, ignore=shutil.ignore_patterns("final"))
    train_on_stack(RECIPE, run, OVER_BUDGET)
    assemble(run, dest)
    shutil.rmtree(run)
    return dest


def make_untrained(reference: Path, dest: Path) -> Path:
    """The reference run with freshly initialised weights in final/ (same config, same files
    otherwise): final/ is no longer the chain's last checkpoint."""
    from onenode.model import build_model
    from onenode.model.config import NemotronHConfig

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(reference, dest)
    build_model(NemotronHConfig.load(dest / "final"), seed=1).save_pretrained(dest / "final")
    return dest


def make_manifest_mismatch(reference: Path, dest: Path) -> Path:
    """The reference with a manifest that claims a larger model than the checkpoint holds."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(reference, dest)
    for path in (dest / "run_manifest.json", dest / "final" / "run_manifest.json"):
        manifest = json.loads(path.read_text())
        manifest["parameters"]["total"] *= 2
        manifest["model_config"]["hidden_size"] *= 2
        path.write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


def build_a2_cohort(dest: str | Path) -> list[Path]:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    reference = make_submission(dest / "reference")
    return [reference, make_untrained(reference, dest / "untrained"),
            make_over_budget(dest / "over-budget"),
            make_manifest_mismatch(reference, dest / "manifest-mismatch")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="write the reference submission folder here")
    where.add_argument("--cohort", help="write the example cohort (one folder per submission) here")
    args = parser.parse_args(argv)
    made = [make_submission(args.out)] if args.out else build_a2_cohort(args.cohort)
    print("\n".join(str(p) for p in made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
