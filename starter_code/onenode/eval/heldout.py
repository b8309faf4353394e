"""Validation loss and perplexity on held-out tokens: a data folder's `val` split or a text file.

The token stream (documents ending in EOS, as the loader serves them) is cut into disjoint
windows of `seq_len + 1` tokens; every token after a window's first is predicted once. Token
loss depends on the tokenizer, so it compares runs of one tokenizer; the suite's
`onenode_heldout` task gives word perplexity and bits per byte, which compare across tokenizers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..data.tokenizer import Tokenizer
from ..model.loss import cross_entropy_loss


def val_split_tokens(data_dir: str | Path) -> np.ndarray:
    """Every source's `val` documents of a built data folder, one stream."""
    from ..data.shards import open_shards

    _, shards = open_shards(Path(data_dir), "val")
    streams = [np.asarray(s.tokens, dtype=np.int64) for s in shards.values() if len(s.tokens)]
    if not streams:
        raise ValueError(f"{data_dir} has no validation tokens: build it with val_fraction > 0")
    return np.concatenate(streams)


def text_tokens(path: str | Path, tokenizer: Tokenizer) -> np.ndarray:
    """A text file's blank-line-separated documents, tokenized, each ending with EOS."""
    text = Path(path).read_text(encoding="utf-8")
    docs = [d for d in text.split("\n\n") if d.strip()]
    if not docs:
        raise ValueError(f"{path} holds no text")
    ids = [i for doc in tokenizer.encode_batch(docs) for i in (*doc, tokenizer.eos_id)]
    return np.asarray(ids, dtype=np.int64)


@torch.no_grad()
def heldout_loss(model, tokens: np.ndarray, seq_len: int = 512, batch_size: int = 8,
                 max_tokens: int | None = None) -> dict:
    """Mean next-token loss and perplexity over disjoint windows of `tokens`."""
    if max_tokens:
        tokens = tokens[:max_tokens]
    vocab = model.config.vocab_size
    if len(tokens) and int(tokens.max()) >= vocab:
        raise ValueError(f"held-out tokens reach id {int(tokens.max())}, beyond the model's vocabulary of {vocab}: "
                         "they were made with another tokenizer")
    windows = len(tokens) // (seq_len + 1)
    if windows == 0:
        seq_len, windows = len(tokens) - 1, 1
    if seq_len < 1:
        raise ValueError("too few held-out tokens to measure a loss")
    rows = torch.from_numpy(tokens[:windows * (seq_len + 1)].reshape(windows, seq_len + 1))
    device = next(model.parameters()).device
    model.eval()
    total = 0.0
    for start in range(0, windows, batch_size):
        batch = rows[start:start + batch_size].to(device)
        logits = model(batch[:, :-1]).logits
        total += float(cross_entropy_loss(logits, batch[:, 1:])) * batch.shape[0]
    loss = total / windows
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": windows * seq_len, "seq_len": seq_len}
