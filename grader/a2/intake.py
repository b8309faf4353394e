"""The grader's intake of an A2 submission: the kit's run folder loader (`onenode.verify.intake`,
which `onenode verify` and `onenode pack a2` use too), its refusal the submission's zero."""

from __future__ import annotations

from pathlib import Path

from onenode.verify import intake

from ..errors import SubmissionError


def load_submission(path: str | Path, notebook: bool = True) -> intake.A2Submission:
    """`onenode.verify.intake.load_submission`, refused in one line as a `SubmissionError`."""
    try:
        return intake.load_submission(path, notebook)
    except intake.RunFolderError as e:
        raise SubmissionError(str(e)) from None
