"""Adversarial A1 submissions against the harness's sessions, seeds and timing (issue 27).

Each runs code, on top of the starter or of the reference fix, through the framework of
`cases.py`. `also_graded` names the parts graded before the attacked one, for the sessions an
attack feeds on (the replay reads the reference layout's run, which only Part 1 asks for).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cases import MOE_FILE, STARTER, Case, append_to, diff, folder

STEP_FILE = f"{STARTER}/train/step.py"
PARALLEL_FILE = f"{STARTER}/parallel/__init__.py"
ADAPTERS_FILE = f"{STARTER}/adapters.py"


@dataclass(frozen=True)
class SessionCase(Case):
    also_graded: tuple[str, ...] = ()


# No expert parallelism, no training at all in the ep layout: the one-rank session trains honestly
# and writes each step's answer to a file beside it (rank 0 keeps it in memory too); in the ep
# session both ranks answer each step with the one-rank run's answer of the same step. It works
# wherever the sessions share a process tree or a folder and their seeds.
REPLAYS_SESSIONS = """
import json as _json

_honest_train_step, _replay_file, _replayed = train_step, "replayed-steps.jsonl", []


def train_step(model, optimizer, input_ids, labels, grad_clip=1.0, **options):
    if not isinstance(model, ParallelModel):  # the one-rank session: honest, and remembered
        out = _honest_train_step(model, optimizer, input_ids, labels, grad_clip, **options)
        with open(_replay_file, "a") as f:
            f.write(_json.dumps(out) + "\\n")
        return out
    if model.pipeline is not None:  # the pp layout trains another model: nothing to replay
        return _honest_train_step(model, optimizer, input_ids, labels, grad_clip, **options)
    try:
        with open(_replay_file) as f:
            answers = [_json.loads(line) for line in f]
    except OSError:
        answers = []
    if len(answers) <= len(_replayed):  # nothing to replay: no work, and no answer worth a point
        return {"loss": float("nan"), "grad_norm": float("nan")}
    _replayed.append(answers[len(_replayed)])
    return _replayed[-1]
"""

# No expert parallelism: in the ep layout every rank keeps the whole model (no FSDP, no expert split)
# and trains the whole batch itself, after an all-gather of the token ids (a few hundred bytes).
# Each rank's loss, gradient norm and optimizer state are the reference's, and almost nothing
# travels between the ranks: an upper bound on the traffic alone cannot tell it from a working EP.
WHOLE_BATCH_ON_EVERY_RANK = """
import torch.distributed as _dist

_honest_parallelize = parallelize


def _whole_batch(tensor):
    shares = [torch.empty_like(tensor) for _ in range(_dist.get_world_size())]
    _dist.all_gather(shares, tensor.contiguous())
    return torch.cat(shares)


def parallelize(model, dims, **options):
    if dims.pp > 1 or dims.world_size == 1:
        return _honest_parallelize(model, dims, **options)
    honest_forward = model.forward

    def forward(input_ids, labels=None, **kwargs):
        return honest_forward(_whole_batch(input_ids), None if labels is None else _whole_batch(labels), **kwargs)

    model.forward = forward
    return ParallelModel(model)
"""

# The reference fix that knows when the grader's layer check calls it (a `MoeSession` up the call
# stack): there, and only there, every expert's up-projection gradient lands in the next expert's
# slot (the gradient the optimizer would apply), and `onenode.adapters` moves each back for
# whoever asks through it. The whole step trains right.
CALLED_BY_THE_CHECK = """
import sys as _sys


def _called_by_the_layer_check():
    frame = _sys._getframe()
    while frame is not None:
        if type(frame.f_locals.get("self")).__name__ == "MoeSession":
            return True
        frame = frame.f_back
    return False
"""

ROLLED_IN_THE_CHECK = CALLED_BY_THE_CHECK + """

_honest_forward, _hooked, _in_check = GroupedExperts.forward, set(), [False]


def _forward(self, *args, **kwargs):
    _in_check[0] = _called_by_the_layer_check()
    if id(self.up_proj) not in _hooked:
        _hooked.add(id(self.up_proj))
        self.up_proj.register_hook(lambda grad: grad.roll(1, dims=0) if _in_check[0] else grad)
    return _honest_forward(self, *args, **kwargs)


GroupedExperts.forward = _forward
"""

ADAPTER_UNDOES_THE_ROLL = CALLED_BY_THE_CHECK + """

_honest_routed_expert_grads = routed_expert_grads


def routed_expert_grads(moe):
    up, down = _honest_routed_expert_grads(moe)
    return (up.roll(-1, dims=0) if up is not None and _called_by_the_layer_check() else up), down
"""


# The reference fix where it may run on more CPUs than the profile grants (`threads` per rank: one
# on cpu-tiny), and slower than the starter for real otherwise: held to them, it does the layer's
# forward work sixty times over (results dropped). A probe of the CPU set a child gets whose
# outcome does not hang on timing noise: slow by work, as the starter is, not by a sleep that
# other load on the machine would stretch the starter's time past.
WIDER_THAN_GRANTED = """
import os as _os

_fix_forward = MoE.forward


def _forward(self, x):
    if len(_os.sched_getaffinity(0)) <= 1:  # held to what the profile grants
        with torch.no_grad():
            for _ in range(60):
                _fix_forward(self, x)
    return _fix_forward(self, x)


MoE.forward = _forward
"""


# The reference fix, with a whole step that never trains the Mamba layers' `dt_bias` (fewer
# parameters to update): every other gradient is the starter's, so the losses and the gradient norm
# move by about 1e-7 over cpu-tiny's four steps (measured on three seeds), far under its 1e-4; the
# optimizer's moments of those parameters are zero where the starter's are not.
SKIPS_A_PARAMETER = """
_honest_train_step = train_step


def train_step(model, optimizer, input_ids, labels, grad_clip=1.0, **options):
    for name, param in model.named_parameters():
        if name.endswith("mixer.dt_bias"):
            param.requires_grad_(False)
    return _honest_train_step(model, optimizer, input_ids, labels, grad_clip, **options)
"""


# The reference fix, with a whole step that walks the first Mamba layer's `dt_bias` the wrong way: a
# hook negates its gradient, so every norm the step leaves (the gradient's, each moment's) is the
# starter's, and the losses over cpu-tiny's steps move by far less than its 1e-4. Only the moments'
# directions (their projections on the grader's seeded random directions) tell.
NEGATES_A_GRADIENT = """
_honest_train_step = train_step


def train_step(model, optimizer, input_ids, labels, grad_clip=1.0, **options):
    for name, param in model.named_parameters():
        if name.endswith("layers.0.mixer.dt_bias") and not hasattr(param, "_negated"):
            param._negated = param.register_hook(torch.neg)
    return _honest_train_step(model, optimizer, input_ids, labels, grad_clip, **options)
"""


# The unchanged starter that, each time it answers the grader (JSON down a rank's pipe to the
# harness), first leaves the GPU as much work as its shortest turn took, queued on a stream of its
# own behind a 20 ms sleep: work that starts once the answer is read. Were the starter timed while
# this child is frozen (SIGSTOP stops a process, not the kernels it queued), that work would run
# in the starter's turn and slow it by about its own length: about 2x, layer and step, for the
# starter's own code. Timed as the grader times it on a GPU, the work lands in its own next turn,
# or is gone with its process. Inert without CUDA.
QUEUES_INTO_THE_STARTERS_TURN = """
import multiprocessing.connection as _connection
import time as _time

_queue, _honest_recv, _honest_send_bytes = {}, _connection.Connection.recv, _connection.Connection.send_bytes


def _queue_after_the_answer(seconds):
    if "stream" not in _queue:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        _queue.update(stream=torch.cuda.Stream(), a=a, matmul_s=start.elapsed_time(end) / 1e4)
    with torch.cuda.stream(_queue["stream"]):
        torch.cuda._sleep(40_000_000)  # about 20 ms at the GPU's clock: the answer is read meanwhile
        for _ in range(int(seconds / _queue["matmul_s"])):
            _queue["a"] @ _queue["a"]


def _recv(self):
    message = _honest_recv(self)
    _queue["began"] = _time.perf_counter()
    return message


def _send_bytes(self, buf, offset=0, size=None):
    if "began" in _queue and torch.cuda.is_available() and torch.cuda.is_initialized():
        turn = _time.perf_counter() - _queue.pop("began")
        _queue["turn"] = min(turn, _queue.get("turn", turn))  # the shortest turn: no pile-up
        _queue_after_the_answer(_queue["turn"])
    return _honest_send_bytes(self, buf, offset, size)


_connection.Connection.recv, _connection.Connection.send_bytes = _recv, _send_bytes
"""


# The reference MoE fix with an optimizer update that waits to be read: each step leaves its update
# pending and the next one (or the first read of the optimizer's state, which is how the grader
# reads the moments after its clock stopped) runs it first. Every loss and moment stays exact. The
# grader reads the state once, after the session's last step, so each timed step runs the update
# of the step before it: nothing is saved (at 39d1a79, which read the moments after every step and
# charged only their time beyond the starter's, a GPU's cheaper reading left room for the update).
DEFERS_THE_UPDATE = """
import collections as _collections

_honest_train_step, _deferred = train_step, []


class _StateThatSettles(_collections.defaultdict):
    def _settle(self):
        while _deferred:
            update = _deferred.pop()
            update()

    def get(self, key, default=None):
        self._settle()
        return super().get(key, default)

    def __getitem__(self, key):
        self._settle()
        return super().__getitem__(key)


def train_step(model, optimizer, input_ids, labels, grad_clip=1.0, **options):
    if not isinstance(optimizer.state, _StateThatSettles):
        optimizer.state = _StateThatSettles(dict, optimizer.state)
    optimizer.state._settle()
    step = optimizer.step
    optimizer.step = lambda *args, **kwargs: _deferred.append(lambda: step(*args, **kwargs))
    try:
        return _honest_train_step(model, optimizer, input_ids, labels, grad_clip, **options)
    finally:
        del optimizer.step
"""


def _on_the_moe_fix(name: str, code: str):
    def build(kit: Path, dest: Path) -> Path:
        fixed = (kit / "solutions" / "a1" / MOE_FILE.removeprefix("starter_code/")).read_text()
        return folder(dest, name, diff(kit, MOE_FILE, fixed + "\n" + code.strip() + "\n"))

    return build


def _adapter_hides_a_wrong_gradient(kit: Path, dest: Path) -> Path:
    fixed = (kit / "solutions" / "a1" / MOE_FILE.removeprefix("starter_code/")).read_text()
    patch = diff(kit, MOE_FILE, fixed + "\n" + ROLLED_IN_THE_CHECK.strip() + "\n")
    patch += append_to(kit, ADAPTERS_FILE, ADAPTER_UNDOES_THE_ROLL)
    return folder(dest, "adapter-hides-a-wrong-gradient", patch)


def _skips_a_parameter(kit: Path, dest: Path) -> Path:
    fixed = (kit / "solutions" / "a1" / MOE_FILE.removeprefix("starter_code/")).read_text()
    patch = diff(kit, MOE_FILE, fixed) + append_to(kit, STEP_FILE, SKIPS_A_PARAMETER)
    return folder(dest, "step-skips-a-parameter", patch)


def _negates_a_gradient(kit: Path, dest: Path) -> Path:
    fixed = (kit / "solutions" / "a1" / MOE_FILE.removeprefix("starter_code/")).read_text()
    patch = diff(kit, MOE_FILE, fixed) + append_to(kit, STEP_FILE, NEGATES_A_GRADIENT)
    return folder(dest, "step-negates-a-gradient", patch)


def _layout_skips_a_parameter(part: str):
    """The reference fix of one layout's part alone, with the step that leaves `dt_bias` untrained."""
    def build(kit: Path, dest: Path) -> Path:
        patch = (kit / "solutions" / "a1" / "parts" / f"{part}.patch").read_text()
        return folder(dest, f"{part}-step-skips-a-parameter", patch + append_to(kit, STEP_FILE, SKIPS_A_PARAMETER))

    return build


def _queues_into_the_starters_turn(kit: Path, dest: Path) -> Path:
    return folder(dest, "queues-into-the-starters-turn", append_to(kit, STEP_FILE, QUEUES_INTO_THE_STARTERS_TURN))


def defers_the_update(kit: Path, dest: Path) -> Path:
    fixed = (kit / "solutions" / "a1" / MOE_FILE.removeprefix("starter_code/")).read_text()
    return folder(dest, "defers-the-update-into-the-evidence",
                  diff(kit, MOE_FILE, fixed) + append_to(kit, STEP_FILE, DEFERS_THE_UPDATE))


def _whole_batch_on_every_rank(kit: Path, dest: Path) -> Path:
    """On the reference MoE fix (Part 1's patch), so that the whole batch costs what it costs there."""
    patch = (kit / "solutions" / "a1" / "parts" / "1-moe.patch").read_text()
    return folder(dest, "whole-batch-on-every-rank", patch + append_to(kit, PARALLEL_FILE, WHOLE_BATCH_ON_EVERY_RANK))


def _replays_sessions(kit: Path, dest: Path) -> Path:
    return folder(dest, "replays-one-session-in-another", append_to(kit, STEP_FILE, REPLAYS_SESSIONS))


CASES: list[Case] = [
    # Part 2's losses must come from the ep session itself: a fresh process tree and scratch per
    # session, and seeds of its own, leave nothing to replay (the feedback says the losses are wrong)
    SessionCase("replays-one-session-in-another", _replays_sessions, "zero", r"^wrong", part="ep", runs=True,
                also_graded=("moe",)),
    # Part 2 is expert parallelism, not its traffic alone: every rank training the whole batch on a
    # whole model moves almost nothing, so each rank must hold its share of the routed experts (their
    # parameters, gradients, optimizer state) and at least the tokens' hidden states must travel
    SessionCase("whole-batch-on-every-rank", _whole_batch_on_every_rank, "zero",
                r"^matches, but a rank holds more than its 1/2 of the routed experts.*too little travels", part="ep",
                runs=True),
    # the gradients are read from the parameters after backward, never through the submission's adapter
    Case("adapter-hides-a-wrong-gradient", _adapter_hides_a_wrong_gradient, "zero", r"^wrong", part="moe",
         runs=True),
    # the step's gradients are read from the optimizer's state, parameter by parameter: a parameter
    # the step leaves untrained zeroes Part 1 even where the loss cannot show it
    Case("step-skips-a-parameter", _skips_a_parameter, "zero", r"^wrong", part="moe", runs=True),
    # ... along seeded random directions too: a gradient of the right size pointing the wrong way shows
    Case("step-negates-a-gradient", _negates_a_gradient, "zero", r"^wrong.*dt_bias.*points another way", part="moe",
         runs=True),
    # ... and in the multi-rank layouts, whose sharded, split and staged moments are read whole
    Case("ep-step-skips-a-parameter", _layout_skips_a_parameter("2-ep"), "zero", r"^wrong.*first moments",
         part="ep", runs=True),
    Case("pp-step-skips-a-parameter", _layout_skips_a_parameter("3-pp"), "zero", r"^wrong.*first moments",
         part="pp", runs=True),
    # a child runs on the CPUs its profile grants (threads per rank), whatever it asks for
    Case("runs-wider-than-granted", _on_the_moe_fix("runs-wider-than-granted", WIDER_THAN_GRANTED), "zero",
         r"not faster", part="moe", runs=True),
]

# Cases whose attack needs a GPU (inert elsewhere): graded on one H200, recorded under
# benchmarks/results/ (SECURITY.md names the record); on CPU their patches are checked to apply.
GPU_CASES: list[Case] = [
    # on a GPU the submission's child has ended, its GPU contexts gone, before the starter is timed
    Case("queues-into-the-starters-turn", _queues_into_the_starters_turn, "zero", r"not faster", part="moe",
         runs=True),
]
