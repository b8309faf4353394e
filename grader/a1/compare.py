"""A1's comparisons of what a child returns with the starter's, made here in the grader, never
in the child. The child's answer is checked for shape, length and type before any value is
compared: anything missing, extra, of the wrong type or not finite is infinitely wrong."""

from __future__ import annotations

import math
import re


def _number(x) -> float | None:
    """`x` as a finite float, or None when it is anything else (a bool, a string, NaN, inf)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def relative_error(a, b, scale: float) -> float:
    """|a - b| / scale, inf unless both are finite numbers."""
    a, b = _number(a), _number(b)
    if a is None or b is None:
        return math.inf
    error = abs(a - b) / max(abs(scale), 1e-30)
    return error if math.isfinite(error) else math.inf


def _same_length(ref, sub) -> bool:
    return isinstance(sub, list) and len(sub) == len(ref)


def moe_error(ref: list[list[dict]], sub: list[list[dict]]) -> float:
    """Worst relative error between the MoE digests of every workload (a list per workload, a
    digest per forward+backward pass: see harness `MoeSession.step`)."""
    if not _same_length(ref, sub) or not ref:
        return math.inf
    errors = [0.0]
    for ref_workload, sub_workload in zip(ref, sub):
        if not _same_length(ref_workload, sub_workload):
            return math.inf
        errors += [_moe_digest_error(r, s) for r, s in zip(ref_workload, sub_workload)]
    return max(errors)


def _sketch_errors(ref: list, sub, scale: float) -> list[float]:
    """A sketch is projections then the norm (harness `_sketch`): each entry's error relative to
    `scale`."""
    if not _same_length(ref, sub):
        return [math.inf]
    return [relative_error(a, b, scale) for a, b in zip(sub, ref)]


def _moe_digest_error(ref: dict, sub) -> float:
    """Output, input gradient, each expert's gradients and each of the layer's other parameters'
    by the starter's name (so a gradient in another expert's slot or parameter's, or of the wrong
    sign, shows), and the totals of every parameter's gradient.

    Each expert's (each parameter's) gradient is compared on the scale of its own norm, not the
    largest expert's: a rarely routed expert's small gradient must be right too. An expert no
    token chose has a zero gradient, and only zero matches it."""
    if not isinstance(sub, dict) or set(sub) != set(ref):
        return math.inf
    errors = _sketch_errors(ref["out"], sub["out"], ref["out"][-1])
    errors += _sketch_errors(ref["dx"], sub["dx"], ref["dx"][-1])
    experts = sub["experts"]
    if not isinstance(experts, dict) or set(experts) != set(ref["experts"]):
        return math.inf
    for projection, ours in ref["experts"].items():
        theirs = experts[projection]
        if not _same_length(ours, theirs):
            return math.inf
        for r, t in zip(ours, theirs):
            errors += _sketch_errors(r, t, r[-1])
    named = sub["named"]
    if not isinstance(named, dict) or set(named) != set(ref["named"]):
        return math.inf
    for name, r in ref["named"].items():
        errors += _sketch_errors(r, named[name], r[-1])
    if not _same_length(ref["dparams"], sub["dparams"]) or _number(sub["dparams"][0]) != ref["dparams"][0]:
        return math.inf  # not the same number of gradient values
    (_, l1, l2), (_, m1, m2) = ref["dparams"], sub["dparams"]
    # the squared L2 norm is compared on twice its scale: the norm's own relative error
    errors += [relative_error(m1, l1, l1), relative_error(m2, l2, 2 * l2)]
    return max(errors)


def loss_error(ref: list[dict], sub: list[dict]) -> float:
    """Worst relative error of the loss and gradient norm, step by step: a step missing or extra,
    with an entry missing or extra, or without a finite loss and gradient norm is infinitely
    wrong."""
    if not _same_length(ref, sub) or not ref:
        return math.inf
    errors = [0.0]
    for r, s in zip(ref, sub):
        if not isinstance(s, dict) or set(s) != set(r):
            return math.inf
        for key in ("loss", "grad_norm"):
            errors.append(relative_error(s.get(key), r[key], r[key]))
    return max(errors)


def _squared_norm_error(ref, sub) -> float:
    """A squared norm against the starter's, on twice its scale (the norm's own relative error); a
    zero only matches a zero."""
    return relative_error(sub, ref, 2 * ref) if _number(ref) is not None else math.inf


def _projection_error(ref, sub, squared_norm) -> float:
    """A projection on a random direction (harness `OptimizerMoments`) against the starter's, on the
    scale of the starter's norm (the projection's own: E[p^2] = ||m||^2), so that a moment off by e
    of its norm in any direction reads about e, like the norm's error, and one negated 2|p|/||m||,
    about 2|N(0, 1)| on a direction drawn afresh each step (under 1e-3 at one step with odds of
    about 3e-3); a zero only matches a zero."""
    return relative_error(sub, ref, math.sqrt(squared_norm)) if _number(squared_norm) is not None else math.inf


def _readings(ref, sub) -> tuple[tuple, tuple] | None:
    """The starter's and the submission's entry as (squared norm, projection): an entry is
    [squared norm, projection]; records made before the projections hold the squared norm alone
    (projection None). The submission's must have the starter's form; None when it has not."""
    if isinstance(ref, list):
        if not _same_length(ref, sub):
            return None
        return tuple(ref), tuple(sub)
    return None if isinstance(sub, (list, dict)) else ((ref, None), (sub, None))


MOMENTS_READINGS = ("entries", "layers")
# under `layers`, a parameter holding at least this share of its layer's moments is read on its own
# scale too: its sum alone would let it be wrong by as much as the layer's tolerance over its share
OWN_SCALE_SHARE = 0.05
LAYER = re.compile(r"^(.*?\.layers\.\d+\.)")
DIRECTION = " (direction)"  # the name of an entry's projection, beside its squared norm's


def _moments_digest_errors(ref: dict, sub, reading: str = "entries") -> list[tuple[float, str, float, float]] | None:
    """One step's optimizer moments (harness `OptimizerMoments`) entry by entry: (error, what,
    the starter's, the submission's); None when malformed. Each moment is read twice: its squared
    norm (how far the step went), and its projection on a random direction (which way), named
    `<name> (direction)`. `entries`: every parameter by the starter's name and every routed expert's
    up and down projection, each on its own scale.
    `layers` (bfloat16 profiles, where a parameter whose gradient sits at bfloat16's noise, a Mamba
    layer's dt_bias, or a rarely routed expert, reads differently on every run): each layer's
    parameters summed (norms and projections alike: projections of a layer's parameters add up to
    its whole moment's), and its routed experts summed, on their own scale, with each parameter that
    holds OWN_SCALE_SHARE of its layer's on its own scale too; and a parameter stepped on one side
    only (its moment exactly zero on the other) is infinitely wrong."""
    if not isinstance(sub, dict) or set(sub) != {"params", "experts"}:
        return None
    params, experts = sub["params"], sub["experts"]
    if not isinstance(params, dict) or set(params) != set(ref["params"]):
        return None
    if not isinstance(experts, dict) or set(experts) != set(ref["experts"]):
        return None
    entries = [(name, _readings(value, params[name]), False) for name, value in ref["params"].items()]
    for prefix, ours in ref["experts"].items():
        theirs = experts[prefix]
        if not _same_length(ours, theirs):
            return None
        for j, (pair, other) in enumerate(zip(ours, theirs)):
            if not _same_length(pair, other):
                return None
            entries += [(f"{prefix}experts.{j}.{projection}", _readings(a, b), True)
                        for projection, a, b in zip(("up_proj", "down_proj"), pair, other)]
    if any(read is None for _, read, _ in entries):
        return None
    entries = [(name, a, b, routed) for name, (a, b), routed in entries]
    if any(_number(v) is None for _, a, b, _ in entries for v, r in zip(b, a) if r is not None):
        return None
    if reading == "entries":
        return [error for name, a, b, _ in entries for error in _entry_errors(name, a, b)]
    errors = [(math.inf, name, a[0], b[0]) for name, a, b, routed in entries
              if not routed and (a[0] == 0) != (b[0] == 0)]
    projected = all(a[1] is not None for _, a, _, _ in entries)
    sums: dict[str, list[list[float]]] = {}  # group -> [the starter's, the submission's] (squared norm, projection)
    for name, a, b, routed in entries:
        for total, ours in zip(sums.setdefault(_layer_group(name, routed), [[0.0, 0.0], [0.0, 0.0]]), (a, b)):
            total[0] += ours[0]
            total[1] += ours[1] if projected else 0.0
    errors += [error for name, a, b, routed in entries  # the layer's weight
               if not routed and a[0] >= OWN_SCALE_SHARE * sums[_layer_group(name, routed)][0][0]
               for error in _entry_errors(name, a, b)]
    return errors + [error for group, (a, b) in sums.items()
                     for error in _entry_errors(group, (a[0], a[1] if projected else None), b)]


def _entry_errors(name: str, ref: tuple, sub: tuple) -> list[tuple[float, str, float, float]]:
    """The errors of one entry's (squared norm, projection), each as (error, what, the starter's,
    the submission's); the projection's only where the starter's has one."""
    errors = [(_squared_norm_error(ref[0], sub[0]), name, ref[0], sub[0])]
    if ref[1] is not None:
        errors.append((_projection_error(ref[1], sub[1], ref[0]), name + DIRECTION, ref[1], sub[1]))
    return errors


def _layer_group(name: str, routed: bool) -> str:
    """What an entry is summed in under the `layers` reading: its layer's routed experts, or its
    layer's other parameters; outside the layers (embeddings, head, final norm), itself."""
    match = LAYER.match(name)
    if match is None:
        return name
    return match.group(1) + ("routed experts (summed)" if routed else "* (summed)")


def _moments_digest_error(ref: dict, sub, reading: str, directions: bool) -> float:
    errors = _moments_digest_errors(ref, sub, reading)
    return math.inf if errors is None else max((e for e, name, *_ in errors
                                                if name.endswith(DIRECTION) == directions), default=0.0)


def _read_steps(ref: list[dict], sub: list[dict]) -> list[tuple[int, dict, object]]:
    """(step, starter's digest, submission's digest) for each step after which the grader read the
    moments (the session's last: `runner.Child.step`), as the starter's digests show."""
    return [(step, r, s) for step, (r, s) in enumerate(zip(ref, sub)) if isinstance(r.get("moments"), dict)]


def moments_error(ref: list[dict], sub: list[dict], reading: str = "entries", directions: bool = False) -> float:
    """Worst relative error of the optimizer's first moments where they were read (after the last
    step), as `reading` says (`_moments_digest_errors`): the gradients the steps applied, which a
    loss and a global gradient norm only sum up; their norms, or with `directions` their
    projections on random directions. A step missing or extra, or moments missing or malformed, or
    none read, is infinitely wrong."""
    if not _same_length(ref, sub) or not (read := _read_steps(ref, sub)):
        return math.inf
    errors = [0.0]
    for _, r, s in read:
        if not isinstance(s, dict):
            return math.inf
        errors.append(_moments_digest_error(r["moments"], s.get("moments"), reading, directions))
    return max(errors)


def worst_moments(ref: list[dict], sub: list[dict], count: int = 5, reading: str = "entries") -> list[dict]:
    """The `count` entries of the moments farthest from the starter's where they were read (the
    feedback's record of where `moments_error` comes from); nothing when they are malformed."""
    entries = []
    for step, r, s in _read_steps(ref, sub):
        errors = _moments_digest_errors(r["moments"], s.get("moments"), reading) if isinstance(s, dict) else None
        entries += [{"step": step, "name": name, "starter": a, "yours": b, "error": e if math.isfinite(e) else None}
                    for e, name, a, b in errors or []]
    entries.sort(key=lambda entry: -math.inf if entry["error"] is None else -entry["error"])
    return entries[:count]


def moments_names_problem(ref: list[dict], sub: list[dict]) -> str | None:
    """Why the moments could not be compared name by name, in words for the feedback: the
    parameters the submission's step keeps under other names than the starter's."""
    try:
        _, r, s = _read_steps(ref, sub)[-1]
        ours, theirs = set(r["moments"]["params"]), set(s["moments"]["params"])
    except (IndexError, KeyError, TypeError):
        return None
    if ours == theirs:
        return None
    missing, extra = sorted(ours - theirs), sorted(theirs - ours)
    return (f"parameters named otherwise than the starter's (missing {', '.join(missing[:3]) or 'none'}; "
            f"new {', '.join(extra[:3]) or 'none'}): keep the starter's names outside the routed experts")


def moments_direction_problem(ref: list[dict], sub: list[dict], rtol: float, reading: str = "entries") -> str | None:
    """The moments whose projection is off by more than `rtol` while their norm is within it, in
    words for the feedback: a gradient of the right size pointing another way (negated, another
    parameter's, rows swapped); None when there is none."""
    names: list[str] = []
    for _, r, s in _read_steps(ref, sub):
        errors = _moments_digest_errors(r["moments"], s.get("moments"), reading) if isinstance(s, dict) else None
        norms = {name: e for e, name, *_ in errors or [] if not name.endswith(DIRECTION)}
        names += [name for e, direction, *_ in errors or [] if direction.endswith(DIRECTION) and e > rtol
                  and norms.get(name := direction.removesuffix(DIRECTION), math.inf) <= rtol and name not in names]
    if not names:
        return None
    which = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{which}: {'its gradient points' if len(names) == 1 else 'their gradients point'} another way than "
            "the starter's (a sign or a swapped gradient?)")
