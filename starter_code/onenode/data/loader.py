"""The training loader: a weighted mixture of sources, packed into fixed-length sequences.

How a batch is made (all of it a pure function of the seed, the weights and the step, so a
resumed run sees exactly the tokens an uninterrupted one would have seen):
- each source is an endless token stream: its documents (each ending in EOS) in a seeded random
  order, a fresh order every epoch;
- sequence i of a source is the window stream[i*T : i*T + T + 1], so every token is a target
  exactly once per epoch and documents are packed across sequence boundaries;
- each step draws world_size * batch_size sequences; the source of each is the one furthest
  behind its share (smooth weighted round robin), so after n sequences every source has
  weight * n of them up to one: exact token accounting, no sampling noise;
- the step's block is shuffled (seed, step) and rank r takes rows [r*B, (r+1)*B) of it: ranks
  never share a sequence, and no rank is tied to one source.

The loader counts the tokens it served and keeps a running digest of the data order,
sha256(previous digest || this batch's token windows), which the trainer writes into
checkpoints and the run manifest.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import numpy as np
import torch

from onenode.data.shards import Shard, open_shards


class _SourceStream:
    """One source's documents in a seeded order per epoch, read as one endless token stream."""

    def __init__(self, name: str, shard: Shard, seed: int):
        self.name, self.shard, self.seed = name, shard, seed
        self.lengths = np.diff(shard.offsets)
        self.total = int(self.lengths.sum())
        self._epoch_ends: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._epoch_ends:
            rng = np.random.default_rng([self.seed, zlib.crc32(self.name.encode()), epoch])
            order = rng.permutation(self.shard.num_docs)
            if len(self._epoch_ends) >= 2:  # a window spans at most two epochs
                self._epoch_ends.pop(min(self._epoch_ends))
            self._epoch_ends[epoch] = (order, np.cumsum(self.lengths[order]))
        return self._epoch_ends[epoch]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the endless stream."""
        out, filled = np.empty(n, dtype=np.int64), 0
        while filled < n:
            epoch, offset = divmod(start + filled, self.total)
            order, ends = self._epoch(epoch)
            k = int(np.searchsorted(ends, offset, side="right"))
            doc_start = int(ends[k] - self.lengths[order[k]])
            piece = self.shard.document(int(order[k]))[offset - doc_start :][: n - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
        return out


class MixtureLoader:
    """Yields (input_ids, labels) LongTensors of shape [batch_size, seq_len] from a built data
    folder; labels[:, t] is the token after input_ids[:, t]."""

    def __init__(self, data_dir: str | Path, batch_size: int, seq_len: int, *,
                 split: str = "train", weights: dict[str, float] | None = None, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        manifest, shards = open_shards(data_dir, split)
        if weights is None:
            weights = {n: s["weight"] for n, s in manifest["sources"].items()}
        unknown = set(weights) - set(shards)
        if unknown:
            raise ValueError(f"weights name unknown source(s) {sorted(unknown)}; the data folder "
                             f"has {sorted(shards)}")
        # a source with no documents in this split (a tiny one's val) cannot be drawn from
        names = sorted(n for n, w in weights.items() if w > 0 and len(shards[n].tokens) > 0)
        if not names:
            raise ValueError(f"no source with a weight > 0 has {split} tokens: check the weights "
                             "and `onenode data inspect` the folder")
        self.streams = [_SourceStream(n, shards[n], seed) for n in names]
        total = sum(weights[n] for n in names)
        self.weights = np.array([weights[n] / total for n in names])
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size, self.split = rank, world_size, split
        self.eos_id = manifest["tokenizer"]["eos_id"]
        self._settings = {"seed": seed, "batch_size": batch_size, "seq_len": seq_len,
                          "world_size": world_size, "split": split,
                          "weights": dict(zip(names, self.weights.tolist())),
                          "tokenizer": manifest["tokenizer"]["sha256"],
                          "shards": {n: manifest["sources"][n]["splits"][split]["sha256"] for n in names}}
        self.step = 0
        self.sequences_drawn = np.zeros(len(names), dtype=np.int64)  # global, all ranks
        self.tokens_served = 0
        self.tokens_per_source = dict.fromkeys(names, 0)
        self.order_digest = hashlib.sha256(b"").hexdigest()

    def __iter__(self):
        return self

    def _choose_sources(self, count: int) -> np.ndarray:
        """Smooth weighted round robin: each row goes to the source furthest below its share."""
        drawn, chosen = self.sequences_drawn.copy(), np.empty(count, dtype=np.int64)
        for row in range(count):
            deficit = self.weights * (drawn.sum() + 1) - drawn
            chosen[row] = int(np.argmax(deficit))
            drawn[chosen[row]] += 1
        return chosen

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []  # (source, sequence index within it) of the step's global block, in draw order
        for source in self._choose_sources(self.world_size * self.batch_size):
            rows.append((source, int(self.sequences_drawn[source])))
            self.sequences_drawn[source] += 1
        # shuffle the block so no rank or row slot is tied to one source by the round robin
        order = np.random.default_rng([self.seed, self.step]).permutation(len(rows))
        windows = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        for i, row in enumerate(order[self.rank * self.batch_size :][: self.batch_size]):
            source, index = rows[row]
            stream = self.streams[source]
            windows[i] = stream.read(index * self.seq_len, self.seq_len + 1)
            self.tokens_per_source[stream.name] += self.seq_len
        self.step += 1
        self.tokens_served += windows.shape[0] * self.seq_len
        self.order_digest = hashlib.sha256(
            bytes.fromhex(self.order_digest) + windows.astype("<i8").tobytes()).hexdigest()
        tokens = torch.from_numpy(windows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """Everything needed to resume exactly here (plain Python values, checkpoint-friendly)."""
        return {"step": self.step, "sequences_drawn": self.sequences_drawn.tolist(),
                "tokens_served": self.tokens_served,
                "tokens_per_source": dict(self.tokens_per_source),
                "order_digest": self.order_digest, "rank": self.rank, "settings": self._settings}

    def load_state_dict(self, state: dict) -> None:
        if state["settings"] != self._settings:
            changed = sorted(k for k in self._settings if state["settings"].get(k) != self._settings[k])
            raise ValueError(f"loader state was saved with different {', '.join(changed)}; resume "
                             "with the same data folder, seed, batch, sequence length and world size")
        if state["rank"] != self.rank:
            raise ValueError(f"loader state belongs to rank {state['rank']}, not rank {self.rank}")
        self.step, self.tokens_served = state["step"], state["tokens_served"]
        self.sequences_drawn = np.asarray(state["sequences_drawn"], dtype=np.int64)
        self.tokens_per_source = dict(state["tokens_per_source"])
        self.order_digest = state["order_digest"]
