"""Submitted training data that contains the evaluation text."""

from __future__ import annotations

from pathlib import Path

from .audit import Check
from .intake import A2Submission


def contamination(sub: A2Submission, suite_dir: Path) -> Check | None:
    """Training documents of the submitted data that share a 13-gram with the evaluation text
    (the data pipeline's own decontamination filter); None when no shards were submitted."""
    from onenode.data.curation import Decontaminate, read_eval_texts
    from onenode.data.shards import open_shards
    from onenode.eval.model import checkpoint_tokenizer

    if sub.data is None:
        return None
    try:
        _, shards = open_shards(sub.data, "train")
    except (FileNotFoundError, ValueError):
        return None  # a manifest alone: nothing to check against
    tokenizer = checkpoint_tokenizer(sub.checkpoint)
    filt = Decontaminate(read_eval_texts([suite_dir / "onenode_heldout.jsonl"]))
    flagged = sum(not filt.keep(tokenizer.decode(s.document(i).tolist()))
                  for s in shards.values() for i in range(s.num_docs))
    return Check("contamination", flagged == 0, f"{flagged} of {filt.seen} training documents share a 13-word "
                                                f"sequence with the evaluation text")
