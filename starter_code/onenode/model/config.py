"""NemotronH configuration: every field the model needs, named as transformers names them.

The config reads and writes a transformers `config.json` (model_type "nemotron_h"), so a
checkpoint saved here loads in `transformers.NemotronHForCausalLM` and back.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

# One letter per layer, as in `hybrid_override_pattern`.
LAYER_KINDS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
# transformers >= 5.3 also stores the pattern as a list of block types.
_HF_BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
_HF_BLOCK_LETTERS = {v: k for k, v in _HF_BLOCK_TYPES.items()} | {"mamba": "M", "attention": "*"}


@dataclass
class NemotronHConfig:
    vocab_size: int = 131072
    hidden_size: int = 2688
    hybrid_override_pattern: str = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    tie_word_embeddings: bool = False
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    residual_in_fp32: bool = False
    # Attention (no positional embedding at all: NemotronH has no RoPE).
    num_attention_heads: int = 32
    num_key_value_heads: int = 2
    head_dim: int = 128
    attention_bias: bool = False
    # Mamba2 mixer. Inner size is mamba_num_heads * mamba_head_dim (not expand * hidden).
    mamba_num_heads: int = 64
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # Dense MLP layers ('-'): squared ReLU, non-gated.
    intermediate_size: int = 1856
    mlp_bias: bool = False
    # MoE layers ('E').
    n_routed_experts: int = 128
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1856
    moe_shared_expert_intermediate_size: int = 3712
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # Token ids (used by data packing and generation, not by the forward).
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # Which Mamba2 scan to run: "torch" (`ssd_chunked`, compiled with the block), "mamba_ssm"
    # (its Triton kernels; `make mamba-ssm`) or "auto" (mamba_ssm's where they import and a GPU is
    # present, else torch). torch by default, so that what is installed never changes a run's
    # numerics unasked (a replay elsewhere would differ), and the compiled torch scan is what the
    # records measure; `onenode bench --mamba-kernel mamba_ssm` compares the two.
    mamba_kernel: str = "torch"
    # Which attention kernel: "sdpa" (torch's: cuDNN or flash attention) or "flex" (FlexAttention
    # over a causal block mask: deterministic without flash attention's slower backward; see
    # `attention.py`). Like mamba_kernel, not part of the architecture: no config.json has it.
    attention_kernel: str = "sdpa"
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        self.time_step_limit = tuple(float(x) for x in self.time_step_limit)
        self.validate()

    # -- derived sizes -------------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer: "mamba", "attention", "moe" or "mlp"."""
        return [LAYER_KINDS[c] for c in self.hybrid_override_pattern]

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_inner_size + 2 * self.n_groups * self.ssm_state_size

    def validate(self) -> None:
        bad = set(self.hybrid_override_pattern) - set(LAYER_KINDS)
        if bad or not self.hybrid_override_pattern:
            raise ValueError(
                f"hybrid_override_pattern {self.hybrid_override_pattern!r}: use only the letters "
                f"M (Mamba2), * (attention), E (MoE), - (dense MLP)"
            )
        checks = [
            (self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads"),
            (self.mamba_num_heads % self.n_groups == 0, "mamba_num_heads must be a multiple of n_groups"),
            (self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok exceeds n_routed_experts"),
            (self.n_routed_experts % self.n_group == 0, "n_routed_experts must be a multiple of n_group"),
            (self.topk_group <= self.n_group, "topk_group exceeds n_group"),
            (self.mamba_kernel in ("auto", "torch", "mamba_ssm"), "mamba_kernel is auto, torch or mamba_ssm"),
            (self.attention_kernel in ("sdpa", "flex"), "attention_kernel is sdpa or flex"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"NemotronHConfig: {message}")

    def replace(self, **changes) -> NemotronHConfig:
        """A copy with some fields changed (configs are never shared between models)."""
        return dataclasses.replace(copy.deepcopy(self), **changes)

    # -- transformers config.json --------------------------------------------------------
    def to_hf_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("name")
        d.pop("mamba_kernel")
        d.pop("attention_kernel")
        d["time_step_limit"] = list(self.time_step_limit)
        d.update(
            model_type="nemotron_h",
            architectures=["NemotronHForCausalLM"],
            layers_block_type=[_HF_BLOCK_TYPES[c] for c in self.hybrid_override_pattern],
            num_hidden_layers=self.num_hidden_layers,
            mlp_hidden_act="relu2",
            mamba_hidden_act="silu",
            use_bias=self.mamba_proj_bias,
            n_shared_experts=1,
            expand=max(1, self.mamba_inner_size // self.hidden_size),
            torch_dtype="float32",
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> NemotronHConfig:
        d = dict(d)
        if "layers_block_type" in d and d["layers_block_type"]:
            d["hybrid_override_pattern"] = "".join(_HF_BLOCK_LETTERS[t] for t in d["layers_block_type"])
        aliases = {  # older NVIDIA remote-code names
            "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
            "mamba_conv_bias": "use_conv_bias", "mamba_dt_min": "time_step_min",
            "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
            "mamba_dt_init_floor": "time_step_floor", "ssm_state_dim": "ssm_state_size",
            "mamba_d_state": "ssm_state_size", "use_bias": "mamba_proj_bias",
        }
        for old, new in aliases.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        if "time_step_limit" in d:  # transformers writes infinity as {"__float__": "Infinity"}
            d["time_step_limit"] = [float(x["__float__"]) if isinstance(x, dict) else x for x in d["time_step_limit"]]
        if d.get("num_key_value_heads") is None:
            d["num_key_value_heads"] = d.get("num_attention_heads", cls.num_attention_heads)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = d["eos_token_id"][0]
        names = {f.name for f in dataclasses.fields(cls)}
        kit_only = ("name", "mamba_kernel", "attention_kernel")
        return cls(**{k: v for k, v in d.items() if k in names and k not in kit_only})

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, folder_or_file: str | Path) -> NemotronHConfig:
        path = Path(folder_or_file)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}: point at a checkpoint folder that has one")
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}): re-export the checkpoint") from None


# -- presets ---------------------------------------------------------------------------------
def _tiny() -> NemotronHConfig:
    """Seconds on a CPU: every layer kind twice-ish, group-limited routing, n_groups > 1."""
    return NemotronHConfig(
        name="tiny", vocab_size=512, hidden_size=64, hybrid_override_pattern="MEM*EM-E",
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=16,
        intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64, n_group=2, topk_group=1,
    )


def _a1_1gpu() -> NemotronHConfig:
    """A1 on one 80 GB GPU with AdamW at sequence length 4096, in Nano's proportions.

    Half of Nano's depth with the same rhythm (25 layers: 11 Mamba, 11 MoE, 3 attention),
    128 routed experts top-6 with one shared expert, sigmoid routing with scaling 2.5, GQA
    with 2 KV heads, Mamba inner size 1.5x hidden with 8 groups and state 128.
    """
    return NemotronHConfig(
        name="a1-1gpu", vocab_size=131072, hidden_size=1024,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEME",
        num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=24, mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128,
        intermediate_size=2816, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=704,
        moe_shared_expert_intermediate_size=1408,
    )


def _group6_7b() -> NemotronHConfig:
    """The shape of the course's best A2 model (Group 6): about 7.0B parameters, 1.04B active per
    token (`count_parameters`), for one GPU with the optimizer state in CPU memory
    (`optimizer.state: cpu`): its float32 masters and moments alone are 84 GB.

    38 layers in Nano's rhythm (17 Mamba, 16 MoE, 5 attention), 64 routed experts top-4 with one
    shared expert of the same size, Mamba inner size 1.6x hidden with 8 groups and state 128,
    GQA with 2 KV heads.
    """
    return NemotronHConfig(
        name="group6-7b", vocab_size=131072, hidden_size=1280,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEM",
        num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128,
        intermediate_size=2432, n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=2432,
        moe_shared_expert_intermediate_size=2432,
    )


def _nano_30b_a3b() -> NemotronHConfig:
    """Nemotron-3-Nano-30B-A3B, the public architecture (random weights here)."""
    return NemotronHConfig(name="nemotron-3-nano-30b-a3b")


PRESETS = {"tiny": _tiny, "a1-1gpu": _a1_1gpu, "group6-7b": _group6_7b, "nemotron-3-nano-30b-a3b": _nano_30b_a3b}


def get_preset(name: str, **overrides) -> NemotronHConfig:
    """A fresh config for a named preset, with optional field overrides."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    config = PRESETS[name]()
    return config.replace(**overrides) if overrides else config
