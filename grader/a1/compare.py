"""A1's comparisons of what a child returns with the starter's, made here in the grader, never
in the child: anything malformed or not finite is infinitely wrong."""

from __future__ import annotations

import math


def relative_error(a, b, scale: float) -> float:
    """|a - b| / scale."""
    try:
        error = abs(float(a) - float(b)) / max(scale, 1e-30)
    except (TypeError, ValueError):
        return math.inf
    return error if math.isfinite(error) else math.inf


def moe_error(ref: list[dict], sub: list[dict]) -> float:
    """Worst relative error between the MoE digests of one workload (see harness `_sketch`
    and `_grad_norms`)."""
    if not isinstance(sub, list) or len(sub) != len(ref):
        return math.inf
    return max(_moe_digest_error(r, s) for r, s in zip(ref, sub))


def _moe_digest_error(ref: dict, sub: dict) -> float:
    try:
        errors = []
        for key in ("out", "dx"):
            r, s = ref[key], sub[key]
            if len(r) != len(s):
                return math.inf
            errors += [relative_error(a, b, abs(r[-1])) for a, b in zip(s, r)]  # projections ~ the norm
        _, l1, l2 = ref["dparams"]
        _, m1, m2 = sub["dparams"]
        errors += [relative_error(m1, l1, l1), relative_error(m2, l2, 2 * l2)]
    except (KeyError, TypeError, ValueError):
        return math.inf
    return max(errors)


def loss_error(ref: list[dict], sub: list[dict]) -> float:
    """Worst relative error of the loss and gradient norm, step by step."""
    if len(ref) != len(sub):
        return math.inf
    errors = [0.0]
    for r, s in zip(ref, sub):
        if not isinstance(s, dict):
            return math.inf
        for key in ("loss", "grad_norm"):
            errors.append(relative_error(s.get(key), r[key], abs(r[key])))
    return max(errors)
