"""A OneNode checkpoint as an lm-eval model (`model=onenode`), and the checkpoint's tokenizer.

A checkpoint folder carries its tokenizer, so it can be evaluated anywhere:
- `tokenizer.json`: a `tokenizers` file (the data pipeline's trained byte-level BPE), which
  transformers also reads; or
- `onenode_tokenizer.json`: `{"spec": "gpt2", "sha256": "..."}`, naming a tokenizer of
  `onenode.data.load_tokenizer` (the offline GPT-2 BPE, a hub name) and pinning its content.

`OneNodeLM` scores (context, continuation) pairs in batches on the kit's own model; lm-eval's
`TemplateLM` does the tokenization of pairs exactly as its HFLM does, so both routes agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..data.tokenizer import EOT, Tokenizer, TokenizerError, load_tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_SPEC_FILE = "onenode_tokenizer.json"
DEFAULT_MAX_LENGTH = 2048


def checkpoint_tokenizer(folder: str | Path, spec: str | None = None) -> Tokenizer:
    """The tokenizer a checkpoint folder carries (or `spec`, which overrides it)."""
    folder = Path(folder)
    if spec:
        return load_tokenizer(spec)
    if (folder / TOKENIZER_FILE).is_file():
        return load_tokenizer(str(folder / TOKENIZER_FILE))
    if (folder / TOKENIZER_SPEC_FILE).is_file():
        try:
            named = json.loads((folder / TOKENIZER_SPEC_FILE).read_text())
            tokenizer = load_tokenizer(named["spec"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TokenizerError(f"{folder / TOKENIZER_SPEC_FILE} is malformed: write "
                                 '{"spec": "gpt2", "sha256": "..."}') from None
        if named.get("sha256") and named["sha256"] != tokenizer.content_hash():
            raise TokenizerError(f"{folder / TOKENIZER_SPEC_FILE}: tokenizer {named['spec']!r} here is not the "
                                 "one the checkpoint was trained with (sha256 differs)")
        return tokenizer
    raise TokenizerError(f"{folder} carries no tokenizer: copy the data folder's {TOKENIZER_FILE} into it, "
                         f"write {TOKENIZER_SPEC_FILE} ({{\"spec\": \"gpt2\"}}), or pass --tokenizer")


def attach_tokenizer(checkpoint: str | Path, data_dir: str | Path) -> None:
    """Make a checkpoint folder carry the tokenizer of the data folder it was trained on: a copy
    of the data's tokenizer.json (a trained BPE), else a reference to its named tokenizer."""
    checkpoint, data_dir = Path(checkpoint), Path(data_dir)
    if (data_dir / TOKENIZER_FILE).is_file():
        (checkpoint / TOKENIZER_FILE).write_bytes((data_dir / TOKENIZER_FILE).read_bytes())
        return
    described = json.loads((data_dir / "manifest.json").read_text())["tokenizer"]
    spec = {"spec": described["name"], "sha256": described["sha256"]}
    (checkpoint / TOKENIZER_SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")


def recipe_data_dir(recipe, root: str | Path = ".") -> Path | None:
    """The built data folder a recipe trains on (None for synthetic data), as the trainer finds it
    when run from `root`."""
    import hashlib

    from ..data.corpus import cache_dir

    if recipe.data.source == "shards":
        return Path(root) / recipe.data.path
    if recipe.data.source == "megatron":
        from ..data.megatron_source import megatron_data_folder

        return megatron_data_folder(Path(root) / recipe.data.path)
    if recipe.data.source == "config":
        config = (Path(root) / recipe.data.path).read_bytes()
        return cache_dir() / "datasets" / hashlib.sha256(config).hexdigest()[:16]
    return None


def hf_tokenizer(folder: str | Path):
    """The checkpoint's tokenizer as a transformers tokenizer (for lm-eval's HFLM route)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / TOKENIZER_FILE), eos_token=EOT)
    if (folder / TOKENIZER_SPEC_FILE).is_file():
        spec = json.loads((folder / TOKENIZER_SPEC_FILE).read_text())["spec"]
        try:
            return AutoTokenizer.from_pretrained(spec)
        except OSError as e:
            raise TokenizerError(f"the transformers route needs tokenizer {spec!r} from the hub ({e}); "
                                 f"evaluate with --route onenode, or put a {TOKENIZER_FILE} in {folder}") from None
    raise TokenizerError(f"{folder} carries no tokenizer for the transformers route: add {TOKENIZER_FILE}")


def _make_lm_class():
    """Define and register `OneNodeLM` (lm_eval is imported only here)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from tqdm.auto import tqdm

    @register_model("onenode")
    class OneNodeLM(TemplateLM):
        """`lm_eval --model onenode --model_args pretrained=CHECKPOINT[,batch_size=16,device=cuda]`."""

        def __init__(self, pretrained: str | None = None, model=None, tokenizer: Tokenizer | str | None = None,
                     batch_size: int | str = 16, max_length: int | str = DEFAULT_MAX_LENGTH,
                     device: str = "cpu", dtype: str | None = None, **_ignored):
            super().__init__()
            from ..model import NemotronHForCausalLM

            if model is None:
                if pretrained is None:
                    raise ValueError("model=onenode needs pretrained=CHECKPOINT_FOLDER")
                torch_dtype = getattr(torch, dtype) if dtype else None
                model = NemotronHForCausalLM.from_pretrained(pretrained, device=device, dtype=torch_dtype)
            if tokenizer is None or isinstance(tokenizer, str):
                if pretrained is None and tokenizer is None:
                    raise ValueError("OneNodeLM(model=...) needs tokenizer=")
                tokenizer = checkpoint_tokenizer(pretrained or ".", tokenizer)
            self.model = model.eval()
            self.tokenizer_ = tokenizer
            self.batch_size = int(batch_size)
            self._max_length = int(max_length)
            self.device_ = next(model.parameters()).device

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer_.eos_id

        @property
        def max_length(self) -> int:
            return self._max_length

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.tokenizer_.encode_batch([string])[0]

        def tok_decode(self, tokens, **kwargs) -> str:
            return self.tokenizer_.decode(tokens)

        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            """(sum of log p(continuation), whether it is the greedy continuation) per request;
            the longest first, so a batch's padding is small and memory peaks at once."""
            batch_size = override_bs or self.batch_size
            order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
            results: list[tuple[float, bool] | None] = [None] * len(requests)
            for start in tqdm(range(0, len(order), batch_size), disable=disable_tqdm, desc="onenode loglikelihood"):
                chunk = order[start:start + batch_size]
                rows, spans = [], []
                for i in chunk:
                    _, context, continuation = requests[i]
                    whole = (context + continuation)[-(self.max_length + 1):][:-1]
                    rows.append(whole)
                    spans.append((len(whole) - len(continuation), continuation))
                width = max(len(r) for r in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                for b, row in enumerate(rows):
                    ids[b, :len(row)] = torch.tensor(row)  # right padding never reaches earlier positions
                # Only the continuations' positions are scored, each row's as a view of the logits:
                # the log-softmax and the greedy check stay on the model's device, and the host gets
                # two numbers per request, not the batch's log-probabilities.
                logits = self.model(ids.to(self.device_)).logits
                totals, greedy = [], []
                for b, (first, continuation) in enumerate(spans):
                    scores = logits[b, first:first + len(continuation)].float()
                    target = torch.tensor(continuation, device=scores.device)
                    totals.append(torch.log_softmax(scores, -1).gather(-1, target[:, None]).sum())
                    greedy.append((scores.argmax(-1) == target).all())
                for i, total, all_greedy in zip(chunk, torch.stack(totals).tolist(), torch.stack(greedy).tolist()):
                    results[i] = (total, all_greedy)
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """Log-likelihood of whole texts in disjoint windows of `max_length` (perplexity);
            the windows of all texts are batched together."""
            owners, windows = [], []
            for n, (text,) in enumerate(r.args for r in requests):
                for window in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id,
                                                        self.max_length, context_len=1):
                    owners.append(n)
                    windows.append((None, *make_disjoint_window(window)))
            totals = [0.0] * len(requests)
            for n, (ll, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
                totals[n] += ll
            for request, total in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            raise NotImplementedError("model=onenode scores likelihoods only: choose tasks without generation "
                                      "(the kit's suites have none)")

    return OneNodeLM


_LM_CLASS = None


def onenode_lm_class():
    """The registered `OneNodeLM` class (registering it on first use)."""
    global _LM_CLASS
    if _LM_CLASS is None:
        _LM_CLASS = _make_lm_class()
    return _LM_CLASS
