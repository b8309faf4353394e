"""Read and write NemotronH checkpoints in both public layouts (`NemotronHForCausalLM.from_pretrained`
and `save_pretrained` call this; `onenode convert` rewrites a folder from one layout to the other).

- transformers native (`NemotronHForCausalLM` in transformers >= 5.3): prefix `model.`, the
  routed experts of a layer stacked as `mixer.experts.up_proj` [E, I, H] and `down_proj` [E, H, I].
- NVIDIA remote code (what `trust_remote_code` checkpoints and this kit's model use): prefix
  `backbone.`, one module per expert, `mixer.experts.{j}.up_proj.weight` [I, H].

Conversion is written against the *target's* own keys and shapes (`adapt_state_dict`): a model
may keep its experts in either layout and loads and saves both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .config import NemotronHConfig

_PREFIXES = ("backbone.", "model.")
_PER_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<j>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(?P<base>.+\.experts)\.(?P<proj>up_proj|down_proj)$")
_IGNORED = ("mtp.",)  # multi-token-prediction heads of some checkpoints: not part of this model


def _with_prefix(key: str, prefix: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return prefix + key[len(p):]
    return key


def convert_layout(state_dict: dict[str, torch.Tensor], target: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """`state_dict` in any known layout -> exactly the keys and shapes of `target`.

    Experts are stacked or unstacked only where source and target differ, so loading a layout
    into the same layout copies nothing.
    """
    prefix = "backbone." if any(k.startswith("backbone.") for k in target) else "model."
    # Source tensors under the target's prefix; per-expert tensors as {"...experts.up_proj": {j: W}}.
    source, per_expert = {}, {}
    for key, tensor in state_dict.items():
        if key.startswith(_IGNORED):
            continue
        key = _with_prefix(key, prefix)
        if m := _PER_EXPERT.match(key):
            per_expert.setdefault(f"{m['base']}.{m['proj']}", {})[int(m["j"])] = tensor
        else:
            source[key] = tensor
    used_keys, used_experts = set(), set()

    def lookup(key: str) -> torch.Tensor | None:
        if m := _PER_EXPERT.match(key):  # one expert, from either source layout
            name, j = f"{m['base']}.{m['proj']}", int(m["j"])
            if name in per_expert:
                used_experts.add((name, j))
                return per_expert[name].get(j)
            used_keys.add(name)
            stacked = source.get(name)
            return stacked[j] if stacked is not None and j < len(stacked) else None
        if key in per_expert:  # all experts stacked: [E, out, in]
            experts = per_expert[key]
            if sorted(experts) != list(range(len(experts))):
                raise ValueError(f"checkpoint has experts {sorted(experts)} for {key}: expected 0..{len(experts) - 1}")
            used_experts.update((key, j) for j in experts)
            return torch.stack([experts[j] for j in range(len(experts))])
        if key == "lm_head.weight" and key not in source:  # tied checkpoints store only the embedding
            return source.get(f"{prefix}embeddings.weight")
        used_keys.add(key)
        return source.get(key)

    out = {}
    for key, shape in target.items():
        tensor = lookup(key)
        if tensor is None:
            raise ValueError(f"checkpoint has no tensor for {key}: is it a NemotronH checkpoint of this config?")
        if _STACKED.match(key) and tensor.shape != shape and tensor.mT.shape == shape:
            tensor = tensor.mT  # stacked [E, in, out] where the checkpoint has [E, out, in], or back
        if tensor.shape != shape:
            raise ValueError(f"shape mismatch for {key}: checkpoint {tuple(tensor.shape)}, model {tuple(shape)}")
        out[key] = tensor
    head, embeddings = source.get("lm_head.weight"), source.get(f"{prefix}embeddings.weight")
    if "lm_head.weight" not in target and head is not None and embeddings is not None and torch.equal(head, embeddings):
        used_keys.add("lm_head.weight")  # a tied head, written once as the embedding
    unexpected = sorted(set(source) - used_keys) + sorted(
        f"{name}.{j}" for name, experts in per_expert.items() for j in experts if (name, j) not in used_experts)
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensors this model lacks, e.g. {unexpected[0]}: "
                         "check the config")
    return out


def adapt_state_dict(state_dict: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Any NemotronH layout -> the keys, expert layout and shapes of `model.state_dict()`."""
    return convert_layout(state_dict, {k: v.shape for k, v in model.state_dict().items()})


def layout_of(model: torch.nn.Module, layout: str) -> dict[str, torch.Size]:
    """The keys and shapes `model`'s weights take in a public layout: `hf` (transformers-native)
    or `nvidia` (the remote code's, this model's own)."""
    if layout == "hf":
        return _transformers_layout(model)
    if layout == "nvidia":
        return {k: v.shape for k, v in model.state_dict().items()}
    raise ValueError(f"unknown layout {layout!r}: use hf or nvidia")


def _transformers_layout(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The transformers-native keys and shapes for `model`'s weights, whatever its expert layout."""
    config = model.config
    experts = {"up_proj": (config.moe_intermediate_size, config.hidden_size),
               "down_proj": (config.hidden_size, config.moe_intermediate_size)}
    target = {}
    for key, tensor in model.state_dict().items():
        key = _with_prefix(key, "model.")
        if m := _PER_EXPERT.match(key) or _STACKED.match(key):
            target[f"{m['base']}.{m['proj']}"] = torch.Size((config.n_routed_experts, *experts[m["proj"]]))
        else:
            target[key] = tensor.shape
    if config.tie_word_embeddings:
        target.pop("lm_head.weight")
    return target


# -- files -----------------------------------------------------------------------------------
def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    return folder


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index names, else every
    `*.safetensors` in it; a missing shard or no weights at all is an error saying what to do."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e}): re-export the checkpoint") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder} lacks shard {missing[0]} named in its index: copy the whole folder")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}: point at a checkpoint folder")
    return files


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint folder, on the CPU."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = _folder(folder)
    state_dict = {}
    for path in weight_files(folder):
        try:
            state_dict.update(load_file(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}): re-download or re-export it") from None
    return state_dict


def read_checkpoint(path: str | Path) -> tuple[NemotronHConfig, dict[str, torch.Tensor]]:
    """The config and the tensors of a checkpoint folder, in whichever layout it was written."""
    folder = _folder(path)
    return NemotronHConfig.load(folder), read_state_dict(folder)


def _write(folder: Path, config: NemotronHConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf_dict() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})


def save_pretrained(model: torch.nn.Module, path: str | Path) -> Path:
    """config.json + model.safetensors in the transformers-native layout, which
    `transformers.AutoModelForCausalLM.from_pretrained(path)` loads (same logits)."""
    path = Path(path)
    tensors = convert_layout(model.state_dict(), _transformers_layout(model))
    _write(path, model.config, tensors, model.lm_head.weight.dtype)
    return path


def write_layout(config: NemotronHConfig, state_dict: dict[str, torch.Tensor], target: dict[str, torch.Size],
                 dst: str | Path) -> Path:
    """Write `state_dict` converted to the keys and shapes of `target` (a model's layout) as a folder."""
    if config.tie_word_embeddings:
        target.pop("lm_head.weight", None)
    tensors = convert_layout(state_dict, target)
    _write(Path(dst), config, tensors, next(iter(tensors.values())).dtype)
    return Path(dst)
