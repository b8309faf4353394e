"""`data.source: synthetic`: a seeded token stream with structure a model can learn, no files.

Each row is a walk on a fixed random graph: every token has `branching` possible successors,
so the best achievable loss is about log(branching) nats, far below log(vocab). Row `r` of the
run's global row order depends only on (seed, r), so any number of data-parallel ranks sees the
same global batches, and the loader's state is one integer. It has the loader interface the
trainer expects from `onenode.data`: iterate for (input_ids, labels) [B, T], `state_dict()`,
`load_state_dict()`, `tokens_served`, `order_digest`.
"""

from __future__ import annotations

import hashlib

import torch


class SyntheticLoader:
    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, branching: int = 4, split: str = "train"):
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed = seed + (0 if split == "train" else 1_000_003)  # val rows never repeat train rows
        graph_gen = torch.Generator().manual_seed(seed)  # the same graph for train and val
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=graph_gen)
        self.batches = 0  # global batches served
        self.order_digest = hashlib.sha256(f"synthetic:{vocab_size}:{seq_len}:{seed}:{split}".encode()).hexdigest()

    @property
    def tokens_served(self) -> int:
        """Tokens this rank has handed out."""
        return self.batches * self.batch_size * self.seq_len

    def _rows(self, first: int) -> torch.Tensor:
        """Rows first .. first + batch_size - 1, each drawn from its own generator, walked together."""
        starts, choices = [], []
        for index in range(first, first + self.batch_size):
            gen = torch.Generator().manual_seed(self.seed * 1_000_000_007 + index)
            starts.append(torch.randint(0, self.vocab_size, (1,), generator=gen))
            choices.append(torch.randint(0, self.successors.shape[1], (self.seq_len,), generator=gen))
        choice = torch.stack(choices)
        rows = torch.empty(self.batch_size, self.seq_len + 1, dtype=torch.long)
        rows[:, 0] = torch.cat(starts)
        for t in range(self.seq_len):
            rows[:, t + 1] = self.successors[rows[:, t], choice[:, t]]
        return rows

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        global_rows = self.batch_size * self.world_size
        rows = self._rows(self.batches * global_rows + self.rank * self.batch_size)
        # The digest chains the global row ranges served, in order: the same on every rank.
        record = f"{self.order_digest}:{self.batches * global_rows}:{global_rows}"
        self.order_digest = hashlib.sha256(record.encode()).hexdigest()
        self.batches += 1
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"batches": self.batches, "order_digest": self.order_digest}

    def load_state_dict(self, state: dict) -> None:
        self.batches, self.order_digest = state["batches"], state["order_digest"]
