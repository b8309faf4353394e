"""A2 training recipes: one YAML file says everything a run needs, and is checked before it runs.

    name: tiny
    seed: 0
    model: {preset: tiny, hidden_size: 64}          # a preset plus NemotronHConfig overrides,
                                                     # or no preset and any pattern with sizes
    data: {source: synthetic}                        # or shards / config / megatron + path (+ mixture)
    train: {token_budget: 65536, seq_len: 64, global_batch_size: 8, micro_batch_size: 4}
    optimizer: {name: adamw, lr: 3.0e-3}
    schedule: {name: wsd, warmup_fraction: 0.05, decay_fraction: 0.2, decay_shape: 1-sqrt}
    moe: {bias_update_rate: 1.0e-3, aux_loss_coef: 0.0}
    parallel: {dp: -1, ep: 1, pp: 1}                 # + diloco: {inner_steps: H, ...} (off by default)
    checkpoint: {every_steps: 50, keep_last: 2}
    eval: {every_steps: 50, batches: 4}
    log: {every_steps: 1}

Every section is a dataclass below; a key that is unknown or of the wrong type fails with one
line naming the key (`recipe tiny.yaml: optimizer.lrr: unknown key (known: ...)`). A recipe may
start from another: `base: tiny.yaml` (a path beside it) takes that recipe and replaces what this
one says, key by key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..model.config import NemotronHConfig, get_preset
from ..parallel.float8 import FLOAT8_KINDS


class RecipeError(ValueError):
    """A recipe that cannot run; the message is one line naming the bad key."""


DATA_SOURCES = ("synthetic", "shards", "config", "megatron")
COMPILE_MODES = ("off", "mixers", "blocks")
UPDATE_KERNELS = ("auto", "triton", "inductor")  # train.fused_update_kernel


@dataclass
class ModelSection:
    preset: str | None = None
    # Any NemotronHConfig field (`pattern` is short for hybrid_override_pattern); kept apart so
    # the recipe can be validated against the config's own fields.
    overrides: dict = field(default_factory=dict)


@dataclass
class DataSection:
    # "synthetic": a seeded, structured token stream (smoke tests, no files); "shards": a data
    # folder built by `onenode data build`; "config": a data config YAML, built on first use
    # into $ONENODE_CACHE/datasets/ (see starter_code/onenode/data/configs/); "megatron": a
    # Megatron dataset prefix (PREFIX.bin + PREFIX.idx), needs the [megatron] extra.
    source: str = "synthetic"
    path: str | None = None
    mixture: dict = field(default_factory=dict)  # source name -> weight; empty: the data's own


@dataclass
class TrainSection:
    token_budget: int = 0  # hard stop: training never sees more tokens than this
    seq_len: int = 2048
    global_batch_size: int = 8  # sequences per optimizer step, all data-parallel ranks together
    micro_batch_size: int = 0  # sequences per forward on one rank; 0: global / dp (no accumulation)
    precision: str = "bf16"  # bf16 (fp32 master weights, FSDP2 gathers bf16 copies) or fp32
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    # torch.compile per layer: off | mixers (all but MoE mixers) | blocks (every block); true/false
    # are read as blocks/off
    compile: str = "off"
    # replay each compiled layer as a CUDA graph (one process on one GPU, compile set): one launch
    # instead of hundreds where the host cannot feed the GPU; a layer whose shapes change from step
    # to step runs without its graph, and the run says so
    cuda_graphs: bool = False
    # one process in bf16 with AdamW: the clip, the update and the bf16 copies in one pass per
    # parameter (train/master_update.py); false: float32 gradients on the masters, torch's AdamW
    fused_update: bool = True
    # the fused update's GPU kernel: triton (train/adamw_kernel.py: one launch a kind of parameter,
    # compiled in seconds), inductor (`_adamw` compiled per chunk: a minute or two cold), or auto:
    # triton (as fast as inductor's at 1 x 4096 with compiled layers and CUDA graphs, and 50 s
    # sooner to the first step: benchmarks/results/2026-12-05-h100-update-kernel-automodel/).
    # The two round alike but not bit for bit: a replay takes the run's.
    fused_update_kernel: str = "auto"
    # linear layers trained in float8 (torchao's rowwise Float8Linear, parallel/float8.py), by kind:
    # any of mamba, attention, mlp, experts; [] (the default): all in bf16
    float8: list = field(default_factory=list)
    # GPU kernels that give the same bits on every run (torch's deterministic algorithms, no cuDNN
    # attention): what a run replayed on a GPU must train with to be verified (A2's GPU profiles)
    deterministic: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu

    def update_kernel(self) -> str:
        """`fused_update_kernel` with auto resolved: triton."""
        return "triton" if self.fused_update_kernel == "auto" else self.fused_update_kernel


@dataclass
class MuonSection:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    # match_rms_adamw scales each matrix's update to AdamW's RMS, so one lr serves both
    # optimizers (Moonshot's "Muon is scalable"); "original" is Keller Jordan's scaling.
    adjust_lr_fn: str = "match_rms_adamw"
    # Newton-Schulz precision: bfloat16 (fast) or float32 (layouts agree to float32 rounding)
    ns_precision: str = "bfloat16"


@dataclass
class OptimizerSection:
    name: str = "adamw"  # adamw | muon (Muon on 2-D hidden matrices, AdamW on the rest)
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # AdamW's two moments stored in float32 (8 bytes a parameter), bfloat16 (4; rounded once a
    # step, train/master_update.AdamWCompactMoments; needs betas[1] <= 0.99, see there) or int8
    # (about 2: 8-bit codes and a scale per block, master_update's docstring; needs betas[1] <= 0.95)
    moments: str = "float32"
    # where the float32 masters and AdamW's moments live: device (the GPU) or cpu (pinned host memory,
    # streamed through the GPU a chunk at a time each step, train/offload.py; one process in bf16)
    state: str = "device"
    muon: MuonSection = field(default_factory=MuonSection)


@dataclass
class ScheduleSection:
    name: str = "wsd"  # wsd | cosine | constant
    warmup_fraction: float = 0.01  # of all steps
    decay_fraction: float = 0.2  # WSD: the last fraction of steps decays
    decay_shape: str = "1-sqrt"  # WSD: linear | cosine | 1-sqrt
    min_lr_ratio: float = 0.0  # the final lr, as a fraction of the peak


@dataclass
class MoESection:
    # Auxiliary-loss-free balancing: after each step, bias += rate * sign(mean_load - load).
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 0.0  # switch-style auxiliary loss, off by default


@dataclass
class DiLoCoSection:
    # DiLoCo (Douillard et al. 2023; parallel/diloco.py): `replicas` replica groups, each its own job,
    # train apart on their own slices of the data and sync every `inner_steps` steps: the outer
    # Nesterov SGD step on the replica-mean of (parameters at the last sync - parameters now).
    # 0: off. global_batch_size counts every replica's sequences, so the budget counts their tokens.
    inner_steps: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    replicas: int = 2


@dataclass
class ParallelSection:
    dp: int = -1  # -1: whatever the world size leaves after ep and pp (within one DiLoCo replica group)
    ep: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"  # with pp > 1: gpipe | 1f1b | interleaved_1f1b (parallel/pipeline.py)
    microbatches: int = 0  # with pp > 1: pipeline microbatches per step; 0: pp
    diloco: DiLoCoSection = field(default_factory=DiLoCoSection)


@dataclass
class CheckpointSection:
    enabled: bool = True  # false: no checkpoints at all (throughput measurements)
    every_steps: int = 0  # 0: only the first (step 0) and the final checkpoint
    keep_last: int = 0  # 0: keep every checkpoint (the chain the grader replays); N: only the last N
    export_hf: bool = True  # write the final model in the transformers layout


@dataclass
class EvalSection:
    every_steps: int = 0  # 0: only at the end
    batches: int = 8


@dataclass
class LogSection:
    every_steps: int = 10
    tensorboard: bool = True  # when the tensorboard package is installed
    progress_bar: bool = True


@dataclass
class Recipe:
    name: str = "run"
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    moe: MoESection = field(default_factory=MoESection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: LogSection = field(default_factory=LogSection)
    source_path: str | None = field(default=None, compare=False)  # where it was read from

    # -- derived -------------------------------------------------------------------------
    def model_config(self) -> NemotronHConfig:
        """The NemotronH config the recipe names: a preset with overrides, or a custom one."""
        overrides = dict(self.model.overrides)
        if "pattern" in overrides:
            overrides["hybrid_override_pattern"] = overrides.pop("pattern")
        try:
            if self.model.preset:
                return get_preset(self.model.preset, **overrides)
            return NemotronHConfig(name=self.name, **overrides)
        except (KeyError, ValueError, TypeError) as e:
            raise RecipeError(f"{self._where()}model: {_one_line(e)}") from None

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.train.seq_len

    @property
    def total_steps(self) -> int:
        """Optimizer steps the budget allows: never more tokens than the budget."""
        return self.train.token_budget // self.tokens_per_step

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source_path")
        return d

    @property
    def training_sha256(self) -> str:
        """sha256 of what decides the weights: the seed and the model, data mixture, train,
        optimizer, schedule, moe and parallel sections. Where the data lives (data.source,
        data.path: the loader pins the shards by hash) and the checkpoint, eval and log sections
        do not count. Every checkpoint records it: a replay runs the same."""
        d = self.to_dict()
        sections = ("seed", "model", "data", "train", "optimizer", "schedule", "moe", "parallel")
        decisive = {key: d[key] for key in sections}
        decisive["data"] = {k: v for k, v in decisive["data"].items() if k not in ("source", "path")}
        if not self.parallel.diloco.inner_steps:  # off: the hash a recipe had before DiLoCo was an option
            decisive["parallel"] = {k: v for k, v in decisive["parallel"].items() if k != "diloco"}
        if self.optimizer.moments == "float32":  # the default: the hash a recipe had before the option
            decisive["optimizer"] = {k: v for k, v in decisive["optimizer"].items() if k != "moments"}
        if self.train.fused_update_kernel == "auto":  # the default: the hash a recipe had before the option
            decisive["train"] = {k: v for k, v in decisive["train"].items() if k != "fused_update_kernel"}
        if not self.train.float8:  # the default: the hash a recipe had before the option
            decisive["train"] = {k: v for k, v in decisive["train"].items() if k != "float8"}
        if self.optimizer.state == "device":  # the default: the hash a recipe had before the option
            decisive["optimizer"] = {k: v for k, v in decisive["optimizer"].items() if k != "state"}
        return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()

    def with_overrides(self, overrides: dict) -> Recipe:
        """A new recipe with dotted keys replaced (`{"optimizer.name": "muon"}`), validated."""
        d = self.to_dict()
        for dotted, value in overrides.items():
            _set_dotted(d, dotted, value)
        return from_dict(d, source=self.source_path)

    def _where(self) -> str:
        return f"recipe {Path(self.source_path).name}: " if self.source_path else "recipe: "

    def _offload_needs(self) -> list[tuple[bool, str]]:
        """What `optimizer.state: cpu` needs: the fused update of one process in bf16 streams the
        state (`train/offload.py`); every other step reads gradients on the masters, or shards them.
        One process and one micro-batch a step are the layout's, checked by `assembly.assemble`."""
        t, p = self.train, self.parallel
        return [
            (self.optimizer.name == "adamw", "is AdamW's: set optimizer.name adamw"),
            (t.precision == "bf16", "offloads bf16 training's float32 masters: set train.precision bf16"),
            (t.fused_update, "streams the state through the fused update: set train.fused_update true"),
            (p.dp in (-1, 1) and p.ep == 1 and p.pp == 1 and not p.diloco.inner_steps,
             "runs one process (FSDP across ranks keeps the state on each GPU): set parallel dp -1, ep 1, pp 1, "
             "no diloco, and launch one process"),
        ]

    def validate(self) -> Recipe:
        t, o, s = self.train, self.optimizer, self.schedule
        d = self.parallel.diloco
        diloco = d.inner_steps > 0
        steps = self.total_steps if self.tokens_per_step > 0 else 0
        checks = [
            ("train.token_budget", t.token_budget > 0, "must be a positive number of tokens"),
            ("train.seq_len", t.seq_len > 0, "must be positive"),
            ("train.global_batch_size", t.global_batch_size > 0, "must be positive"),
            ("train.micro_batch_size", t.micro_batch_size >= 0, "must be >= 0 (0: no accumulation)"),
            ("train.token_budget", t.token_budget >= self.tokens_per_step,
             f"{t.token_budget} is less than one step (global_batch_size x seq_len = {self.tokens_per_step})"),
            ("train.precision", t.precision in ("bf16", "fp32"), "is bf16 or fp32"),
            ("train.compile", t.compile in COMPILE_MODES, "is off, mixers or blocks"),
            ("train.fused_update_kernel", t.fused_update_kernel in UPDATE_KERNELS, "is auto, triton or inductor"),
            ("train.cuda_graphs", not t.cuda_graphs or t.compile != "off",
             "replays compiled layers: set train.compile to blocks (or mixers)"),
            ("train.float8", isinstance(t.float8, list) and set(t.float8) <= set(FLOAT8_KINDS),
             f"is a list of layer kinds from {list(FLOAT8_KINDS)} ([]: none)"),
            ("train.float8", not t.float8 or t.precision == "bf16",
             "casts bf16 matmuls to float8: set train.precision bf16"),
            ("train.deterministic", not t.deterministic or self.model.overrides.get("mamba_kernel", "torch") != "auto",
             "needs model.mamba_kernel torch or mamba_ssm (auto picks by what is installed: a replay elsewhere "
             "could run the other scan)"),
            ("data.source", self.data.source in DATA_SOURCES, "is synthetic, shards, config or megatron"),
            ("data.path", self.data.source == "synthetic" or bool(self.data.path),
             f"is needed with data.source: {self.data.source}"),
            ("optimizer.name", o.name in ("adamw", "muon"), "is adamw or muon"),
            ("optimizer.lr", o.lr > 0, "must be positive"),
            ("optimizer.betas", len(o.betas) == 2, "is a list of two numbers"),
            ("optimizer.moments", o.moments in ("float32", "bfloat16", "int8"), "is float32, bfloat16 or int8"),
            ("optimizer.moments", o.moments != "bfloat16" or (o.betas or [0])[-1] <= 0.99,
             f"bfloat16 moments need betas[1] <= 0.99 (with {o.betas[-1]} a step changes the second moment by "
             "less than bfloat16 can round to: it would stall); use float32"),
            ("optimizer.moments", o.moments != "int8" or (o.betas or [0])[-1] <= 0.95,
             f"int8 moments need betas[1] <= 0.95 (a shrinking second moment moves down its 8-bit code only where "
             f"a step changes it by more than a code's step: with 0.95 above a seventh of its block's largest value, "
             f"with {o.betas[-1]} less of it; the rest stalls); use bfloat16 or float32"),
            ("optimizer.state", o.state in ("device", "cpu"), "is device or cpu"),
            *[("optimizer.state", o.state == "device" or ok, f"cpu {needs}")
              for ok, needs in self._offload_needs()],
            ("optimizer.muon.adjust_lr_fn", o.muon.adjust_lr_fn in ("original", "match_rms_adamw"),
             "is original or match_rms_adamw"),
            ("optimizer.muon.ns_precision", o.muon.ns_precision in ("bfloat16", "float32"), "is bfloat16 or float32"),
            ("schedule.name", s.name in ("wsd", "cosine", "constant"), "is wsd, cosine or constant"),
            ("schedule.decay_shape", s.decay_shape in ("linear", "cosine", "1-sqrt"), "is linear, cosine or 1-sqrt"),
            ("schedule.warmup_fraction", 0 <= s.warmup_fraction < 1, "is in [0, 1)"),
            ("schedule.decay_fraction", 0 <= s.decay_fraction <= 1 - s.warmup_fraction,
             "is in [0, 1 - warmup_fraction]"),
            ("schedule.min_lr_ratio", 0 <= s.min_lr_ratio <= 1, "is in [0, 1]"),
            ("moe.bias_update_rate", self.moe.bias_update_rate >= 0, "must be >= 0"),
            ("moe.aux_loss_coef", self.moe.aux_loss_coef >= 0, "must be >= 0"),
            ("parallel.ep", self.parallel.ep >= 1, "must be >= 1"),
            ("parallel.pp", self.parallel.pp >= 1, "must be >= 1"),
            ("parallel.microbatches", self.parallel.microbatches >= 0, "must be >= 0 (0: pp)"),
            ("parallel.diloco.inner_steps", d.inner_steps >= 0, "must be >= 0 (0: DiLoCo off)"),
            ("parallel.diloco.outer_lr", d.outer_lr > 0, "must be positive (the paper's: 0.7)"),
            ("parallel.diloco.outer_momentum", 0 <= d.outer_momentum < 1,
             "is in [0, 1) (the paper's Nesterov momentum: 0.9)"),
            ("parallel.diloco.replicas", not diloco or d.replicas >= 2,
             "must be >= 2 replica groups (or inner_steps: 0, DiLoCo off)"),
            ("parallel.diloco.inner_steps", not diloco or steps % d.inner_steps == 0,
             f"{d.inner_steps} does not divide the run's {steps} steps (token_budget // (global_batch_size "
             "x seq_len)): the last outer step would be cut short"),
            ("train.global_batch_size", not diloco or t.global_batch_size % d.replicas == 0,
             f"{t.global_batch_size} sequences do not split over parallel.diloco.replicas {d.replicas} replica groups"),
            ("checkpoint.every_steps", not diloco or self.checkpoint.every_steps % d.inner_steps == 0,
             f"with parallel.diloco a checkpoint falls on a sync: use a multiple of inner_steps {d.inner_steps}"),
            ("parallel.pp", not diloco or self.parallel.pp == 1,
             "must be 1 with parallel.diloco (replica groups run without pipeline stages)"),
            ("checkpoint.keep_last", self.checkpoint.keep_last >= 0, "must be >= 0 (0: keep every checkpoint)"),
            ("checkpoint.every_steps", self.checkpoint.every_steps >= 0, "must be >= 0 (0: only at the end)"),
            ("eval.every_steps", self.eval.every_steps >= 0, "must be >= 0 (0: only at the end)"),
            ("eval.batches", self.eval.batches >= 1, "must be >= 1"),
            ("log.every_steps", self.log.every_steps >= 1, "must be >= 1"),
        ]
        for key, ok, message in checks:
            if not ok:
                raise RecipeError(f"{self._where()}{key}: {message}")
        self.model_config()  # the architecture itself must make sense
        return self


# -- reading ------------------------------------------------------------------------------


def load_recipe(path: str | Path, overrides: dict | None = None) -> Recipe:
    """Read, check and return a recipe; overrides are dotted keys (`train.token_budget`)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path}: no such file (the shipped ones are in a2_pretrain/recipes/)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path.name}: not valid YAML ({_one_line(e)})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path.name}: the top level must be a mapping of sections")
    if "base" in raw:
        base = path.parent / str(raw.pop("base"))
        raw = _merged(yaml.safe_load(base.read_text()) if base.is_file() else None, raw, path.name, base)
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value)
    return from_dict(raw, source=str(path))


def _merged(base, raw: dict, name: str, base_path: Path) -> dict:
    """`raw` over the recipe it names as its base: mappings merge key by key, values replace."""
    if not isinstance(base, dict) or "base" in base:
        raise RecipeError(f"recipe {name}: base {base_path} is not a recipe without a base of its own")

    def merge(under: dict, over: dict) -> dict:
        out = dict(under)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    return merge(base, raw)


def from_dict(raw: dict, source: str | None = None) -> Recipe:
    where = f"recipe {Path(source).name}: " if source else "recipe: "
    raw = dict(raw)
    model = raw.pop("model", None) or {}
    if not isinstance(model, dict):
        raise RecipeError(f"{where}model: must be a mapping (preset and/or NemotronHConfig fields)")
    model = dict(model)
    preset, nested = model.pop("preset", None), model.pop("overrides", {})
    raw["model"] = {"preset": preset, "overrides": {**nested, **model}}
    _check_model_keys(raw["model"]["overrides"], where)
    train = raw.get("train")
    if isinstance(train, dict) and isinstance(train.get("compile"), bool):  # the older true/false
        raw["train"] = {**train, "compile": "blocks" if train["compile"] else "off"}
    recipe = _build(Recipe, raw, where, "")
    recipe.source_path = source
    return recipe.validate()


def _check_model_keys(overrides: dict, where: str) -> None:
    known = {f.name for f in dataclasses.fields(NemotronHConfig)} | {"pattern"}
    for key in overrides:
        if key not in known:
            raise RecipeError(f"{where}model.{key}: not a NemotronHConfig field")


def _build(cls, raw, where: str, prefix: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}{prefix.rstrip('.') or 'top level'}: must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.name != "source_path"}
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise RecipeError(f"{where}{prefix}{key}: unknown key (known: {', '.join(sorted(fields))})")
        values[key] = _coerce(hints[key], value, where, prefix + key)
    return cls(**values)


def _coerce(hint, value, where: str, key: str):
    """The value as the field's type; numbers may be written as strings such as "20e9"."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value or {}, where, key + ".")
    args = set(typing.get_args(hint))
    if value is None and type(None) in args:
        return None
    base = hint if not args else next(a for a in args if a is not type(None))
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base in (int, float):
        if isinstance(value, str):
            try:
                value = float(value.replace("_", ""))
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if base is int:
                if float(value).is_integer():
                    return int(value)
            else:
                return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    elif base in (dict, list):
        if isinstance(value, base):
            return value
    raise RecipeError(f"{where}{key}: expected {getattr(base, '__name__', base)}, got {value!r}")


def _set_dotted(d: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        d = d.setdefault(part, {})
        if not isinstance(d, dict):
            raise RecipeError(f"recipe override {dotted}: {part} is not a section")
    d[last] = value


def parse_override(text: str) -> tuple[str, object]:
    """`key=value` from the command line, the value read as YAML (numbers, lists, booleans)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise RecipeError(f"override {text!r}: write it as section.key=value")
    return key.strip(), yaml.safe_load(value)


def _one_line(e: BaseException) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(text.split())
