"""A1's feedback in words: what an infinite error means, which parameters the comparisons found
off and what that usually means, from what `compare.py` compared. Nothing here scores."""

from __future__ import annotations

import math
import re

from .compare import DIRECTION

INFINITE = ("inf: nothing to put a number on: a value missing, malformed, NaN or infinite, or a gradient or "
            "moment that is zero on one side only")
LOSS_INFINITE = ("inf: a step missing or extra, or a loss or gradient norm that is NaN or infinite (the step "
                 "diverged, or divided by zero)")
# (what a parameter's name matches, what it is, what a missing gradient there usually means)
ROLES = [
    (r"(^|\.)gate\.weight$", "the router (gate.weight)",
     "usually the routing weights (the top-k scores) do not reach the layer's output, or are detached from it"),
    (r"(^|\.)shared_experts\.", "the shared expert", ""),
    (r"(^|\.)experts\.\d+\.|routed experts \(summed\)$", "the routed experts", "usually their gradient is dropped"),
    (r"\.\* \(summed\)$", "the other parameters (summed)", ""),
    (r"\.mixer\.(dt_bias|A_log|D|in_proj|conv1d|out_proj|norm)\b", "a Mamba mixer's {}", ""),
    (r"\.mixer\.[qkvo]_proj\.", "an attention layer", ""),
    (r"\.mixer\.(up|down)_proj\.", "a dense MLP", ""),
    (r"embeddings", "the token embeddings", ""),
    (r"lm_head", "the output head (lm_head)", ""),
]


def role(name: str) -> tuple[str, str]:
    """What the parameter `name` is, in words (the name itself when no role matches), and what a
    missing gradient there usually means ("" when nothing in particular)."""
    for pattern, what, meaning in ROLES:
        if match := re.search(pattern, name):
            return what.format(match.group(match.lastindex or 0)), meaning
    return name, ""


def _layer(name: str) -> str | None:
    match = re.search(r"layers\.(\d+)\.", name)
    return match.group(1) if match else None


def _places(names: list[str]) -> str:
    """" of layers 1, 4 and 7" for the layers the names are in, in order ("" outside any)."""
    layers = sorted({int(layer) for name in names if (layer := _layer(name)) is not None})
    if not layers:
        return ""
    *others, last = map(str, layers)
    return f" of layer{'s' if others else ''} {', '.join(others)}{' and ' if others else ''}{last}"


def moments_in_words(entries: list[dict], top: int = 5) -> str | None:
    """The optimizer moments (`compare.worst_moments`: step, name, starter, yours; worst first) in
    words, each kind of parameter once: every moment zero where the starter's is not (it got no
    gradient) or not zero where the starter's is (a gradient the starter's step does not give),
    then of the `top` worst the others: pointing another way (a wrong sign, scale or parameter),
    or of another size. None when there is nothing to say."""
    said: dict[tuple[str, str], tuple[list[str], str, str]] = {}
    for rank, entry in enumerate(entries):
        name, starter, yours = entry["name"].removesuffix(DIRECTION), entry["starter"], entry["yours"]
        what, meaning = role(name)
        if yours == 0 and starter != 0:
            kind, why = "none", "got no gradient (its moment is 0 where the starter's is not)" + (
                f": {meaning}" if meaning else "")
        elif starter == 0 and yours != 0:
            kind, why = "extra", "got a gradient where the starter's gets none (its moment is not 0, the starter's is)"
        elif rank >= top:
            continue
        elif entry["name"].endswith(DIRECTION):
            kind, why = "direction", "stepped another way than the starter's (a wrong sign, scale or parameter?)"
        else:
            kind, why = "size", f"stepped by another amount (moment {_number(yours)}, the starter's {_number(starter)})"
        said.setdefault((what, kind), ([], what, why))[0].append(name)
    order = {"none": 0, "extra": 1, "direction": 2, "size": 3}  # what explains the rest first
    return "; ".join(f"{what}{_places(names)} {why}" for (_, kind), (names, what, why) in
                     sorted(said.items(), key=lambda item: order[item[0][1]])) or None


def _number(x) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else "none"


def _zero_where_starter_is_not(ref: list, sub) -> bool:
    """A sketch ([projections..., norm]) whose norm is 0 where the starter's is not."""
    return isinstance(sub, list) and bool(sub) and sub[-1] == 0 and ref[-1] != 0


def moe_infinite(ref: list[list[dict]], sub) -> str:
    """Why the MoE layer's comparison (`compare.moe_error`) read inf, in words: a parameter of the
    layer or a routed expert with no gradient where the starter's has one, values that are not
    finite, another number of gradient values, or an answer of another shape."""
    try:
        for ref_workload, sub_workload in zip(ref, sub, strict=True):
            for r, s in zip(ref_workload, sub_workload, strict=True):
                missing = [name for name, sketch in r["named"].items() if _zero_where_starter_is_not(
                    sketch, s["named"].get(name))]
                missing += [f"routed expert {j}" for projection, rows in r["experts"].items()
                            for j, (ours, theirs) in enumerate(zip(rows, s["experts"][projection]))
                            if _zero_where_starter_is_not(ours, theirs)]
                if missing:
                    what, meaning = role(missing[0])
                    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                    return f"inf: {what}{more} got no gradient where the starter's has one" + (
                        f": {meaning}" if meaning else "")
                if not _finite(s):
                    return "inf: NaN or infinite values in your layer's outputs or gradients"
                if s["dparams"][0] != r["dparams"][0]:
                    return (f"inf: your layer's parameters hold {_number(s['dparams'][0])} gradient values, the "
                            f"starter's {_number(r['dparams'][0])}: a parameter gets no gradient, or one more does")
    except (TypeError, KeyError, IndexError, AttributeError, ValueError):
        return "inf: your layer's answer has another shape than the starter's (workloads, experts or entries)"
    return INFINITE


def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
