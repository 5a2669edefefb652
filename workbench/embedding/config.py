"""The embedding trainer's own settings (the model, layout and optimizer are the usual ModelConfig,
ParallelConfig and TrainConfig): pooling, projection, loss and corpus. Declared once here; the command
line (``workbench train-embedding``) is generated from these declarations."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import MAX_BATCH, MAX_STEPS, MAX_WIDTH, _JsonMixin
from workbench.schema import check, setting

POOLINGS = ("mean", "last")
TASKS = ("crops", "neighbours")


@dataclass(frozen=True)
class EmbeddingConfig(_JsonMixin):
    """How queries and candidates are embedded and contrasted."""

    settings_group = "embedding"  # the argparse group of these settings (not a field)

    pooling: str = setting("mean", "pool the final hidden states: mean over real tokens, or the last one",
                           choices=POOLINGS)
    projection: int | None = setting(None, "a linear projection of the pooled states to this size", min=1,
                                     none="none: the model's hidden size", limit=MAX_WIDTH)
    temperature: float = setting(0.05, "InfoNCE temperature (the initial one when learned)", min=0,
                                 exclusive_min=True)
    learn_temperature: bool = setting(False, "learn the temperature (log-parameterised, at least 0.01)")
    matryoshka: str = setting("", "Matryoshka prefixes: the loss is summed over these embedding sizes, e.g. "
                              "'64,32' (empty: the whole embedding only)")
    hard_negatives: bool = setting(True, "append each query's hard negative (from a verse a few lines on) to the "
                                   "candidates")
    chunk: int | None = setting(None, "GradCache chunk: rows per forward with gradients; the loss still "
                                "sees the whole global batch", min=1, none="the rank's whole batch", limit=MAX_BATCH)
    task: str = setting("crops", "the pairs: two random crops of one verse (crops), or a verse and the next "
                        "one (neighbours, much harder)", choices=TASKS)
    crop: float = setting(0.6, "crops: the fraction of a verse's words in each view", min=0, max=1,
                          exclusive_min=True)
    held_out: int = setting(200, "held-out verses (pairs) for retrieval accuracy: the candidates of each query",
                            min=2)
    hard_gap: int = setting(3, "a query's hard negative comes from the verse (pair) this far on", min=1,
                            limit=MAX_STEPS)
    eval_every: int = setting(50, "evaluate retrieval accuracy every N steps (and after the last)", min=0,
                              off="0: after the last step only", metavar="N", limit=MAX_STEPS)

    def __post_init__(self) -> None:
        check(self)
        self.dims()  # a malformed list fails here, naming the setting

    def dims(self) -> tuple[int, ...] | None:
        """The Matryoshka prefixes as integers, or None."""
        text = self.matryoshka.replace(" ", "")
        if not text:
            return None
        try:
            dims = tuple(int(d) for d in text.split(","))
        except ValueError:
            raise ValueError(f"matryoshka={self.matryoshka!r} must be comma-separated sizes, e.g. '64,32'") from None
        if any(d < 1 for d in dims):
            raise ValueError(f"matryoshka={self.matryoshka!r}: every size must be at least 1")
        return dims

    def check_width(self, width: int) -> None:
        """Every Matryoshka prefix fits in the embedding (``width``: projection or hidden size)."""
        too_big = [d for d in self.dims() or () if d > width]
        if too_big:
            raise ValueError(f"matryoshka sizes {too_big} exceed the embedding size {width}; use sizes <= {width}")
