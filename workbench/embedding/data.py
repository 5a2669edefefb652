"""A small paired corpus from the shipped text: a verse and the verse after it.

Genesis and Exodus (workbench/data, one verse per line, 2,746 verses) give 1,373 disjoint pairs
(verse ``2j``, verse ``2j + 1``): neighbours share people, places and phrasing, which is what an
embedding can learn. The pairs are disjoint so that no verse is both a query and a candidate: with
overlapping pairs (``i``, ``i + 1``) and (``i + 1``, ``i + 2``) a query would find its own text among the
candidates. A hard negative for pair ``j`` is the first verse of pair ``j + hard_gap`` (same story, not the
neighbour). The last ``held_out`` pairs (a contiguous block) are the evaluation set: retrieval accuracy is
how often a held-out verse's nearest candidate among all held-out second verses is its own.
Everything is byte-level (vocabulary 256) and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import torch

from workbench.train.data import CORPUS


@lru_cache(maxsize=1)
def verses() -> tuple[str, ...]:
    text = resources.files("workbench.data").joinpath(CORPUS).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def tokenize(texts: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes, truncated or right-padded (0) to ``seq_len``: ``(tokens (B, seq_len), lengths (B,))``."""
    out = torch.zeros(len(texts), seq_len, dtype=torch.long)
    lengths = torch.empty(len(texts), dtype=torch.long)
    for i, t in enumerate(texts):
        b = t.encode("utf-8")[:seq_len] or b" "
        out[i, :len(b)] = torch.tensor(list(b), dtype=torch.long)
        lengths[i] = len(b)
    return out, lengths


@dataclass
class PairCorpus:
    """(query, positive, hard negative) triples; ``batch_ids(step, size)`` depends on ``(seed, step)`` alone."""

    seq_len: int = 64
    held_out: int = 200
    hard_gap: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        pairs = len(verses()) // 2
        if not 0 < self.held_out < pairs // 2:
            raise ValueError(f"held_out={self.held_out} must be in [1, {pairs // 2}); the corpus has {pairs} pairs")
        # pair j = (verse 2j, verse 2j + 1); training pairs' hard negatives stay out of the held-out block
        self.train_ids = torch.arange(0, pairs - self.held_out - self.hard_gap)
        self.eval_ids = torch.arange(pairs - self.held_out, pairs)

    def triples(self, ids: torch.Tensor):
        """``(queries, positives, hard negatives)`` of pairs ``ids``, each ``(tokens, lengths)``."""
        v = verses()
        q = [v[2 * j] for j in ids.tolist()]
        p = [v[2 * j + 1] for j in ids.tolist()]
        h = [v[min(2 * (j + self.hard_gap), len(v) - 2)] for j in ids.tolist()]
        return tuple(tokenize(x, self.seq_len) for x in (q, p, h))

    def batch_ids(self, step: int, size: int) -> torch.Tensor:
        """The global batch of ``step``: ``size`` training pairs, a fresh permutation each epoch."""
        n = len(self.train_ids)
        if size > n:
            raise ValueError(f"batch size {size} exceeds the {n} training pairs; use at most {n}")
        per_epoch = n // size
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        return self.train_ids[perm[k * size:(k + 1) * size]]
