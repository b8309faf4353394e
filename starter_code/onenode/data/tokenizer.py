"""One small tokenizer interface over three real tokenizers, all usable offline.

- `gpt2`: the GPT-2 BPE (50257 ids), from `whisper/assets/gpt2.tiktoken` in the `openai-whisper`
  sdist on PyPI, run by tiktoken (`tiktoken.get_encoding("gpt2")` would need the internet).
- a `tokenizer.json` path: a byte-level BPE trained on the corpus with `tokenizers` (`train_bpe`).
- anything else: a transformers tokenizer by hub name or local folder (`AutoTokenizer`).

Every tokenizer has a stable `content_hash` so a manifest pins exactly which one made a shard.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path

EOT = "<|endoftext|>"
# The GPT-2 pre-tokenizer split (contractions, letter runs, digit runs, other runs, spaces).
GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(ValueError):
    """A tokenizer could not be loaded; the message says what to do."""


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        raise TokenizerError(f"{what} needs the package {module!r}: pip install {module} "
                             "(or the kit's `data` extra)") from None


class Tokenizer:
    """What the pipeline needs from a tokenizer. Subclasses set name, vocab_size and eos_id."""

    name: str
    vocab_size: int
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def content_hash(self) -> str:
        """sha256 of what defines the tokenizer (its vocabulary and merges), not of its name."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "sha256": self.content_hash()}


class TiktokenGPT2(Tokenizer):
    """The real GPT-2 BPE, loaded from a local ranks file."""

    def __init__(self, ranks_file: Path):
        tiktoken_load = _require("tiktoken.load", "the GPT-2 tokenizer")
        tiktoken = _require("tiktoken", "the GPT-2 tokenizer")
        self._file = Path(ranks_file)
        ranks = tiktoken_load.load_tiktoken_bpe(str(self._file))
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_SPLIT, mergeable_ranks=ranks,
                                      special_tokens={EOT: len(ranks)})
        self.name, self.vocab_size, self.eos_id = "gpt2", self._enc.n_vocab, len(ranks)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Special-token strings inside documents are encoded as text, never as EOS.
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))

    def content_hash(self) -> str:
        return hashlib.sha256(self._file.read_bytes()).hexdigest()


class JsonBPE(Tokenizer):
    """A `tokenizers` tokenizer saved as tokenizer.json (e.g. one `train_bpe` made)."""

    def __init__(self, path: Path):
        tokenizers = _require("tokenizers", "a tokenizer.json tokenizer")
        self._path = Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self._path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"cannot read tokenizer {self._path}: {e}") from None
        eos = self._tok.token_to_id(EOT)
        if eos is None:
            raise TokenizerError(f"{self._path} has no {EOT} token to end documents with")
        self.name = f"bpe:{self._path.name}"
        self.vocab_size, self.eos_id = self._tok.get_vocab_size(), eos

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def content_hash(self) -> str:
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()


class HFTokenizer(Tokenizer):
    """Any transformers tokenizer by hub name or local path (the course node's usual choice)."""

    def __init__(self, name_or_path: str):
        transformers = _require("transformers", f"tokenizer {name_or_path!r}")
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"cannot load tokenizer {name_or_path!r} ({first}); use `gpt2`, "
                                 "a tokenizer.json path, or a hub name reachable from here") from None
        if self._tok.eos_token_id is None:
            raise TokenizerError(f"tokenizer {name_or_path!r} has no EOS token to end documents")
        self.name, self.vocab_size, self.eos_id = name_or_path, len(self._tok), self._tok.eos_token_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def content_hash(self) -> str:
        backend = getattr(self._tok, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(
            sorted(self._tok.get_vocab().items()))
        return hashlib.sha256(text.encode()).hexdigest()


def gpt2_ranks_file() -> Path:
    """`gpt2.tiktoken` from the openai-whisper sdist, extracted once into the cache."""
    from onenode.data.corpus import cache_dir, cache_lock, pip_sdist

    path = cache_dir() / "tokenizers" / "gpt2.tiktoken"
    with cache_lock("gpt2.tiktoken"):
        if not path.exists():
            with tarfile.open(pip_sdist("openai-whisper==20250625")) as tar:
                member = next((m for m in tar.getmembers()
                               if m.name.endswith("whisper/assets/gpt2.tiktoken")), None)
                if member is None:
                    raise TokenizerError("the openai-whisper sdist has no whisper/assets/gpt2.tiktoken")
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(tar.extractfile(member).read())
                tmp.replace(path)
    return path


def load_tokenizer(spec: str) -> Tokenizer:
    """`gpt2`, a path to a tokenizer.json, or a transformers name/folder."""
    if spec == "gpt2":
        return TiktokenGPT2(gpt2_ranks_file())
    if spec.endswith(".json"):
        if not Path(spec).is_file():
            raise TokenizerError(f"tokenizer file {spec} does not exist (train one with "
                                 "`tokenizer: {train_bpe: {vocab_size: N}}` in the data config)")
        return JsonBPE(Path(spec))
    return HFTokenizer(spec)


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> JsonBPE:
    """Train a byte-level BPE on `texts` and save it as `out` (a tokenizer.json)."""
    tokenizers = _require("tokenizers", "training a BPE")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return JsonBPE(out)


def data_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer that built a data folder, checked against the hash in its manifest."""
    from onenode.data.shards import read_manifest

    manifest = read_manifest(Path(data_dir))
    spec = manifest["config"]["tokenizer"]
    tokenizer = load_tokenizer(str(Path(data_dir) / "tokenizer.json") if isinstance(spec, dict) else spec)
    if tokenizer.content_hash() != manifest["tokenizer"]["sha256"]:
        raise TokenizerError(f"tokenizer {tokenizer.name!r} is not the one that built {data_dir} "
                             "(its content hash differs): rebuild the folder or restore the tokenizer")
    return tokenizer
