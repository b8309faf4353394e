"""`onenode-grade demo`: build the example cohort from solutions/a1/ and grade it on CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..rubric import KIT_ROOT, read_toml
from ..submission import NOTEBOOK_NAME, PATCH_NAME

MANIFEST = KIT_ROOT / "examples" / "a1-cohort" / "cohort.toml"
SOLUTIONS = KIT_ROOT / "solutions" / "a1"


def build_cohort(dest: Path, manifest: Path = MANIFEST, solutions: Path = SOLUTIONS) -> list[Path]:
    """One folder per submission of the manifest under `dest` (rebuilt from scratch)."""
    submissions = read_toml(manifest)["submissions"]
    shutil.rmtree(dest, ignore_errors=True)
    built = []
    for name, patches in submissions.items():
        texts = []
        for patch in patches:
            path = manifest.parent / patch if patch.startswith("./") else solutions / patch
            if not path.is_file():
                raise FileNotFoundError(f"{manifest.name}: {name} needs {path}, which is missing: restore it from git")
            texts.append(path.read_text(encoding="utf-8"))
        folder = dest / name
        folder.mkdir(parents=True)
        (folder / PATCH_NAME).write_text("".join(texts), encoding="utf-8")
        if (solutions / NOTEBOOK_NAME).is_file():
            shutil.copy2(solutions / NOTEBOOK_NAME, folder / NOTEBOOK_NAME)
        built.append(folder)
    return built
