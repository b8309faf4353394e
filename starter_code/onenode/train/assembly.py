"""A training run assembled from a Recipe: the one place that builds a model for training, lays it
out and gives it its optimizer and step.

    run = assemble(load_recipe("a2_pretrain/recipes/tiny.yaml"))
    out = run.step(input_ids, labels)          # {"loss", "grad_norm", ...}: one optimizer step

`onenode bench` (synthetic batches and a meter), `onenode train` (data, schedule, checkpoints; so
A2's replay too) and the A1 grader's harness (the grader's batches and evidence) all call
`assemble`, so a speed-up wired here is what all of them run, and the step the grader times is the
step `onenode bench` measures with the same recipe fields. The order of what is applied to the model
(compile, activation checkpointing, expert parallelism, pipeline stages, FSDP and the precision)
lives in `parallelize`; the recipe only says which. With `parallel.diloco` the run is one replica group
of a DiLoCo run (`parallel/diloco.py`): its step syncs with the other groups every H steps.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..model import build_model
from ..model.config import NemotronHConfig
from ..parallel import ParallelDims, ParallelModel, parallelize
from ..parallel.compile_and_checkpoint import cuda_graph_skips, tile_deterministic_reductions
from ..parallel.diloco import ReplicaGroups, replica_group
from ..parallel.distributed import init_distributed, local_device
from ..parallel.float8 import apply_float8
from .balance import RouterBalancer
from .optim import optimizers_of
from .recipe import Recipe, RecipeError
from .step import build_optimizer, train_step


def use_deterministic_kernels() -> None:
    """Every kernel of a step gives the same bits on every run of the same layout and GPU, so a
    replayed span lands on its checkpoint exactly: cuBLAS with a fixed workspace, torch's
    deterministic algorithms (an op that has none fails loudly rather than drifting), and SDPA
    without cuDNN attention, whose backward accumulates in no fixed order. New tensors are not
    filled with NaN first (torch's default in this mode, 188 fill kernels a step of the A2
    baseline): no kernel of a step reads memory it has not written, so the fill changes no bit."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)


@dataclass(frozen=True)
class Layout:
    """How a recipe's global batch falls on `world` processes."""

    world: int
    dp: int  # data-parallel ranks (experts shard inside them)
    ep: int
    pp: int
    micro_batch: int  # sequences per forward on one rank
    accumulation: int  # micro-batches per optimizer step
    replicas: int = 1  # DiLoCo replica groups (each a job of `world` processes) the global batch splits over

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(dp=self.dp, ep=self.ep, pp=self.pp)


def data_parallel_size(recipe: Recipe, world: int) -> int:
    """`parallel.dp`, or with -1 whatever the world size leaves after the pipeline stages."""
    p = recipe.parallel
    return world // p.pp if p.dp == -1 else p.dp


def resolve_layout(recipe: Recipe, world: int) -> Layout:
    """Data-parallel size and gradient accumulation from the recipe and the world size."""
    p, t = recipe.parallel, recipe.train
    if world % (p.ep * p.pp) and p.dp == -1:
        raise RecipeError(f"recipe: parallel.ep x parallel.pp = {p.ep * p.pp} does not divide the world size {world}")
    dp = data_parallel_size(recipe, world)
    if dp * p.pp != world:
        raise RecipeError(f"recipe: parallel.dp {dp} x pp {p.pp} != world size {world}: fix parallel.dp or use -1 "
                          "(or launch with torchrun --nproc-per-node DP*PP)")
    if p.ep > 1 and world == 1:
        raise RecipeError(f"recipe: parallel.ep {p.ep} needs as many processes: launch with torchrun "
                          f"--nproc-per-node {p.ep}")
    replicas = p.diloco.replicas if p.diloco.inner_steps else 1
    micro = t.micro_batch_size or t.global_batch_size // (dp * replicas)
    if micro < 1 or t.global_batch_size % (micro * dp * replicas):
        groups = f" x {replicas} DiLoCo replica groups" if replicas > 1 else ""
        raise RecipeError(f"recipe: train.global_batch_size {t.global_batch_size} is not a multiple of "
                          f"micro_batch_size {micro} x dp {dp}{groups}")
    accumulation = t.global_batch_size // (micro * dp * replicas)
    if p.pp > 1 and accumulation > 1:
        raise RecipeError("recipe: train.micro_batch_size: with parallel.pp > 1 leave it 0 (the pipeline splits "
                          "each rank's batch into its own microbatches)")
    return Layout(world, dp, p.ep, p.pp, micro, accumulation, replicas)


@contextlib.contextmanager
def collecting_after():
    """Python's cycle collector off within (a step) and run on its young generations after.

    A step allocates Python objects by the thousand (a tensor's wrapper per op, the update's
    members per parameter); left automatic, the collector runs in the middle of the step, where
    what is alive then (the forward's and backward's) survives into the oldest generation and
    brings on full collections of every object of the process: on the unpatched starter's 2,977
    parameters, on a CPU, one every 2.5 steps at 155 ms each. After the step its objects are gone,
    so the young generations are quick to sweep and nothing is promoted (torchtitan collects on a
    schedule of its own for the same reason). Not under CUDA graphs: with the collector paused,
    inductor's check of the graphs' memory pool failed on one H100 ("storage data ptrs are not
    allocated in pool", benchmarks/results/2026-12-07-h100-update-overlap/), so their steps keep the
    automatic collector."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(1)
        if enabled:
            gc.enable()


@dataclass
class TrainingRun:
    """A model laid out for training, its optimizer and load balancing, and the step they take."""

    recipe: Recipe
    config: NemotronHConfig
    device: torch.device
    rank: int
    layout: Layout
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    balancer: RouterBalancer
    float8: dict | None = None  # `train.float8`'s layers: converted and kept bf16, per kind (parallel/float8.py)
    replica: int = 0  # this DiLoCo replica group (0 without DiLoCo)
    diloco: ReplicaGroups | None = None

    @property
    def dp_group(self):
        """The data-parallel ranks' process group (None: the default group, or none)."""
        mesh = self.parallel.dp_mesh
        return mesh.get_group() if mesh is not None else None

    @property
    def dp_rank(self) -> int:
        mesh = self.parallel.dp_mesh
        return mesh.get_local_rank() if mesh is not None else 0

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        """One optimizer step on this rank's batch (its `accumulation` micro-batches), at the
        optimizer's current learning rate, then the routers' rebalancing: {"loss", "grad_norm",
        ("aux_loss"), and the balancer's record}."""
        inner_step = functools.partial(self._inner_step, input_ids, labels)
        with contextlib.nullcontext() if self.recipe.train.cuda_graphs else collecting_after():
            return inner_step() if self.diloco is None else self.diloco.step(inner_step)

    def _inner_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        t, coef = self.recipe.train, self.recipe.moe.aux_loss_coef
        if t.cuda_graphs:  # a new step: replay the graphs, do not wait for the last step's backwards
            torch.compiler.cudagraph_mark_step_begin()
        out = train_step(self.parallel, self.optimizer, input_ids, labels, t.grad_clip,
                         accumulation_steps=self.layout.accumulation,
                         aux_loss_fn=self.balancer.pop_aux_loss if coef > 0 else None, aux_loss_coef=coef,
                         fused_update=t.fused_update, update_kernel=t.update_kernel())
        return {**out, **self.balancer.finish_step(self.recipe.moe.bias_update_rate, group=self.dp_group)}

    def inner_state_dict(self) -> dict:
        """The model and the inner optimizer: what torchft sends a DiLoCo group that comes back behind."""
        model, optim = get_state_dict(self.parallel.model, optimizers_of(self.optimizer))
        return {"model": model, "optim": optim}

    def load_inner_state_dict(self, state: dict) -> None:
        """A live group's model and inner optimizer, in place of this group's (torchft's healing)."""
        set_state_dict(self.parallel.model, optimizers_of(self.optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if self.parallel.master_weights is not None:
            self.parallel.master_weights.masters_changed()

    def cuda_graph_note(self) -> str | None:
        """One line when CUDA graphs were asked for and some compiled layers run without them."""
        skipped = cuda_graph_skips() if self.recipe.train.cuda_graphs else 0
        if not skipped:
            return None
        return (f"CUDA graphs: {skipped} compiled region(s) ran without their graph (their shapes change from step to "
                "step, e.g. a loop over experts with per-expert token counts); the rest replay")


def assemble(recipe: Recipe, *, device: torch.device | str | None = None,
             init_weights: Callable[[nn.Module], None] | None = None,
             replace_model: Callable[[nn.Module], nn.Module] | None = None) -> TrainingRun:
    """The recipe's training run on this process (joining torchrun's group when launched by it).

    The model is built from `recipe.seed` on `device` (default: the recipe's `train.device`, "auto"
    being this rank's GPU, else the CPU); `init_weights(model)`, where given, then sets its weights
    on the plain model before anything is laid out (the A1 grader loads the starter's weights so);
    `replace_model(model)`, where given, returns the module trained instead, built from the plain
    model's weights (`onenode bench --impl transformers`: transformers' own NemotronH).
    """
    rank, world = init_distributed()
    t = recipe.train
    if device is None:
        device = local_device() if t.device == "auto" else torch.device(t.device)
    device = torch.device(device)
    layout = resolve_layout(recipe, world)
    if t.cuda_graphs and (world > 1 or device.type != "cuda"):
        raise RecipeError("recipe: train.cuda_graphs replays compiled layers in one process on a GPU (under FSDP they "
                          "would be recorded again every step): set it false, or run one process on a CUDA device")
    if recipe.model.overrides.get("attention_kernel") == "flex" and device.type != "cuda":
        raise RecipeError("recipe: model.attention_kernel flex trains on a GPU (FlexAttention has no backward on a "
                          f"{device.type}): set it sdpa, or run on a CUDA device")
    if recipe.optimizer.state == "cpu" and world > 1:
        raise RecipeError(f"recipe: optimizer.state: cpu runs one process (FSDP across {world} ranks keeps the state "
                          "on each GPU): launch one process, or set optimizer.state device")
    if recipe.optimizer.state == "cpu" and layout.accumulation > 1:
        raise RecipeError(f"recipe: optimizer.state: cpu takes one micro-batch a step ({layout.accumulation} would add "
                          "up their gradients on the masters): set train.micro_batch_size 0")
    if t.deterministic:
        use_deterministic_kernels()
        if t.compile and device.type == "cuda":
            tile_deterministic_reductions()  # inductor's Triton reductions: one config each, by the kit's rule
    config = recipe.model_config()
    torch.manual_seed(recipe.seed)
    model = build_model(config, seed=recipe.seed, device=device)
    if init_weights is not None:
        init_weights(model)
    if replace_model is not None:
        model = replace_model(model)
    float8 = _apply_float8(model, t.float8, replaced=replace_model is not None)
    p = recipe.parallel
    pipeline = {"schedule": p.pp_schedule, "microbatches": p.microbatches or None} if p.pp > 1 else {}
    parallel = parallelize(model, layout.dims, param_dtype=torch.bfloat16 if t.precision == "bf16" else None,
                           compile=t.compile, activation_checkpointing=t.activation_checkpointing,
                           cuda_graphs=t.cuda_graphs, **pipeline)
    o = recipe.optimizer
    muon = vars(o.muon) if o.name == "muon" else {}
    optimizer = build_optimizer(parallel, o.name, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas),
                                eps=o.eps, moments=o.moments, state=o.state, **muon)
    if recipe.moe.aux_loss_coef > 0 and parallel.pipeline is not None:
        raise RecipeError("recipe: moe.aux_loss_coef needs parallel.pp: 1 (pipeline stages compute their own loss)")
    balancer = RouterBalancer(parallel, aux_loss=recipe.moe.aux_loss_coef > 0)
    run = TrainingRun(recipe, config, device, rank, layout, parallel, optimizer, balancer, float8=float8)
    if layout.replicas > 1:
        run.replica, run.diloco = _join_replica_groups(run, world)
    return run


def _apply_float8(model: nn.Module, kinds: list[str], replaced: bool) -> dict | None:
    """`train.float8` applied to the plain model (`parallel/float8.py`), None when it names no kind."""
    if not kinds:
        return None
    if replaced:
        raise RecipeError("recipe: train.float8 converts the kit's own model's layers; a replaced model (another "
                          "implementation) runs in bf16: set train.float8 []")
    try:
        return apply_float8(model, kinds)
    except ImportError as e:
        raise RecipeError(f"recipe: {e}") from None


def _join_replica_groups(run: TrainingRun, world: int) -> tuple[int, ReplicaGroups]:
    """This process's replica group and its torchft Manager (`parallel/diloco.py`)."""
    d = run.recipe.parallel.diloco
    try:
        import torchft  # noqa: F401
    except ModuleNotFoundError as e:
        raise RecipeError(f"recipe: parallel.diloco needs torchft ({e.name} is not installed): "
                          "pip install 'onenode[diloco]'") from None
    try:
        replica = replica_group(d.replicas)
        groups = ReplicaGroups(run.parallel, replicas=d.replicas, replica=replica, inner_steps=d.inner_steps,
                               outer_lr=d.outer_lr, outer_momentum=d.outer_momentum, rank=run.rank, world=world,
                               state_dict=run.inner_state_dict, load_state_dict=run.load_inner_state_dict,
                               buffers=[router.e_score_correction_bias for router in run.balancer.routers.values()])
    except ValueError as e:
        raise RecipeError(f"recipe: {e}") from None
    return replica, groups
