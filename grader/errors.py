"""The two ways grading stops short, and what the core does with each.

A `GraderError` stops the whole job: the kit or the machine is broken, so every result would be
wrong. A `SubmissionError` costs one submission: it gets every test at 0 with the error's
one-line reason, and the cohort goes on.
"""


class GraderError(RuntimeError):
    """The grading job itself cannot go on (the kit or the machine, not a submission)."""


class SubmissionError(ValueError):
    """A submission that cannot be graded, with a one-line reason that says what to do."""
