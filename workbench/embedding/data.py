"""A small paired corpus from the shipped text (Genesis and Exodus, workbench/data, one verse per line,
2,746 verses). Two tasks:

``crops`` (the default): a pair is two independent crops of one verse, each a random run of ``crop`` of
its words (Contriever's independent cropping). The two views share some words and the verse's story but
rarely the same span, so the encoder has to learn which bytes carry the verse's content. A hard negative
is a crop of the verse ``hard_gap`` on (same story, other content). Crops depend on (seed, step, verse)
alone, so any split of a batch over ranks sees the same texts; held-out crops are fixed (``step=-1``).

``neighbours``: a pair is two neighbouring verses (verse ``2j``, verse ``2j + 1``, disjoint pairs so that
no verse is both a query and a candidate). Harder: neighbours share people and places but few words
(TF-IDF's top-1 on the held-out pairs is 0.09, chance 0.005), and a 1M-parameter byte-level encoder does
not beat its untrained self within a few hundred CPU steps. A hard negative for pair ``j`` is the first
verse of pair ``j + hard_gap``.

The last ``held_out`` units (verses or pairs; a contiguous block) are the evaluation set: retrieval
accuracy is how often a held-out query's nearest candidate among all held-out positives is its own.
Everything is byte-level (vocabulary 256) and deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import torch

from workbench.train.data import CORPUS

TASKS = ("crops", "neighbours")


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


def crop_words(text: str, frac: float, rng: random.Random) -> str:
    """A random run of ``round(frac * words)`` consecutive words of ``text`` (at least one)."""
    words = text.split()
    k = max(1, round(frac * len(words)))
    start = rng.randrange(len(words) - k + 1)
    return " ".join(words[start:start + k])


@dataclass
class PairCorpus:
    """(query, positive, hard negative) triples; ``batch_ids(step, size)`` and ``triples(ids, step)`` depend
    on ``(seed, step)`` and the ids alone."""

    seq_len: int = 64
    held_out: int = 200
    hard_gap: int = 3
    seed: int = 0
    task: str = "crops"
    crop: float = 0.6

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is unknown; choose one of {', '.join(TASKS)}")
        if not 0 < self.crop <= 1:
            raise ValueError(f"crop={self.crop} must be in (0, 1], the fraction of a verse's words in each view")
        units = len(verses()) // 2 if self.task == "neighbours" else len(verses())
        what = "pairs" if self.task == "neighbours" else "verses"
        if not 0 < self.held_out < units // 2:
            raise ValueError(f"held_out={self.held_out} must be in [1, {units // 2}); the corpus has {units} {what}")
        # training units' hard negatives stay out of the held-out block
        self.train_ids = torch.arange(0, units - self.held_out - self.hard_gap)
        self.eval_ids = torch.arange(units - self.held_out, units)

    def texts(self, ids: torch.Tensor, step: int = -1) -> tuple[list[str], list[str], list[str]]:
        """``(queries, positives, hard negatives)`` of units ``ids`` as text; ``step`` picks the crops
        (-1: the fixed held-out ones)."""
        v = verses()
        if self.task == "neighbours":
            return ([v[2 * j] for j in ids.tolist()], [v[2 * j + 1] for j in ids.tolist()],
                    [v[min(2 * (j + self.hard_gap), len(v) - 2)] for j in ids.tolist()])
        q, p, h = [], [], []
        for j in ids.tolist():
            rng = random.Random(f"{self.seed}:{step}:{j}")  # a str seed is hashed the same in every process
            q.append(crop_words(v[j], self.crop, rng))
            p.append(crop_words(v[j], self.crop, rng))
            h.append(crop_words(v[min(j + self.hard_gap, len(v) - 1)], self.crop, rng))
        return q, p, h

    def triples(self, ids: torch.Tensor, step: int = -1):
        """``(queries, positives, hard negatives)`` of units ``ids``, each ``(tokens, lengths)``."""
        return tuple(tokenize(x, self.seq_len) for x in self.texts(ids, step))

    def batch_ids(self, step: int, size: int) -> torch.Tensor:
        """The global batch of ``step``: ``size`` training units, a fresh permutation each epoch."""
        n = len(self.train_ids)
        if size > n:
            raise ValueError(f"batch size {size} exceeds the {n} training units; use at most {n}")
        per_epoch = n // size
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        return self.train_ids[perm[k * size:(k + 1) * size]]
