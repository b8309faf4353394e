"""Adversarial A1 submissions against the grader's evidence and points (issue 27), on top of the
reference fix, through the framework of `cases.py`: Part 1 is the whole step's too, and malformed
evidence is wrong evidence."""

from __future__ import annotations

from .cases import MOE_FILE, Case, _on_the_fix

# Exact where the grader checks the layer alone (a model of one MoE layer, pattern "E"), and inside
# a whole model one expert a token instead of top-k: half the expert work, and other training.
EXACT_ALONE_TOP1_IN_THE_MODEL = """
_honest_moe_init, _honest_route = MoE.__init__, TopKRouter.forward


def _init(self, config):
    _honest_moe_init(self, config)
    self.gate.alone = config.hybrid_override_pattern == "E"


def _route(self, x):
    topk_idx, topk_weight = _honest_route(self, x)
    if getattr(self, "alone", True):
        return topk_idx, topk_weight
    return topk_idx[:, :1], topk_weight[:, :1]


MoE.__init__, TopKRouter.forward = _init, _route
"""

# Every answer a rank sends back (JSON, through its pipe's `send_bytes`) has its experts' gradient
# sketches emptied on the way (in this process, where the harness's pipes are the submission's too):
# nothing per expert left to compare.
EMPTIES_EXPERT_EVIDENCE = """
import json as _json
import multiprocessing.connection as _connection

_honest_send_bytes = _connection.Connection.send_bytes


def _send_without_expert_sketches(self, buf, offset=0, size=None):
    try:
        answer = _json.loads(bytes(buf))
    except ValueError:
        return _honest_send_bytes(self, buf, offset, size)
    digests = answer.get("digest") if isinstance(answer, dict) else None
    for digest in digests if isinstance(digests, list) else []:
        for sketches in (digest.get("experts") or {}).values() if isinstance(digest, dict) else []:
            sketches[:] = [[] for _ in sketches]
    return _honest_send_bytes(self, _json.dumps(answer).encode())


_connection.Connection.send_bytes = _send_without_expert_sketches
"""

CASES: list[Case] = [
    # the whole step of the reference layout trains wrongly: Part 1 earns nothing, speed included
    _on_the_fix("exact-layer-top1-in-the-model", MOE_FILE, EXACT_ALONE_TOP1_IN_THE_MODEL,
                r"^wrong: .*; whole step, reference layout: loss and gradient norm", "moe"),
    # each expert's sketch came back empty: infinitely wrong, not nothing to compare
    _on_the_fix("empties-expert-evidence", MOE_FILE, EMPTIES_EXPERT_EVIDENCE,
                r"^wrong: .*worst relative error inf", "moe"),
]
