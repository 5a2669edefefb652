"""Step timelines and an advice to show, made of real core objects (tests/views/test_time_view.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.time.timeline import StepTimeline, span_frame


def step_timeline(ranks: int = 4, steps: int = 3, ops: int = 200, slow_rank: int | None = None,
                  source: str = "measured", seed: int = 0, factor: float = 1.0) -> StepTimeline:
    """A training loop's spans: per rank and step a data span, ``ops`` forward and backward ops (a
    gradient all-reduce on the comm stream every 20th backward op), the optimizer, and an idle wait.
    ``slow_rank`` runs 30% slower (a straggler); ``factor`` scales every op."""
    rng = np.random.default_rng(seed)
    rows = []
    t0 = 0.0
    for s in range(steps):
        longest = 0.0
        for r in range(ranks):
            t = t0
            f = factor * (1.3 if r == slow_rank else 1.0)
            for cat in ("data", "forward", "backward", "optimizer"):
                for i in range(ops if cat in ("forward", "backward") else 3):
                    d = float(rng.uniform(1e-5, 3e-5)) * f
                    rows.append(dict(rank=r, start=t, end=t + d, category=cat, phase=cat, step=s, microbatch=0,
                                     module=f"layers.{i % 4}", stream="compute", name=f"aten::op{i % 7}"))
                    if cat == "backward" and i % 20 == 0:
                        rows.append(dict(rank=r, start=t, end=t + 4 * d, category="communication", phase="backward",
                                         step=s, microbatch=0, module="", stream="comm", name="gloo:all_reduce",
                                         bytes=4096))
                    t += d
            rows.append(dict(rank=r, start=t, end=t + 1e-4, category="idle", phase="other", step=s, microbatch=-1,
                             module="", stream="compute", name="wait:rank"))
            longest = max(longest, t + 1e-4 - t0)
        t0 += longest + 1e-4
    meta = {"device_model": {"name": "cpu", "calibrated": False}} if source == "predicted" else {}
    return StepTimeline(span_frame(rows), source=source, device="cpu", meta=meta)


def many_spans(n: int = 100_000, ranks: int = 4) -> StepTimeline:
    """``n`` short spans over ``ranks`` ranks and 4 steps, alternating categories (what a GPU trace with
    every kernel looks like)."""
    rng = np.random.default_rng(1)
    per = n // ranks
    frames = []
    for r in range(ranks):
        d = rng.exponential(1e-5, per)
        start = np.cumsum(d) + r * 1e-4
        i = np.arange(per)
        cat = np.where(i % 7 == 0, "communication", np.where(i % 5 == 0, "idle",
                                                             np.where(i % (per // 4) < per // 8, "forward", "backward")))
        frames.append(pd.DataFrame(dict(rank=r, start=start, end=start + 0.9 * d, category=cat, phase="other",
                                        step=i // (per // 4), microbatch=-1, module="",
                                        stream=np.where(cat == "communication", "comm", "compute"), name="k",
                                        bytes=0)))
    return StepTimeline(span_frame(pd.concat(frames, ignore_index=True)))


class AdviceLike:
    """What ``workbench.prediction.advise.Advice`` is agreed to hold (time_spec.md): rows with the layout,
    whether it fits, the predicted peak bytes and tokens/s and what bounds it; ``to_frame()``; ``pareto()``.
    For the views' tests while the advisor itself may be missing; the real one is tested too when present."""

    def __init__(self, model: str = "tiny"):
        self.model, self.gpus, self.gpu, self.gpu_memory = model, 2, "cpu", "1GiB"
        self.global_batch, self.seq_len = 4, 32
        self.rows = [
            dict(layout="dp_shard=2", fits=True, peak_bytes=300 << 20, tokens_per_s=9000.0, bound="compute"),
            dict(layout="tp=2", fits=True, peak_bytes=200 << 20, tokens_per_s=6000.0, bound="communication"),
            dict(layout="pp=2,microbatches=2", fits=True, peak_bytes=250 << 20, tokens_per_s=5000.0,
                 bound="bubble"),
            dict(layout="dp_replicate=2", fits=False, peak_bytes=2 << 30, tokens_per_s=float("nan"),
                 bound="memory"),
        ]

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def pareto(self) -> pd.DataFrame:
        """Fitting rows no other fitting row beats on both throughput and memory."""
        f = self.to_frame()
        f = f[f["fits"]]
        keep = [i for i, r in f.iterrows() if not ((f["tokens_per_s"] >= r.tokens_per_s)
                                                    & (f["peak_bytes"] <= r.peak_bytes)
                                                    & ((f["tokens_per_s"] > r.tokens_per_s)
                                                       | (f["peak_bytes"] < r.peak_bytes))).any()]
        return f.loc[keep]
