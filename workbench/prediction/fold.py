"""Predict a stage of N identical transformer blocks by simulating 4 of them: the fold.

A fake step costs time per operator, and nearly all of a large model's operators are its blocks': a
llama-70b stage of 20 blocks spends 95% of its simulation in them (fsdp 32 x tp 8 x pp 4, 1F1B). The
blocks are identical (the same shapes, the same sharding, the same code), so what a middle block does
repeats from one block to the next. The fold simulates each stage with four blocks, the first, two middle
ones (F and M) and the last (L), and writes the timeline of all N::

    simulated       ... | 0 | F | M | L | ...            (every pass: build, forward, backward, optimizer)
    predicted       ... | 0 | F | M M ... M | L | ...    M repeated N - 3 times, as layers a+2 .. b-1

M repeats because both its neighbours are blocks like any other's: F is a middle block too. (FSDP2
gathers the next block down while one computes its backward, except below the first block, so the first
middle block's backward is not the others'; with 3 blocks the checks below refuse the fold.)

**What the program was working on.** The recorder (``MemoryRecorder(blocks=True)``) knows which block
every parameter-like storage belongs to (a parameter, its gathered copy, its gradient, its optimizer
state), and, per operator, which storages it read. From an operator that reads storages of one block and
makes or frees something on, the *context* is that block (several: none); a new pass (phase, step or
micro-batch) and an optimizer step's end start outside the blocks. A *run* is a stretch of one context.

**Periods.** A block's *period* in a pass is its run, what it encloses before its next run (a run outside
the blocks: in forward, the casts of the rotary tables it is handed; a neighbour's run: in backward, FSDP2
gathering the block below while this one computes, ``[b][b-1][b]``), and a run outside the blocks just
before it between its neighbours. M's periods are written N - 3 times, one copy per layer, in the pass's
order (up the layers in forward and the optimizer, down in backward).

**Who owns what.** A storage belongs to its block when it is parameter-like, else to the period that
made it (runs in no period: outside the blocks). A copy q of M makes its own copy of everything M made;
where M touches what F or L own, the copy touches what its own neighbours own: the real F or L next to
it, else copies of M's *counterpart*, the storage M made in the same place (a parameter, gradient or
state of the same name; else the k-th storage of the same owner made in the same run of its period, the
runs counted from the period's end, in the same pass). F's and L's periods touching M's storages touch
the copy next to them; events outside any period that touch M's storages (``zero_grad``, a list of the
gradient norm's sums freed) are repeated once per copy, in their neighbours' order. A ``stack``/``cat``
outside the periods whose inputs include M's (the gradient norm's one sum per parameter) grows by them
once per added copy.

**Groups.** Layer-level selective checkpointing of every k-th block makes blocks alternate (stage
positions 0, k, 2k, ... checkpointed), but groups of k consecutive blocks repeat: the fold then simulates
4 groups (4k blocks) and folds groups as it folds blocks, a group standing as one "block" (``group=k``;
a storage's role names its block within the group). Llama 3.1 8B at seq 8192 (32 blocks, every 2nd
checkpointed) simulates 8 blocks instead of 32.

**Checks.** Every storage of F or L that M touches must have its counterpart (same size and category),
and M must touch nothing of the blocks beyond its neighbours; otherwise :class:`FoldError`, and the caller
simulates every block (``workbench.prediction.memory``). ``tests/test_memory_fold.py`` checks folded
timelines against full simulations, event by event, in the layouts the fold takes (:func:`fold_plan`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["FoldError", "fold_rows", "FoldResult", "FoldPlan", "fold_plan", "SIMULATED_BLOCKS"]

SIMULATED_BLOCKS = 4  # per stage: the first, two middle ones and the last (see above)

OUTSIDE, MIXED = -1, -2
_LAYER = re.compile(r"(?<![\w])layers\.(\d+)(?=\.|$)")


class FoldError(ValueError):
    """The simulated blocks do not repeat the way a fold needs (the caller simulates every block)."""


@dataclass(frozen=True)
class FoldPlan:
    """Predict ``rank`` by simulating ``job`` (its stages of ``simulated`` blocks) for a stage of ``real``;
    ``group`` consecutive blocks repeat as one unit (selective checkpointing of every ``group``-th block)."""

    job: Any
    simulated: list[int]
    real: list[int]
    group: int = 1


def fold_plan(job: Any, rank: int) -> FoldPlan | None:
    """How to predict ``rank`` of ``job`` with SIMULATED_BLOCKS blocks per stage, or None where a fold would not
    be exact or gains nothing: a mixture of experts (a router's balance is not a block's alone), data
    parallelism through DDP or ZeRO-1 (their gradient buckets and optimizer partitions cut across
    blocks), several stages per rank, or a stage of SIMULATED_BLOCKS blocks or fewer.

    Layer-level selective checkpointing of every k-th block (k > 1) checkpoints stage positions 0, k, 2k,
    ...: blocks alternate, but groups of k repeat, so the fold simulates SIMULATED_BLOCKS groups of k and
    folds groups (a stage whose length k does not divide is simulated whole)."""
    import dataclasses

    from workbench.parallel.apply import ddp_dim
    from workbench.parallel.pipeline import split_layers

    model, parallel, train = job.model, job.parallel, job.train
    if model.n_experts or parallel.pp_stages_per_rank != 1 or ddp_dim(parallel) is not None:
        return None
    group = train.ac_every if train.activation_checkpointing == "selective" else 1
    stage = parallel.rank_coords(rank)[0]
    real = split_layers(model.n_layers, parallel.pp)[stage]
    if len(real) % group or len(real) // group <= SIMULATED_BLOCKS:
        return None
    small = dataclasses.replace(job, model=dataclasses.replace(model, n_layers=SIMULATED_BLOCKS * group * parallel.pp))
    return FoldPlan(small, split_layers(SIMULATED_BLOCKS * group * parallel.pp, parallel.pp)[stage], list(real), group)


@dataclass
class FoldResult:
    """The folded events, every storage's category (the copies' included), and what was folded."""

    rows: list[tuple]
    categories: dict[int, str]
    info: dict[str, Any] = field(default_factory=dict)


def _contexts(rows: list[tuple], touched: list[tuple[int, tuple[int, ...] | None]], block_of: dict[int, int],
              made_by: dict[int, int] | None = None) -> np.ndarray:
    """The context of every row: the block whose parameter-like storages were read by the last operator that
    made or freed anything (at the build: by the last operator; several blocks, or what three or more blocks
    made (``made_by``): MIXED), carried forward within a pass; OUTSIDE at the start of each pass. Operators
    that only look at parameters, like FSDP2's first-step set-up touching every block's, leave it as it is."""
    n = len(rows)
    ctx = np.full(n, OUTSIDE, dtype=np.int64)
    change = {}  # row -> the context from that row on
    for j, (row, idents) in enumerate(touched):
        if idents is None and row < n:
            change[row] = OUTSIDE
            continue
        if not idents or row >= n:
            continue
        # nothing made or freed before the next operator: it only looked (except at the build, where a
        # parameter's value is made by operators that read nothing and copied in by one that makes nothing)
        if row >= (touched[j + 1][0] if j + 1 < len(touched) else n) and rows[row][3] != "build":
            continue
        blocks = {block_of[i] for i in idents if i in block_of}
        if blocks:
            change[row] = blocks.pop() if len(blocks) == 1 else MIXED
        elif made_by is not None and len({made_by[i] for i in idents if made_by.get(i, OUTSIDE) >= 0}) >= 3:
            change[row] = MIXED  # combines what three or more blocks made (the gradient norm's sums): none's
    current, prev_pass = OUTSIDE, None
    for i, r in enumerate(rows):
        this_pass = (r[3], r[4], r[5])
        if this_pass != prev_pass:
            current, prev_pass = OUTSIDE, this_pass
        current = change.get(i, current)
        ctx[i] = current
    return ctx


def _periods(run_ctx: list[int], run_pass: list[tuple], blocks: set[int]) -> list[int | None]:
    """The block whose period each run is in (None: none): a block's run, and what it encloses before its
    next run in the pass (a run outside the blocks, or of a neighbour: ``[b][b-1][b]``); a run outside the
    blocks between two blocks' runs joins the next one."""
    n = len(run_ctx)
    period: list[int | None] = [None] * n
    r = 0
    while r < n:
        c = run_ctx[r]
        if c in blocks:
            period[r] = c
            while (r + 2 < n and run_ctx[r + 2] == c and run_pass[r] == run_pass[r + 1] == run_pass[r + 2]
                   and (run_ctx[r + 1] == OUTSIDE or (run_ctx[r + 1] in blocks and abs(run_ctx[r + 1] - c) == 1))):
                period[r + 1] = period[r + 2] = c
                r += 2
        r += 1
    for r in range(1, n - 1):  # an outside run between runs of one block, or of neighbours: the next one's
        prev, nxt = period[r - 1], period[r + 1]
        if (period[r] is None and run_ctx[r] == OUTSIDE and prev is not None and nxt is not None
                and abs(nxt - prev) <= 1 and run_pass[r - 1] == run_pass[r] == run_pass[r + 1]):
            period[r] = nxt
    return period


def fold_rows(rows: list[tuple], final: dict[int, str], trace: Any, simulated: list[int], real: list[int],
              round_bytes: Callable[[int], int], group: int = 1) -> FoldResult:
    """The rows of a stage with blocks ``real`` from those of the same stage simulated with blocks
    ``simulated`` (the last three are F, M and L; any before them only must not meet M). ``rows`` are a
    TimelineBuilder's (t, delta, category, phase, step, microbatch, module, op, ident); ``final`` the
    recorder's ident -> category; ``trace`` its :class:`~workbench.memory.recorder.BlockTrace`;
    ``round_bytes`` its allocator's rounding. ``group`` > 1: runs of ``group`` consecutive blocks are the
    units that repeat (each named by its first layer; a storage's role says which block of the group).
    Raises :class:`FoldError` where the blocks do not repeat."""
    # a snapshot: storages freed while this runs (the simulation's objects being collected) log more rows
    rows, touched = list(rows), list(trace.touched)
    block_of, joined, role_of = dict(trace.block_of), dict(trace.joined), dict(trace.role_of)
    final = dict(final)
    sim0, real0 = (simulated or [0])[0], (real or [0])[0]
    if group > 1:  # group g of the stage is "block" sim0 + g (real0 + g), neighbours one apart as blocks are
        if len(simulated) % group or len(real) % group:
            raise FoldError(f"a fold of groups of {group} blocks needs stages of whole groups "
                            f"(got {len(simulated)} simulated, {len(real)} real)")
        pos = {b: i for i, b in enumerate(simulated)}
        role_of = {x: (kind, f"+{pos[block_of[x]] % group}.{path}", k) if block_of.get(x) in pos else (kind, path, k)
                   for x, (kind, path, k) in role_of.items()}
        block_of = {x: sim0 + pos[b] // group if b in pos else b for x, b in block_of.items()}
        simulated = [sim0 + g for g in range(len(simulated) // group)]
        real = [real0 + g for g in range(len(real) // group)]
    K = len(simulated)
    if K < 3 or len(real) < K:
        raise FoldError(f"a fold simulates 3 or more blocks of a stage of as many (got {simulated} for {len(real)})")
    *OUTER, F, M, L = simulated  # M repeats; F and L are its neighbours; OUTER come before F
    copies = len(real) - K + 1
    n = len(rows)
    ident = np.fromiter((r[8] for r in rows), dtype=np.int64, count=n)
    delta = np.fromiter((r[1] for r in rows), dtype=np.int64, count=n)
    ctx = _contexts(rows, touched, block_of)
    # who owns each storage, and where it was made (the first row that allocated it)
    made_at: dict[int, int] = {}
    for i, x in enumerate(ident.tolist()):
        if delta[i] > 0 and x not in made_at:
            made_at[x] = i
    made_by = {x: block_of.get(x, int(ctx[i])) for x, i in made_at.items()}
    ctx = _contexts(rows, touched, block_of, made_by)

    starts = np.r_[0, np.flatnonzero(np.diff(ctx) | _pass_changes(rows)) + 1] if n else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], n]
    run_of = np.repeat(np.arange(len(starts)), ends - starts)
    run_ctx = ctx[starts].tolist()
    run_pass = [(rows[s][3], rows[s][4], rows[s][5]) for s in starts.tolist()]
    period = _periods(run_ctx, run_pass, set(simulated))
    # name the periods of each block by their pass and how many of the block's came before in that pass
    # (runs of one period are consecutive)
    period_no: list[tuple | None] = [None] * len(starts)
    counts: dict[tuple, int] = {}
    for r, p in enumerate(period):
        if p is None:
            continue
        if r == 0 or period[r - 1] != p or run_pass[r - 1] != run_pass[r]:
            counts[(p, run_pass[r])] = counts.get((p, run_pass[r]), 0) + 1
        period_no[r] = (run_pass[r], counts[(p, run_pass[r])] - 1)
    if not any(b == M for b, _ in counts):
        raise FoldError(f"the simulation never worked on block {M}")

    # a run's place in its period: its context relative to the period's block, and how many runs of that
    # relative context follow it in the period (periods differ at their start: F's holds what comes
    # before the blocks)
    run_place: list[tuple | None] = [None] * len(starts)
    later: dict[tuple, int] = {}
    for r in range(len(starts) - 1, -1, -1):
        p = period[r]
        if p is None:
            continue
        rel = run_ctx[r] - p if run_ctx[r] >= 0 else "out"
        k = (p, period_no[r], rel)
        run_place[r] = (period_no[r], rel, later.get(k, 0))
        later[k] = later.get(k, 0) + 1
    owner: dict[int, int] = {}
    key_of: dict[int, tuple] = {}
    by_key: dict[tuple, int] = {}
    made_count: dict[tuple, int] = {}
    for x, i in sorted(made_at.items(), key=lambda kv: kv[1]):
        r = int(run_of[i])
        p = period[r]
        o = block_of.get(x, p if p is not None else OUTSIDE)
        owner[x] = o
        if o not in simulated:
            continue
        if x in role_of:  # a parameter, its gradient or state: the same one of another block
            place = ("role", role_of[x])
        elif p is not None:  # made in a period: the same place in another block's
            place = ("made", o - p, run_place[r])
        else:
            place = ("run", r)
        k = made_count.get((o, place), 0)
        made_count[(o, place)] = k + 1
        key_of[x] = (place, k)
        by_key[(o, place, k)] = x

    def counterpart(x: int) -> int:
        """M's storage made where ``x`` (of F or L) was."""
        y = by_key.get((M, *key_of[x])) if x in key_of else None
        if y is None or final.get(y) != final.get(x) or delta[made_at[y]] != delta[made_at[x]]:
            raise FoldError(f"storage {x} of block {owner.get(x)} has no counterpart in block {M}")
        return y

    next_ident = max(max(final, default=0), int(ident.max()) if n else 0) + 1
    fresh: dict[tuple[int, int], int] = {}
    categories = dict(final)

    def copy_of(x: int, q: int) -> int:
        """M's storage ``x`` as copy q (1 .. copies) has it; copy 1 is the simulated M."""
        if q == 1:
            return x
        if (x, q) not in fresh:
            nonlocal next_ident
            fresh[(x, q)] = next_ident
            categories[next_ident] = final.get(x, "other")
            next_ident += 1
        return fresh[(x, q)]

    def in_copy(x: int, q: int) -> int:
        o = owner.get(x)
        if o in OUTER:
            raise FoldError(f"block {M} touches block {o}'s storage {x}: more than a neighbour's")
        if o == M:
            return copy_of(x, q)
        if o == F and q > 1:
            return copy_of(counterpart(x), q - 1)
        if o == L and q < copies:
            return copy_of(counterpart(x), q + 1)
        return x

    renamed: dict[tuple, str] = {}

    def rename(module: str, mapping: tuple) -> str:
        if (module, mapping) not in renamed:
            table = {sim0 + (b - sim0) * group + j: real0 + (r - real0) * group + j for b, r in mapping
                     for j in range(group)}
            renamed[(module, mapping)] = _LAYER.sub(
                lambda m: f"layers.{table.get(int(m.group(1)), int(m.group(1)))}", module)
        return renamed[(module, mapping)]

    a = real
    outer_map = tuple((b, a[i]) for i, b in enumerate(OUTER))
    base_map = outer_map + ((F, a[K - 3]), (M, a[K - 2]), (L, a[-1]))

    def copy_map(q: int) -> tuple:
        return outer_map + ((F, a[K - 4 + q]), (M, a[K - 3 + q]), (L, a[K - 2 + q]))

    out: list[tuple] = []

    def emit(i: int, x: int, mapping: tuple, d: int | None = None) -> None:
        _, dl, cat, ph, st, mb, module, op, _ = rows[i]
        out.append((0.0, dl if d is None else d, cat, ph, st, mb, rename(module, mapping), op, x))

    resized: dict[int, int] = {}
    r, n_runs = 0, len(starts)
    last_neighbour = None
    while r < n_runs:
        p = period[r]
        if p == M:
            end = r
            while end + 1 < n_runs and period[end + 1] == M and period_no[end + 1] == period_no[r]:
                end += 1
            if last_neighbour is None:
                raise FoldError(f"block {M} runs before its neighbours")
            lo, hi = int(starts[r]), int(ends[end])
            for q in (range(1, copies + 1) if last_neighbour == F else range(copies, 0, -1)):
                for i in range(lo, hi):
                    x = int(ident[i])
                    d = -resized[x] if x in resized and delta[i] < 0 else None  # not made here: unchanged
                    emit(i, in_copy(x, q), copy_map(q), d)
            r = end + 1
            continue
        lo, hi = int(starts[r]), int(ends[r])
        if p in OUTER:
            if any(owner.get(int(x)) == M for x in ident[lo:hi]):
                raise FoldError(f"block {p} touches block {M}'s storages: more than a neighbour's")
            for i in range(lo, hi):
                emit(i, int(ident[i]), base_map)
            r += 1
            continue
        if p in (F, L):
            last_neighbour = p
            q = copies if p == L else 1  # the copy next to it: M's name there is that copy's layer
            own_map = base_map if p == F else outer_map + ((F, a[K - 3]), (M, a[-2]), (L, a[-1]))
            for i in range(lo, hi):
                x = int(ident[i])
                if owner.get(x) == M:  # its neighbour's storage
                    emit(i, copy_of(x, q), copy_map(q))
                else:
                    emit(i, x, own_map)
            r += 1
            continue
        i = lo
        while i < hi:  # outside every period
            x = int(ident[i])
            if owner.get(x) != M:
                d = _grown(i, x, delta, joined, owner, M, copies, round_bytes, resized) \
                    if i in joined or x in resized else None
                emit(i, x, base_map, d)
                i += 1
                continue
            j = i  # a stretch touching M's storages: once per copy, in the order of its neighbours
            while j < hi and owner.get(int(ident[j])) == M:
                j += 1
            for q in (range(copies, 0, -1) if _descending(ident, owner, i, j, lo, hi, F, L) else range(1, copies + 1)):
                for k in range(i, j):
                    emit(k, copy_of(int(ident[k]), q), copy_map(q))
            i = j
        r += 1
    out = [(float(pos + 1) * 1e-6, *row[1:]) for pos, row in enumerate(out)]
    info = {"simulated_layers": [sim0 + i for i in range(len(simulated) * group)], "layers": len(real) * group,
            "events_simulated": n, "events": len(out)}
    if group > 1:
        info["group"] = group
    return FoldResult(out, categories, info)


def _descending(ident: np.ndarray, owner: dict, i: int, j: int, lo: int, hi: int, F: int, L: int) -> bool:
    """Whether a stretch of rows i..j touching M's storages goes down the layers: L's storages just before
    it or F's just after (a list freed from its end frees the last layer's first)."""
    for k in range(i - 1, lo - 1, -1):
        o = owner.get(int(ident[k]))
        if o in (F, L):
            return o == L
    for k in range(j, hi):
        o = owner.get(int(ident[k]))
        if o in (F, L):
            return o == F
    return False


def _pass_changes(rows: list[tuple]) -> np.ndarray:
    """Row i (of n - 1) is True where row i + 1 starts another pass (phase, step or micro-batch)."""
    keys = [(r[3], r[4], r[5]) for r in rows]
    return np.fromiter((keys[i] != keys[i + 1] for i in range(len(keys) - 1)), dtype=bool, count=max(0, len(keys) - 1))


def _grown(i: int, x: int, delta: np.ndarray, joined: dict, owner: dict, M: int, copies: int,
           round_bytes: Callable[[int], int], resized: dict[int, int]) -> int:
    """The size of a stack/cat outside the periods (row i, storage x) once M's inputs are there ``copies``
    times; its free frees as much."""
    if x in resized and delta[i] < 0:
        return -resized[x]
    if i not in joined:
        return int(delta[i])
    out_bytes, inputs = joined[i]
    extra = sum(b for y, b in inputs if owner.get(y) == M) * (copies - 1)
    if not extra:
        return int(delta[i])
    resized[x] = round_bytes(out_bytes + extra)
    return resized[x]
