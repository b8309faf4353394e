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


def _sketch_errors(ref: list, sub: list) -> list[float]:
    """A sketch is projections then the norm (harness `_sketch`): each error relative to the norm."""
    if len(ref) != len(sub):
        return [math.inf]
    return [relative_error(a, b, abs(ref[-1])) for a, b in zip(sub, ref)]


def _moe_digest_error(ref: dict, sub: dict) -> float:
    """Output, input gradient, each expert's gradients on their own (so a gradient in another
    expert's slot, or of the wrong sign, shows), and the totals of every parameter's gradient."""
    try:
        errors = _sketch_errors(ref["out"], sub["out"]) + _sketch_errors(ref["dx"], sub["dx"])
        for projection, experts in ref["experts"].items():
            theirs = sub["experts"][projection]
            if len(theirs) != len(experts):
                return math.inf
            # an expert no token chose has a zero gradient: its error is relative to the largest
            scale = max(abs(e[-1]) for e in experts)
            errors += [relative_error(a, b, scale) for r, t in zip(experts, theirs) for a, b in zip(t, r)]
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
