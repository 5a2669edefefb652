"""Deterministic, layout-independent training data.

Sample ``i`` of a dataset depends only on ``(seed, i)``. Step ``k`` trains on samples
``[k*B, (k+1)*B)`` of the global batch ``B``; data-parallel rank ``d`` of ``dp`` takes the contiguous
slice ``[d*B/dp, (d+1)*B/dp)`` of it and splits that into micro-batches. So the same command with another
layout trains on exactly the same samples, in the same order.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import torch

CORPUS = "kjv_genesis_exodus.txt"  # Genesis and Exodus, King James Version (public domain), ~360 KB


@lru_cache(maxsize=1)
def corpus_bytes() -> torch.Tensor:
    """The shipped text corpus as byte-level tokens (vocabulary 256)."""
    raw = resources.files("workbench.data").joinpath(CORPUS).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class SyntheticDataset:
    """Learnable token streams: a seeded random Markov chain (90% follow the chain, 10% noise).

    The loss can fall from ln(vocab) towards the chain's entropy, so curves mean something.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        gen = torch.Generator().manual_seed(seed)
        self.next_token = torch.randint(0, vocab_size, (vocab_size,), generator=gen)
        self._next = self.next_token.tolist()  # the chain walks in Python lists: ~17x faster than tensor indexing

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.seq_len + 1
        noise = torch.randint(0, self.vocab_size, (n,), generator=gen).tolist()
        follow = (torch.rand(n, generator=gen) < 0.9).tolist()
        nxt, out = self._next, [noise[0]]
        for t in range(1, n):
            out.append(nxt[out[-1]] if follow[t] else noise[t])
        return torch.tensor(out, dtype=torch.long)


class TextDataset:
    """Windows of the shipped corpus at seeded pseudo-random offsets (byte-level tokens)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        if vocab_size < 256:
            raise ValueError(f"data='text' uses byte tokens and needs vocab_size >= 256, got {vocab_size}")
        self.tokens = corpus_bytes()
        self.seq_len, self.seed = seq_len, seed
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"seq_len={seq_len} is longer than the corpus ({len(self.tokens)} bytes)")

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, len(self.tokens) - self.seq_len - 1, (1,), generator=gen))
        return self.tokens[start : start + self.seq_len + 1]


def make_dataset(kind: str, vocab_size: int, seq_len: int, seed: int):
    if kind == "synthetic":
        return SyntheticDataset(vocab_size, seq_len, seed)
    if kind == "text":
        return TextDataset(vocab_size, seq_len, seed)
    raise ValueError(f"data={kind!r} is unknown; choose 'synthetic' or 'text'")


def micro_batches(dataset, step: int, global_batch: int, dp_rank: int, dp: int, micro: int):
    """The (inputs, targets) micro-batches that ``dp_rank`` trains on at ``step``."""
    per_rank = global_batch // dp
    first = step * global_batch + dp_rank * per_rank
    for m in range(per_rank // micro):
        rows = torch.stack([dataset[first + m * micro + j] for j in range(micro)])
        yield rows[:, :-1], rows[:, 1:]
