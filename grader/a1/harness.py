"""The grader's harness: runs INSIDE the sandboxed child and drives the patched `onenode`.

Self-contained on purpose (copied next to the scratch tree and run as a script, with the kit's
own `a1_infra/tests/collectives.py` beside it): it imports nothing from `grader`, and the
student's `onenode` comes from the scratch copy on PYTHONPATH, which `_check_onenode` verifies.
Everything it says is untrusted: the parent only compares the numbers it returns with the
unpatched starter's, run through this same harness.

Protocol, one JSON object per line. The parent first sends the child's setup (`world`,
`threads`, `device`, `tree`, and `confine`: the parts of `confine.py` each rank applies, None for
a single rank); the harness starts `world` ranks (it never imports torch itself).
Then sessions, one after another: `{"session": spec}` is answered `{"ready": info}` or
`{"error": ...}`; for each workload the parent starts its clock, sends `{"seed": s}`, and stops
the clock on the answer `{"digest": ...}`: the inputs exist only from that moment. A training
session is asked `{"evidence": true}` after its last workload and answers `{"evidence": ...}` (the
optimizer's moments, the experts each rank holds), on a clock of its own: no step's time holds the
reading, and since every scored step follows another one, work a step leaves for later is paid
for by the next step (none can hide in the reading, which no scored step follows). Closing
stdin ends the child. After an error the parent discards the child. `{"release": true}` drops
the session (and its GPU memory) and is answered `{"released": true}`: the starter's child waits
so between the submissions it is timed beside. A submission's child serves one session only
(`grader/runner.py`): nothing of one session is left for the next.

Sessions: "moe" runs one MoE layer forward+backward on `tokens` random tokens (rank 0 only);
"train" runs optimizer steps of the whole model on 1 rank or on all (gloo or NCCL).
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import socket
import stat
import sys
import traceback
from pathlib import Path

from collectives import CollectiveCounter  # noqa: E402  (a1_infra/tests/collectives.py, copied beside this file)

if __package__:  # imported as grader.a1.harness (its tests, the import checks)
    from .confine import ConfineError, confine_rank
else:  # run as a script in the child: grader/a1/confine.py is copied beside this file
    from confine import ConfineError, confine_rank


def _check_onenode(tree: str) -> str:
    """Fail unless every imported `onenode` module comes from the scratch copy."""
    import onenode

    root = Path(tree).resolve()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "onenode" or name.startswith("onenode.")) and path and root not in Path(path).resolve().parents:
            raise RuntimeError(f"{name} was imported from {path}, not from the scratch copy {root}")
    return onenode.__file__


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _config(spec: dict, overrides: dict):
    from onenode.model import get_preset

    return get_preset(spec["preset"], **overrides)


def _build(spec: dict, config, device, rank: int = 0):
    """The model with the reference weights (`_load_reference`), built in the spec's dtype."""
    from onenode.model import build_model

    model = build_model(config, seed=spec["init_seed"], device=device, dtype=_dtype(spec["dtype"]))
    return model, _load_reference(spec, model, rank)


def _load_reference(spec: dict, model, rank: int = 0) -> dict:
    """Give `model` the reference weights, and return them in the starter's layout: the starter
    saves its own (rank 0), a submission loads them through `adapt_state_dict`, so stacked experts
    get exactly the starter's values."""
    import torch

    if spec.get("weights_in"):
        from onenode.model.hf_io import adapt_state_dict

        state = torch.load(spec["weights_in"], map_location="cpu", mmap=True, weights_only=True)
        model.load_state_dict(adapt_state_dict(state, model))
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if spec.get("weights_out") and rank == 0:
        torch.save(state, spec["weights_out"])
    return state


class ExpertSlots:
    """Where a MoE layer keeps each routed expert's projections, found by value: the parameter (and
    its row, for stacked experts; transposed or not) that holds the starter's weights of that
    expert, as loaded. The gradients are then read from those parameters after backward, as the
    optimizer sees them, never through a function of the submission's."""

    LAYOUT = {"up": "up_proj", "down": "down_proj"}  # the starter's expert j: experts.{j}.<name>.weight

    def __init__(self, layer, state: dict, prefix: str, experts: int, whole: bool = True):
        """`whole`: every expert must be in `layer` (one process); else a rank may hold some of
        them (expert parallelism: the ranks' slots are merged by `OptimizerMoments`), and an
        expert it does not hold has the slot None. A sharded parameter is read whole (a
        collective: every rank of its mesh builds the same layer in the same order)."""
        import torch

        candidates: dict[tuple, list] = {}  # (shape, first values) -> [(param, row, transposed)]
        values = {}
        for param in layer.parameters():
            data = values[id(param)] = _whole(param.detach())
            rows = [(None, data)] if data.dim() == 2 else list(enumerate(data)) if data.dim() == 3 else []
            for row, tensor in rows:
                for transposed, view in ((False, tensor), (True, tensor.T)):
                    candidates.setdefault(self._key(view), []).append((param, row, transposed))
        self.slots = {}
        for projection, name in self.LAYOUT.items():
            self.slots[projection] = []
            for j in range(experts):
                weight = state[f"{prefix}experts.{j}.{name}.weight"]
                found = [(param, row, transposed) for param, row, transposed in candidates.get(self._key(weight), [])
                         if torch.equal(self._view(values[id(param)], row, transposed),
                                        weight.to(param.device, param.dtype))]
                if not found and whole:
                    raise RuntimeError(expert_missing(j, name, tuple(weight.shape), experts))
                self.slots[projection].append(found[0] if found else None)

    @staticmethod
    def _key(tensor) -> tuple:
        return tuple(tensor.shape), tuple(float(v) for v in tensor[0, :8].tolist())

    @staticmethod
    def _view(tensor, row, transposed):
        tensor = tensor if row is None else tensor[row]
        return tensor.T if transposed else tensor

    def grads(self):
        """(up [E, I, H], down [E, H, I]) gradients in the starter's layout; the None gradient of
        an expert no token chose reads as zeros."""
        import torch

        return tuple(torch.stack([self._view(param.grad if param.grad is not None else torch.zeros_like(param), row,
                                             transposed) for param, row, transposed in slots])
                     for slots in self.slots.values())


def expert_missing(j: int, name: str, shape: tuple, experts: int) -> str:
    return (f"expert {j}'s {name} was not found among the MoE layer's parameters: keep each expert's weights, as "
            f"loaded, in a parameter of their own {shape} or in row {j} of a stacked one ({experts}, ...)")


def _whole(tensor):
    """A sharded tensor's full value (a collective over its mesh), any other as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _sketch(t, *directions) -> list[float]:
    """Projections of `t` on random directions, and its norm: equal up to rounding iff t is."""
    flat = t.detach().double().flatten()
    return [float(flat @ d.double().flatten()) for d in directions] + [float(flat.norm())]


def _sketch_rows(t, direction) -> list[list[float]]:
    """`_sketch` of each row t[j] (each expert) on direction[j], in a few vectorised float32 ops
    and one copy to the host: cheap enough to sit inside the timed workload beside the layer."""
    import torch

    rows, along = t.detach().float().flatten(1), direction.flatten(1)
    both = torch.stack([(rows * along).sum(1), rows.norm(dim=1)], dim=1)
    return both.double().tolist()


def _grad_norms(grads: list) -> list[float]:
    """Count, L1 norm and squared L2 norm of all values: independent of layout (a stacked
    [E, I, H] weight and E separate [I, H] weights hold the same values), and cheap."""
    import torch

    l1 = torch.stack(torch._foreach_norm(grads, 1)).double().sum()
    l2 = torch.stack(torch._foreach_norm(grads, 2)).double().square().sum()
    return [float(sum(g.numel() for g in grads)), float(l1), float(l2)]


class MoeSession:
    """Part 1: one MoE layer (the only layer of a pattern-"E" model) forward and backward."""

    def __init__(self, spec: dict):
        import torch

        self.spec = spec
        self.device = torch.device(spec["device"])
        config = _config(spec, {**spec["moe"].get("overrides", {}), "hybrid_override_pattern": "E"})
        self.model, state = _build(spec, config, self.device)
        # The grader's float32 reference computes with the stored (e.g. bfloat16) weights and
        # inputs upcast, so a bfloat16 submission is compared with exact arithmetic, not with
        # the starter's own rounding.
        self.dtype = _dtype(spec.get("compute_dtype", spec["dtype"]))
        self.layer = self.model.backbone.layers[0].mixer
        if "compute_dtype" in spec:
            self.layer.to(self.dtype)
        self.experts = ExpertSlots(self.layer, state, "backbone.layers.0.mixer.", config.n_routed_experts)
        in_slots = {id(slot[0]) for column in self.experts.slots.values() for slot in column}
        # the layer's other parameters (router, shared experts): (the starter's name, it, the starter's shape)
        self.named = sorted((name, p, tuple(state.get(f"backbone.layers.0.mixer.{name}", p).shape))
                            for name, p in self.layer.named_parameters() if id(p) not in in_slots)
        self.shape = (1, spec["moe"]["tokens"], config.hidden_size)

    def info(self) -> dict:
        return {"parameters": sum(p.numel() for p in self.layer.parameters())}

    def step(self, seed: int) -> list[dict]:
        """`iters` forward+backward passes on inputs drawn from `seed` (several per workload, so
        the round trip through the pipes is a small part of what the grader times), each one
        checked. Expert gradients are sketched expert by expert, read from the parameters that
        hold each expert (`ExpertSlots`), and the layer's other parameters' by name: a gradient in
        another expert's slot or parameter's, or with its sign flipped, shows."""
        import torch

        gen = torch.Generator(self.device).manual_seed(seed)
        stored = _dtype(self.spec["dtype"])
        along = {name: torch.randn(shape, generator=_generator(seed, name, self.device), device=self.device)
                 for name, _, shape in self.named}
        digests = []
        for _ in range(self.spec["moe"].get("iters", 1)):
            x, grad_out, probe = (torch.randn(self.shape, generator=gen, device=self.device).to(stored).to(self.dtype)
                                  for _ in range(3))
            x.requires_grad_(True)
            y = self.layer(x)
            y.backward(grad_out)
            experts = {}
            for name, grad in zip(("up", "down"), self.experts.grads()):
                direction = torch.randn(grad.shape, generator=gen, device=self.device)
                experts[name] = _sketch_rows(grad, direction)
            named = {name: _sketch(_in_shape(p.grad if p.grad is not None else torch.zeros_like(p), shape), along[name])
                     for name, p, shape in self.named}
            params = [p for p in self.layer.parameters() if p.grad is not None]
            digests.append({
                "out": _sketch(y, grad_out, probe),
                "dx": _sketch(x.grad, grad_out, probe),
                "experts": experts,
                "named": named,
                "dparams": _grad_norms([p.grad for p in params]),
            })
            for p in params:
                p.grad = None
        return digests


def _generator(seed: int, name: str, device):
    """A generator on `device` seeded from the workload's `seed` and `name` (Python's `hash` is
    salted per process): the same values in every child and on every rank of a job, whose GPUs are
    of one kind (a CUDA generator's values follow the device's multiprocessor count), drawn on the
    device of what they are for, in a few kernels: they sit inside the timed workload."""
    import hashlib

    import torch

    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _in_shape(tensor, shape: tuple):
    """A parameter's moment or gradient in the starter's `shape` (the same values in the same order)."""
    if tensor.numel() != math.prod(shape):
        raise RuntimeError(f"a parameter of shape {tuple(tensor.shape)} is kept under the name of the starter's of "
                           f"shape {shape}: keep the starter's parameters (their values) under its names")
    return tensor if tuple(tensor.shape) == shape else tensor.reshape(shape)


def _project(t, factors):
    """<t, the outer product of `factors`> (one per dimension of t), the last dimension contracted
    first: one pass over t. With factors of independent standard normal values, E[p^2] = ||t||^2, as
    on a dense random direction, at the cost of sum(shape) random values instead of numel."""
    t = t.float()
    for factor in reversed(factors):
        t = t @ factor
    return t


class OptimizerMoments:
    """The step's gradients as the optimizer took them, read from its state after the step: each
    parameter's AdamW first moment (after the first step, the clipped gradient times 1 - beta1),
    keyed by the starter's name, and each routed expert's, found by value as `ExpertSlots` finds
    it, as [its squared norm, its projection on a random direction]. The training path itself fills
    that state; the grader asks nothing of it. A parameter the optimizer did not step reads as zero.

    The norm says how far a parameter stepped, the projection which way: a gradient negated, or
    another parameter's of the same size, keeps every norm. Each direction is drawn from the
    workload's seed and the parameter's (the expert's) starter name, in the starter's layout (a
    parameter of another shape is read reshaped to the starter's), fresh every step, the same in
    the starter's child and the submission's; an outer product of one random vector per dimension,
    drawn where the moment is, so that it costs a few random values and one pass over the moment
    (`_project`) inside the timed step.

    Over several ranks the reading is the same whatever the layout: a sharded moment is read
    shard by shard (each rank's part of the norm, and its part of the projection on its slice of the
    direction, summed over the ranks), a pipeline stage gives the parameters it holds (their names
    are the whole model's), an expert is read where a rank holds it, and the ranks' readings are
    merged in one gather per step, so a layout reads as one rank would."""

    WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")

    def __init__(self, model, state: dict, config, world: int = 1):
        import re

        self.world = world
        self.count = config.n_routed_experts
        modules = model.stage_modules if hasattr(model, "stage_modules") else [model]
        self.experts = {}
        for module in modules:
            for name, layer in module.named_modules():
                prefix = self.plain(name) + "."
                if (re.fullmatch(r"backbone\.layers\.\d+\.mixer\.", prefix) and prefix not in self.experts
                        and f"{prefix}experts.0.up_proj.weight" in state):
                    self.experts[prefix] = ExpertSlots(layer, state, prefix, self.count, whole=world == 1)
        in_slots = {id(slot[0]) for slots in self.experts.values() for column in slots.slots.values()
                    for slot in column if slot is not None}
        self.params = {}
        for module in modules:
            for name, param in module.named_parameters():
                if id(param) not in in_slots:
                    self.params.setdefault(self.plain(name), param)
        # the starter's layout, the directions': each parameter's shape, each expert projection's
        self.shapes = {name: tuple(state[name].shape) if name in state else tuple(param.shape)
                       for name, param in self.params.items()}
        self.shapes.update({f"{prefix}experts.{name}": tuple(state[f"{prefix}experts.0.{name}.weight"].shape)
                            for prefix in self.experts for name in ExpertSlots.LAYOUT.values()})

    @classmethod
    def plain(cls, name: str) -> str:
        for wrapper in cls.WRAPPERS:
            name = name.replace(wrapper, "")
        return name

    @staticmethod
    def _moment(optimizer, param, shape: tuple):
        """(the first moment in the starter's `shape`, or the shard of it this rank holds; None where
        the rank holds it whole, else the share of the shard's readings that is this rank's: 1 / its
        replicas; the shard's offset in the whole), or None where the optimizer keeps none. A sharded
        parameter without one reads as zeros; one of another shape than the starter's is read whole,
        a collective every rank of its mesh takes part in."""
        import torch
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        moment = optimizer.state.get(param, {}).get("exp_avg")
        corner = (0,) * len(shape)
        if not isinstance(param, DTensor):
            return None if moment is None else (_in_shape(moment, shape), None, corner)
        if moment is None:
            moment = torch.zeros_like(param)
        if tuple(moment.shape) != shape:
            return _in_shape(moment.full_tensor(), shape), None, corner
        replicas = math.prod(moment.device_mesh.size(dim) for dim, placement in enumerate(moment.placements)
                             if placement.is_replicate())
        _, offset = compute_local_shape_and_global_offset(moment.shape, moment.device_mesh, moment.placements)
        return moment.to_local(), 1.0 / replicas, tuple(offset)

    @staticmethod
    def _expert_moment(optimizer, param, whole: dict):
        """The first moment of a parameter that holds routed experts, whole (a sharded one gathered
        once per step, `whole`: a collective every rank of its mesh takes part in, zeros where the
        optimizer keeps none), or None where the optimizer keeps none."""
        import torch
        from torch.distributed.tensor import DTensor

        moment = optimizer.state.get(param, {}).get("exp_avg")
        if not isinstance(param, DTensor):
            return moment
        if id(param) not in whole:
            whole[id(param)] = (moment if moment is not None else torch.zeros_like(param)).full_tensor()
        return whole[id(param)]

    def digest(self, optimizer, seed: int) -> dict:
        """{"params": {name: [squared norm, projection]}, "experts": {prefix: [[up, down] per expert]}},
        each projection on a direction drawn from `seed`; over several ranks each entry is first
        [[squared norm, projection], whether it is a shard's part], merged."""
        import torch

        whole: dict = {}
        readings = []  # (the tensor whose norm is read, its projection), one per moment read

        def read(tensor, projection, share) -> tuple:
            readings.append((tensor, projection))
            return len(readings) - 1, share

        params = {}
        for name, param in self.params.items():
            moment = self._moment(optimizer, param, self.shapes[name])
            if moment is None:
                params[name] = None
                continue
            tensor, share, offset = moment
            tensor = tensor.reshape(tensor.shape or (1,))
            gen = _generator(seed, name, tensor.device)  # the whole direction's factors, then this shard's slice
            factors = [torch.randn(n, generator=gen, device=tensor.device)[start:start + size]
                       for n, start, size in zip(self.shapes[name] or (1,), offset or (0,), tensor.shape)]
            params[name] = read(tensor, _project(tensor, factors), share)
        experts: dict[str, list] = {}  # prefix -> [up, down] -> per expert: None where this rank holds none
        for prefix, slots in self.experts.items():
            for name, column in zip(ExpertSlots.LAYOUT.values(), slots.slots.values()):
                views, projections = self._expert_readings(optimizer, column, seed, f"{prefix}experts.{name}", whole)
                experts.setdefault(prefix, []).append([None if view is None else read(view, projection, None)
                                                       for view, projection in zip(views, projections)])
        if readings:
            norms = torch.stack(torch._foreach_norm([t for t, _ in readings], 2, dtype=torch.float32)).double()
            values = torch.stack([norms.square(), torch.stack([p for _, p in readings]).double()], 1).tolist()

        def entry(index):
            """(index, share) of a reading, or None: a moment the optimizer keeps none of."""
            sq, projection, share = (0.0, 0.0, None) if index is None else (*values[index[0]], index[1])
            value = [sq * (share or 1.0), projection * (share or 1.0)]
            return value if self.world == 1 else [value, share is not None]

        per_expert = {prefix: [[None if up is None else entry(up), None if down is None else entry(down)]
                               for up, down in zip(ups, downs)] for prefix, (ups, downs) in experts.items()}
        reading = {"params": {name: entry(index) for name, index in params.items()}, "experts": per_expert}
        return reading if self.world == 1 else self._merged(reading)

    def _expert_readings(self, optimizer, column: list, seed: int, name: str, whole: dict) -> tuple[list, list]:
        """Each expert's first moment of one projection `name` in the starter's layout (a view; None
        where this rank does not hold the expert; zeros where the optimizer keeps none), and its
        projection on its direction: the outer product of its rows of two random matrices drawn for
        `name` (so an expert reads alike wherever a rank holds it). The experts held in one
        parameter (stacked) are projected in one batched pass over it."""
        import torch

        views, projections = [None] * len(column), [None] * len(column)
        groups: dict[tuple, tuple] = {}  # (id(parameter), transposed) -> (its moment, [(expert, row)])
        for j, slot in enumerate(column):
            if slot is None:
                continue
            param, row, transposed = slot
            moment = self._expert_moment(optimizer, param, whole)
            if moment is None:
                moment = torch.zeros_like(param)
            groups.setdefault((id(param), transposed), (moment, []))[1].append((j, row))
            view = moment if row is None else moment[row]
            views[j] = view.T if transposed else view
        if not groups:
            return views, projections
        device = next(iter(groups.values()))[0].device
        gen = _generator(seed, name, device)
        along_rows, along_cols = (torch.randn(self.count, n, generator=gen, device=device) for n in self.shapes[name])
        for (_, transposed), (moment, experts) in groups.items():
            if len(experts) == 1:  # an expert's own parameter (the starter's layout): two small products
                j = experts[0][0]
                projections[j] = _project(views[j], [along_rows[j], along_cols[j]])
                continue
            js, rows = [j for j, _ in experts], [row for _, row in experts]
            u = torch.zeros(len(moment), along_rows.shape[1], device=moment.device)
            v = torch.zeros(len(moment), along_cols.shape[1], device=moment.device)
            u[rows], v[rows] = along_rows[js], along_cols[js]
            first, second = (u, v) if transposed else (v, u)  # the dimension stored last is contracted first
            sums = ((moment.float() @ first.unsqueeze(-1)).squeeze(-1) * second).sum(-1)
            for j, row in zip(js, rows):
                projections[j] = sums[row]
        return views, projections

    def _merged(self, reading: dict) -> dict:
        """Every rank's reading as one: a shard's parts summed over the ranks, anything held whole
        from the ranks that hold it, which must agree (replicas that do not read as NaN, so
        infinitely wrong: one rank cannot train for the others), each expert's projection where
        a rank holds it (none: the layout lost it)."""
        def add(ours, theirs):
            if theirs is None:
                return ours
            value, part = theirs
            if part:
                return value if ours is None else [a + b for a, b in zip(ours, value)]
            (sq, projection), scale = value, math.sqrt(max(value[0], (ours or value)[0]))
            if ours is None or (math.isclose(ours[0], sq, rel_tol=1e-6)
                                and math.isclose(ours[1], projection, rel_tol=1e-6, abs_tol=1e-6 * scale)):
                return value
            return [math.nan, math.nan]

        params, experts = {}, {}
        for theirs in gathered(reading):
            for name, value in theirs["params"].items():
                params[name] = add(params.get(name), value)
            for prefix, pairs in theirs["experts"].items():
                ours = experts.setdefault(prefix, [[None, None] for _ in pairs])
                for j, pair in enumerate(pairs):
                    ours[j] = [add(a, b) for a, b in zip(ours[j], pair)]
        for prefix, pairs in experts.items():
            for j, pair in enumerate(pairs):
                for value, name in zip(pair, ExpertSlots.LAYOUT.values()):
                    if value is None:
                        raise RuntimeError(f"{prefix}: " + expert_missing(j, name, (), self.count) + " on some rank")
        return {"params": dict(sorted(params.items())), "experts": dict(sorted(experts.items()))}


def gathered(value) -> list:
    """`value` from every rank of the default group."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class TrainSession:
    """Parts 2 and 3 (and Part 1's whole step): optimizer steps of the whole model in one parallel
    layout, assembled by the submission's own `onenode.train.assembly.assemble` from the recipe the
    grader sends (the profile's, which its handout's `onenode bench` command runs too): the step
    timed is the step a student benches. The batches are the grader's, drawn from its seeds."""

    routes = None  # with `count_routes`: the step's (token, other ep rank) pairs, on the device

    def __init__(self, spec: dict, rank: int, counter: CollectiveCounter):
        import torch

        self.spec, self.rank, self.counter = spec, rank, counter
        layout = dict(spec["layout"])
        self.world = layout.pop("world")
        self.dp, self.pp = layout["dp"], layout["pp"]
        if spec["device"] == "cuda":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            self.device = torch.device("cpu")
        from onenode.train.assembly import assemble
        from onenode.train.recipe import from_dict

        recipe = from_dict(spec["recipe"])
        state = {}
        self.run = assemble(recipe, device=self.device,
                            init_weights=lambda model: state.update(_load_reference(spec, model, rank)))
        self.config = self.run.config
        self.model, self.optimizer = self.run.parallel, self.run.optimizer
        with counter.paused():  # reading sharded weights whole is the grader's traffic, not the layout's
            self.moments = OptimizerMoments(self.model, state, self.config, self.world)

    def info(self) -> dict:
        """Bytes of parameters this rank holds (shards, not the full tensors), and how the recipe
        was laid out."""
        from torch.distributed.tensor import DTensor

        held = 0
        params = self.model.parameters() if hasattr(self.model, "parameters") else []
        for p in params:
            local = p.to_local() if isinstance(p, DTensor) else p
            held += local.numel() * local.element_size()
        return {"param_bytes": held, "recipe": self.run.recipe.to_dict()}

    def count_routes(self) -> None:
        """From now on, count in each forward the tokens this rank's routers send to an expert that
        another rank of its ep group holds, the experts split over the group in contiguous blocks
        (rank i of the group holding experts [i * E / ep, (i + 1) * E / ep)): once per (token, such
        rank), the least a token dispatch must move, and each router once a step (a forward
        recomputed for backward is not counted again). Run on the starter's ep layout (its routers
        are pristine and route the batch as a correct layout does); each step's digest reports it."""
        import re

        import torch

        ep = self.spec["layout"]["ep"]
        mine, block = self.rank % ep, self.config.n_routed_experts // ep  # ranks are (pp, dp_mod_ep, ep), ep fastest
        self.routes = torch.zeros((), dtype=torch.int64, device=self.device)
        self.routed: set[int] = set()  # the routers counted this step

        def count(module, args, output):
            if id(module) in self.routed:
                return
            self.routed.add(id(module))
            owners = output[0] // block  # the router's (topk_idx, topk_weight): [tokens, k] -> owner rank
            reached = torch.zeros(owners.shape[0], ep, dtype=torch.bool, device=owners.device).scatter_(1, owners, True)
            reached[:, mine] = False
            self.routes += reached.sum()

        for name, module in self.model.named_modules():
            if re.fullmatch(r"backbone\.layers\.\d+\.mixer\.gate", OptimizerMoments.plain(name)):
                module.register_forward_hook(count)

    def take_routes(self) -> int | None:
        """The routes counted in the step just taken, then reset (None without `count_routes`)."""
        if self.routes is None:
            return None
        routes = int(self.routes)
        self.routes.zero_()
        self.routed.clear()
        return routes

    def experts_held(self) -> list[int]:
        """After the last step, for the parent's Part 2 checks: the elements of the routed experts
        this rank holds (their parameters, gradients, optimizer state): part of `evidence`.

        The parameters are those `ExpertSlots` found holding the loaded experts' values (a shard
        counts its local part only); the optimizer state is every tensor the optimizer keeps for them
        but its scalar step counts."""
        import torch
        from torch.distributed.tensor import DTensor

        def local(tensor) -> int:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                return 0
            return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()

        params = {id(slot[0]): slot[0] for slots in self.moments.experts.values() for column in slots.slots.values()
                  for slot in column if slot is not None}
        held = [0, 0, 0]
        for param in params.values():
            held[0] += local(param)
            held[1] += local(param.grad)
            held[2] += sum(local(value) for value in self.optimizer.state.get(param, {}).values())
        return held

    def step(self, seed: int) -> dict:
        """One optimizer step on this rank's share of a batch made from `seed` on every rank: the
        timed work. Its loss, gradient norm, the bytes its collectives moved and its routes come
        back with it; the optimizer's state is read by `evidence`, after the session's last step."""
        import torch

        self.last_seed = seed  # the evidence's directions are drawn from it
        gen = torch.Generator("cpu").manual_seed(seed)
        tokens = torch.randint(0, self.config.vocab_size, (self.spec["batch"], self.spec["seq_len"] + 1), generator=gen)
        # Ranks are laid out (pp, dp), dp fastest: each pipeline stage sees the whole dp shard.
        dp_rank = self.rank % self.dp
        rows = self.spec["batch"] // self.dp
        shard = tokens[dp_rank * rows:(dp_rank + 1) * rows].to(self.device)
        self.counter.take()
        inputs, labels = shard[:, :-1].contiguous(), shard[:, 1:].contiguous()
        out = self.run.step(inputs, labels)
        moved = self.counter.take()
        loss = out["loss"]
        if self.world > 1:  # the mean over the ranks that computed a loss (last pipeline stage)
            from onenode.parallel.distributed import mean_over_ranks

            with self.counter.paused():
                loss = mean_over_ranks(loss, self.device)
        return {"loss": loss, "grad_norm": out.get("grad_norm"), "bytes": moved, "routes": self.take_routes()}

    def evidence(self) -> dict:
        """The optimizer's first moments after the session's last step (`OptimizerMoments`), what the
        layout noted (CUDA graphs a tree could not use) and the routed experts this rank holds: read
        once, after the last step, so that every scored step follows another step (work a step
        leaves undone is paid for in the next one; grader/runner.py)."""
        with self.counter.paused():
            moments = self.moments.digest(self.optimizer, self.last_seed)
        return {"moments": moments, "note": self.run.cuda_graph_note(), "experts_held": self.experts_held()}


# -- processes ---------------------------------------------------------------------------------
def _error(e: BaseException) -> dict:
    traceback.print_exc(file=sys.stderr)
    first = (str(e).strip().splitlines() or [""])[0]
    return {"error": f"{type(e).__name__}: {first}"[:500]}


def _send(conn, reply: dict) -> None:
    """A rank answers the harness in JSON: the harness unpickles nothing a rank sends."""
    conn.send_bytes(json.dumps(reply).encode())


def _rank_main(config: dict, rank: int, store: str, ranks_dir: str, conn) -> None:
    """One rank: shuts itself off from the other ranks (`confine.py`, the parts `config["confine"]`
    names), then builds the sessions it is sent and answers each seed. It meets the others through
    a TCP store on the sandbox's loopback, where the grader counts every byte."""
    own = None  # a single rank (no `confine`) shares its child with no other
    if config["confine"] is not None:
        try:
            own = confine_rank(rank, ranks_dir, cuda=config["device"] == "cuda", **config["confine"])
        except ConfineError as e:
            while conn.recv() is not None:  # the submission never runs less confined than the grader recorded
                _send(conn, {"error": f"the grader cannot isolate the ranks here ({e}): grade on Linux 6.12 or "
                                      "later with unprivileged user namespaces allowed (docs/SECURITY.md)"})
            return
    counter = CollectiveCounter()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(config["threads"])
    world = config["world"]
    if world > 1:
        backend = "nccl" if config["device"] == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=store, rank=rank, world_size=world)
    session = None
    while (msg := conn.recv()) is not None:
        try:
            if "session" in msg or "release" in msg:
                session = None
                gc.collect()
                if config["device"] == "cuda":
                    torch.cuda.empty_cache()
                if "release" in msg:
                    _send(conn, {"released": True})
                    continue
                spec = msg["session"]
                if spec.get("weights_out") and own:  # written in its own folder: the harness moves it out
                    spec = {**spec, "weights_out": os.path.join(own, spec["weights_out"])}
                _check_onenode(config["tree"])
                session = MoeSession(spec) if spec["kind"] == "moe" else TrainSession(spec, rank, counter)
                _check_onenode(config["tree"])  # nothing swapped in while building
                if spec.get("count_routes"):
                    session.count_routes()
                _send(conn, {"ready": session.info()})
            elif "evidence" in msg:
                _send(conn, {"evidence": session.evidence()})
            else:
                _send(conn, {"digest": session.step(int(msg["seed"]))})
        except BaseException as e:
            session = None
            _send(conn, _error(e))
    conn.close()


def _merge(replies: list[dict]) -> dict:
    """Rank 0's answer, with the largest per-rank byte counts (every rank should agree), every
    rank's `experts_held` and the sum of their `routes`."""
    first = dict(replies[0])
    key = next(k for k in ("ready", "digest", "evidence") if k in first)
    merged = dict(first[key])
    if "experts_held" in merged:
        merged["experts_held"] = [r[key]["experts_held"] for r in replies]
    if merged.get("routes") is not None:
        merged["routes"] = sum(r[key]["routes"] for r in replies)
    if "param_bytes" in merged:
        merged["param_bytes"] = max(r[key]["param_bytes"] for r in replies)
    if "bytes" in merged:
        families = {f for r in replies for f in r[key]["bytes"]}
        merged["bytes"] = {f: max(r[key]["bytes"].get(f, 0) for r in replies) for f in families}
    return {key: merged}


class Ranks:
    """`world` ranks; a session runs on the first `n` of them (1 or all).

    The ranks fork from a server that imported torch once (a spawned rank spent ~2.5 s of CPU on
    that import: 20 s of a 2-core machine for 8 ranks). The server starts before any submission
    code runs and imports nothing else, so each rank still installs the collective counter before
    FSDP and the submission are imported. Once all have started, the server's socket file is
    removed: a rank cannot have it fork a process outside its confinement."""

    def __init__(self, config: dict):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])
        with socket.socket() as probe:  # a free port of the sandbox's own loopback
            probe.bind(("127.0.0.1", 0))
            store = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        self.folders = Path.cwd() / "ranks"  # one folder per rank, the only place it writes
        self.folders.mkdir(mode=0o700)
        self.conns, self.procs = [], []
        for rank in range(config["world"]):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(config, rank, store, str(self.folders), theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        os.unlink(mp.forkserver._forkserver._forkserver_address)

    def move_out(self, name: str) -> None:
        """Rank 0's file `name` (the weights it saved) into the child's folder, if a regular file."""
        written, there = self.folders / "0" / name, Path.cwd() / name
        if written.is_file():
            os.replace(written, there)
            if not stat.S_ISREG(there.lstat().st_mode):  # swapped for a link meanwhile
                there.unlink()

    def ask(self, msg: dict, n: int) -> dict:
        """Send `msg` to ranks [0, n) and merge their answers. The first error (or death)
        answers at once: the other ranks are then usually stuck in a collective."""
        if n not in (1, len(self.conns)):
            return {"error": f"a session on {n} ranks in a child of {len(self.conns)}: use 1 or all"}
        for conn in self.conns[:n]:
            conn.send(msg)
        replies: dict[int, dict] = {}
        pending = dict(enumerate(self.conns[:n]))
        while pending:
            for conn in mp.connection.wait(list(pending.values())):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    reply = json.loads(conn.recv_bytes())
                except EOFError:
                    self.procs[rank].join(5)
                    reply = {"error": f"died (exit code {self.procs[rank].exitcode})"}
                except ValueError:
                    reply = None
                if not isinstance(reply, dict):
                    reply = {"error": "answered something other than a JSON object"}
                if "error" in reply:
                    return {"error": f"rank {rank}: {reply['error']}" if len(self.conns) > 1 else reply["error"]}
                replies[rank] = reply
                del pending[rank]
        return replies[0] if n == 1 else _merge([replies[r] for r in range(n)])

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    # The protocol keeps the real stdout; whatever the submission prints goes to stderr (the log).
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def recv():
        line = sys.stdin.readline()
        return json.loads(line) if line.strip() else None

    ranks = Ranks(recv())
    try:
        n = 1
        while (msg := recv()) is not None:
            if "session" in msg:
                n = msg["session"].get("layout", {}).get("world", 1)
            reply = ranks.ask(msg, n)
            if "ready" in reply and msg["session"].get("weights_out"):
                ranks.move_out(msg["session"]["weights_out"])
            proto.write(json.dumps(reply) + "\n")
    finally:
        ranks.close()


if __name__ == "__main__":
    main()
