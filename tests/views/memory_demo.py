"""Hand-made memory timelines with known numbers, for the memory-tab tests (payload and browser).

``demo_timeline()``: ``ranks`` ranks (rank r holds (r + 1) times rank 0's bytes), a build phase, then
``steps`` steps of ``microbatches`` forwards (``acts`` activations each), the backwards in reverse (each
frees its activations, makes a temporary and, in step 0, the gradients), and an optimizer phase (its state
made in step 0). Enough events that the views downsample, and enough phase spans (``steps * (2 m + 1) + 1``)
that they join bands. ``demo_prediction()``: a predicted rank 0 (event positions) standing for every rank.
"""

from __future__ import annotations

from workbench.memory.timeline import MemoryTimeline, TimelineBuilder

KIB = 1024


def _rank(rank: int, steps: int, microbatches: int, acts: int, source: str, scale: int) -> MemoryTimeline:
    b = TimelineBuilder(rank=rank)
    t, ident = 0.0, 0
    k = (rank + 1) * scale

    def add(delta: int, cat: str, phase: str, step: int, mb: int, module: str, op: str, i: int) -> None:
        nonlocal t
        b.add(t, delta, cat, phase, step, mb, module, op, i)
        t += 0.001 if source != "predicted" else 1.0

    params = []
    for j in range(8):  # 8 parameters of 64 KiB
        ident += 1
        params.append(ident)
        add(64 * KIB * k, "parameter", "build", -1, -1, f"layers.{j}", "aten::empty", ident)
    grads: list[int] = []
    for step in range(steps):
        live: dict[int, list[tuple[int, int]]] = {}
        for mb in range(microbatches):
            live[mb] = []
            for a in range(acts):
                ident += 1
                size = (4 + (a % 5)) * KIB * k
                live[mb].append((ident, size))
                add(size, "activation", "forward", step, mb, f"layers.{a % 8}", "aten::mm", ident)
        for mb in reversed(range(microbatches)):
            ident += 1
            tmp = ident
            add(96 * KIB * k, "temporary", "backward", step, mb, "layers.7", "aten::add", tmp)
            if step == 0 and mb == microbatches - 1:
                for j in range(8):
                    ident += 1
                    grads.append(ident)
                    add(64 * KIB * k, "gradient", "backward", step, mb, f"layers.{j}", "aten::mm", ident)
            add(-96 * KIB * k, "temporary", "backward", step, mb, "layers.7", "(free)", tmp)
            for i, size in reversed(live[mb]):
                add(-size, "activation", "backward", step, mb, f"layers.{i % 8}", "(free)", i)
        if step == 0:
            for j in range(16):  # AdamW: two states per parameter
                ident += 1
                add(64 * KIB * k, "optimizer", "optimizer", step, -1, "", "aten::zeros", ident)
        ident += 1
        add(8 * KIB * k, "temporary", "optimizer", step, -1, "", "aten::mul", ident)
        add(-8 * KIB * k, "temporary", "optimizer", step, -1, "", "(free)", ident)
    return b.timeline(source=source, device="cpu")


def demo_timeline(ranks: int = 3, steps: int = 30, microbatches: int = 4, acts: int = 60) -> MemoryTimeline:
    tl = MemoryTimeline.concat([_rank(r, steps, microbatches, acts, "measured", 1) for r in range(ranks)])
    tl.meta.update(model="demo", layout=f"dp_shard={ranks}")
    return tl


def demo_prediction(ranks: int = 3, steps: int = 2, microbatches: int = 4, acts: int = 60) -> MemoryTimeline:
    tl = _rank(0, steps, microbatches, acts, "predicted", 1)
    tl.meta["rank_map"] = {str(r): 0 for r in range(ranks)}
    return tl
