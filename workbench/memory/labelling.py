"""Snapshot and profiler events -> rows of the timeline schema: phase, category, step, module, op.

**Categories from stack frames** (innermost frame first), unless ``identities`` names the address:

- a frame under ``torch/distributed/checkpoint/`` -> ``checkpoint``; a c10d collective
  (``distributed_c10d.py``, functional collectives, FSDP's collectives, ``nccl``) -> ``communication``,
  except FSDP's reduce-scatter buffers (``foreach_reduce``): its output is the sharded gradient
  (``param.grad`` is a view of it), so what outlives backward into the optimizer is ``gradient``;
- building (``parameter``): ``reset_parameters``, ``nn.init``, ``Module._apply/to/cuda/to_empty`` (meta
  init, then ``to_empty``), ``fully_shard`` and FSDP1's init, a layer's constructor in
  ``torch/nn/modules`` (factory kwargs or a device context), and any ``__init__`` under a device context
  (``with torch.device("cuda")`` or ``set_default_device``: torch's ``DeviceContext.__torch_function__``
  is on the stack of every tensor made in it). What the build frees before it ends is ``other``, as the recorder counts it.
  FSDP2's sharded parameters (``FSDPParam._init_sharded_param``, ``reset_sharded_param``, which FSDP's
  lazy init also runs in the first forward) are ``parameter`` in any phase.
- otherwise the *phase* decides, with one lifetime rule: an allocation is a temporary unless it
  outlives the phase that made it into the phase that consumes it (see :mod:`workbench.memory.snapshot`).

**Downsampling.** A rank with more than ``max_events`` rows keeps its large events exactly and merges
runs of small ones, per category, into one row per bin and category (``op="(merged)"``, ``id`` = -1 -
category index, so :meth:`MemoryTimeline.alive_at` shows them as one lump per category). Every bin is
split at its highest total and its negative rows come first, so totals stay exact at every row,
the peak and its breakdown by category are the real ones, and no merged row rises above a real total.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from workbench.memory.timeline import CATEGORIES, PHASES, MemoryTimeline, empty_frame
from workbench.memory.traces import _Stacks

__all__ = ["classify_frames", "frame_facts", "fold_facts", "label_of", "NO_FACTS", "REDUCTION"]

_CAT = {c: i for i, c in enumerate(CATEGORIES)}
_PH = {p: i for i, p in enumerate(PHASES)}


_WRAPPERS = frozenset({"_call_impl", "_wrapped_call_impl", "wrapper", "inner", "decorate_context", "_fn",
                       "<module>", "__call__", "_use_grad", "maybe_fallback", "__torch_function__",
                       "__torch_dispatch__", "_no_grad_wrapper", "<lambda>", "_run_code", "_run_module_as_main"})
_BUILD_NAMES = frozenset({"reset_parameters", "init_weights", "_init_weights", "fully_shard", "to_empty",
                          "parallelize_module", "distribute_module"})
# FSDP2's sharded parameter storage (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), in any phase:
# reset_sharded_param re-pads a shard after _apply/to_empty, and again in the lazy init of the first forward
_SHARD_INIT = frozenset({"_init_sharded_param", "reset_sharded_param"})
_MODULE_BUILD = frozenset({"_apply", "to", "cuda", "to_empty", "load_state_dict", "_load_from_state_dict",
                           "register_parameter"})
_ATEN = re.compile(r"at::_ops::(\w+)::")


# What one frame shows, as bits: a stack shows what any of its frames shows
_CKPT, _COMM, _OPT, _BWD, _FWD, _BUILD, _GRAD, _RECOMPUTE, _USER, _DEVCTX, _CTOR, _PARAM, _REDUCE = (
    1 << i for i in range(13))
REDUCTION = "reduction"  # a hint, not a category: gradient if it outlives backward, else communication


def frame_facts(filename: str, line: int, name: str) -> tuple[int, str, str, str]:
    """What one frame tells: its bits, and the module (``file.py:line`` of a ``forward``), the op and the
    Python function it names ("" where it names none). A stack's label is these folded innermost first,
    the innermost non-empty name winning (:func:`fold_facts`), so a reader of nested events (the profiler's)
    labels each level from the one around it in constant time instead of walking the whole chain."""
    f = filename.replace("\\", "/")
    bits = 0
    if "torch/distributed/checkpoint/" in f or "workbench/checkpoint/" in f:
        bits |= _CKPT
    if ("distributed_c10d.py" in f or "_functional_collectives" in f or "_fsdp_collectives" in f
            or "c10d::" in name or "nccl" in name.lower() or "gloo:" in name or "ProcessGroup" in name):
        bits |= _COMM
    if "torch/optim/" in f or name.startswith("Optimizer."):
        bits |= _OPT
    if (("torch/autograd/" in f and name in ("backward", "_engine_run_backward", "grad", "run_backward"))
            or (f.endswith("torch/_tensor.py") and name == "backward")
            or "autograd::engine" in name.lower() or "Engine::evaluate_function" in name
            or "Engine::thread_main" in name):
        bits |= _BWD
    if "AccumulateGrad" in name:
        bits |= _BWD | _GRAD
    if "torch/utils/checkpoint.py" in f and ("unpack" in name or "recompute" in name):
        bits |= _BWD | _RECOMPUTE
    if not ("/torch/" in f or "site-packages/" in f or f.startswith("<") or f in ("??", "")):
        bits |= _USER
    is_module_py = f.endswith("torch/nn/modules/module.py")
    if ((is_module_py and name in _MODULE_BUILD) or name in _BUILD_NAMES or f.endswith("torch/nn/init.py")
            or (name == "__init__" and "torch/nn/modules/" in f)  # a layer's constructor: its weights
            or f.endswith("torch/distributed/fsdp/_init_utils.py")):  # FSDP1's flat parameters and shards
        bits |= _BUILD
    if name == "__torch_function__" and f.endswith("torch/utils/_device.py"):
        bits |= _DEVCTX  # torch.device(...) as a context manager, or set_default_device
    if name == "__init__":
        bits |= _CTOR
    if name in _SHARD_INIT and f.endswith("_fsdp_param.py"):
        bits |= _PARAM | _BUILD
    if name == "foreach_reduce" and f.endswith("_fsdp_collectives.py"):
        bits |= _REDUCE
    module = ""
    if name == "forward" or (is_module_py and name in ("_call_impl", "_wrapped_call_impl")):
        bits |= _FWD
        if name == "forward" and not is_module_py:
            module = f"{f.rsplit('/', 1)[-1]}:{line}"
    m = _ATEN.search(name)
    op = f"aten::{m.group(1)}" if m else name if name.startswith("aten::") else ""  # a profiler's op event
    if name.startswith("nn.Module: "):  # a profiler's module event
        bits |= _FWD
    py_op = name if filename not in ("??", "") and name not in _WRAPPERS and "::" not in name else ""
    return bits, module, op, py_op


def fold_facts(outer: tuple[int, str, str, str], inner: tuple[int, str, str, str]) -> tuple[int, str, str, str]:
    """The facts of a stack from those of its outer part and of the frame inside it."""
    return (outer[0] | inner[0], inner[1] or outer[1], inner[2] or outer[2], inner[3] or outer[3])


NO_FACTS = (0, "", "", "")


def label_of(facts: tuple[int, str, str, str]) -> tuple[str | None, str | None, str, str]:
    """``(phase, category hint, module, op)`` of a stack's folded facts (see :func:`classify_frames`)."""
    bits, module, op, py_op = facts
    # a constructor under a device context builds: a module's weights made on the device directly
    building = bits & _BUILD or (bits & _DEVCTX and bits & _CTOR)
    phase = ("checkpoint" if bits & _CKPT else "optimizer" if bits & _OPT else "backward" if bits & _BWD
             else "forward" if bits & _FWD else "build" if building else "other" if bits & _USER
             else None)  # library frames only: a hook, carry on
    hint = ("checkpoint" if bits & _CKPT else REDUCTION if bits & _REDUCE else "communication" if bits & _COMM
            else "gradient" if bits & _GRAD else "activation" if bits & _RECOMPUTE
            else "parameter" if bits & _PARAM or (building and phase == "build") else None)
    return phase, hint, module, op or py_op


def classify_frames(frames: Sequence[tuple[str, int, str]]) -> tuple[str | None, str | None, str, str]:
    """``(phase, category hint, module, op)`` of one stack, innermost frame first (see the module docstring).

    ``phase`` is None for an empty stack, or one of library frames only that show no phase (a hook that
    autograd's thread runs): the caller carries the previous phase forward. The hint is a
    category that holds whatever the lifetime rule would say (communication, checkpoint, parameter,
    gradient for ``AccumulateGrad``), :data:`REDUCTION` (FSDP's reduce-scatter buffers: gradient if they
    outlive backward into the optimizer, else communication), or None."""
    if not frames:
        return None, None, "", ""
    facts = NO_FACTS
    for frame in reversed(frames):  # outermost first: each inner frame's names win
        facts = fold_facts(facts, frame_facts(*frame))
    return label_of(facts)


_HINT_CODES = {REDUCTION: -2}  # codes below -1 in _Contexts.hint: hints that are not one category


class _Contexts:
    """Per context (a snapshot stack, or a profiler's enclosing events): phase code (-1: take the previous
    one), category hint code (-1: lifetime rule), module code and op code into vocabularies."""

    def __init__(self, labels: Sequence[tuple[str | None, str | None, str, str]]):
        self.phase = np.array([_PH[p] if p else -1 for p, _, _, _ in labels], dtype=np.int8)
        self.hint = np.array([_HINT_CODES[h] if h in _HINT_CODES else _CAT[h] if h else -1
                              for _, h, _, _ in labels], dtype=np.int8)
        self.module_vocab: list[str] = [""]
        self.op_vocab: list[str] = ["", "(free)", "(merged)"]
        mv = {"": 0}
        ov = {s: i for i, s in enumerate(self.op_vocab)}
        self.module = np.array([mv.setdefault(m, len(mv)) for _, _, m, _ in labels], dtype=np.int32)
        self.op = np.array([ov.setdefault(o, len(ov)) for _, _, _, o in labels], dtype=np.int32)
        self.module_vocab = list(mv)
        self.op_vocab = list(ov)

    @classmethod
    def of_stacks(cls, stacks: _Stacks) -> "_Contexts":
        return cls([classify_frames(stacks.frames_of(s)) for s in range(len(stacks.stacks))])


# ==================================================================================================
# Events -> rows of the schema
# ==================================================================================================

def _index_dtype(n: int) -> type:
    return np.int32 if n < 2**31 - 2 else np.int64


def _next_true(mask: np.ndarray) -> np.ndarray:
    """For every i, the smallest j > i with mask[j] (len(mask) if none)."""
    n = len(mask)
    it = _index_dtype(n)
    at = np.where(mask, np.arange(n, dtype=it), it(n))
    at = np.minimum.accumulate(at[::-1])[::-1]  # smallest j >= i
    out = np.empty(n, dtype=it)
    out[:-1] = at[1:]
    if n:
        out[-1] = n
    return out


def _ffill(codes: np.ndarray, default: int) -> np.ndarray:
    """Replace -1 by the last code before it (``default`` where there is none)."""
    valid = codes >= 0
    if valid.all() or not len(codes):
        return codes.astype(np.int8)
    idx = np.where(valid, np.arange(len(codes), dtype=_index_dtype(len(codes))), -1)
    np.maximum.accumulate(idx, out=idx)
    out = np.where(idx >= 0, codes[np.maximum(idx, 0)], default)
    return out.astype(np.int8)


_ROW_FIELDS = ("t", "delta", "cat", "phase", "step", "module", "op", "id")


class _Rows:
    """The rows of one rank before totals: parallel arrays, in event order."""
    __slots__ = _ROW_FIELDS

    def __init__(self, **cols: np.ndarray):
        for k in _ROW_FIELDS:
            setattr(self, k, cols[k])

    def __len__(self) -> int:
        return len(self.delta)

    def take(self, idx: np.ndarray) -> "_Rows":
        return _Rows(**{k: getattr(self, k)[idx] for k in _ROW_FIELDS})


def _label_events(t: np.ndarray, is_alloc: np.ndarray, addr: np.ndarray, size: np.ndarray, ctx: np.ndarray,
                  contexts: _Contexts, identities: Mapping[int, str] | None,
                  step: np.ndarray | None = None) -> tuple[_Rows, dict[str, Any]]:
    """Pair frees with allocations, number them, and give every row its phase, category, step, module, op.

    Returns the rows and what the caller needs for ``base_bytes``: ``orphan_bytes`` (frees of
    allocations made before the events start) and ``live_addr`` (addresses allocated and still live at
    the end). Written for 10^7 events: index arrays are int32 and temporaries are dropped early."""
    n = len(addr)
    it = _index_dtype(n)
    is_alloc = np.asarray(is_alloc, dtype=bool)
    # pairing: in (address, time) order a free follows the allocation it frees
    order = np.argsort(addr, kind="stable").astype(it)
    pair = np.zeros(n, dtype=bool)
    if n > 1:
        a_sorted = addr[order]
        np.equal(a_sorted[1:], a_sorted[:-1], out=pair[1:])
        del a_sorted
        al_sorted = is_alloc[order]
        pair[1:] &= al_sorted[:-1] & ~al_sorted[1:]
        del al_sorted
    at = np.flatnonzero(pair)
    del pair
    partner = np.full(n, -1, dtype=it)
    partner[order[at]] = order[at - 1]
    partner[order[at - 1]] = order[at]
    del order, at
    paired = ~is_alloc & (partner >= 0)
    orphan = ~is_alloc & (partner < 0)
    safe_partner = np.where(partner >= 0, partner, 0).astype(it)

    ids = np.zeros(n, dtype=np.int64)
    n_alloc = int(is_alloc.sum())
    ids[is_alloc] = np.arange(1, n_alloc + 1)
    ids[paired] = ids[partner[paired]]
    ids[orphan] = n_alloc + 1 + np.arange(int(orphan.sum()))
    delta = size.astype(np.int64, copy=True)
    delta[paired] = size[partner[paired]]
    np.negative(delta, out=delta, where=~is_alloc)

    # phase: the context's own, carried forward over empty stacks and over frees that repeat their
    # allocation's stack (torch's context="alloc" records the allocating stack on the free)
    own = contexts.phase[ctx] if n else np.zeros(0, dtype=np.int8)
    own[paired & (ctx == ctx[safe_partner])] = -1
    phase = _ffill(own, _PH["other"])
    del own

    if step is None:
        opt = phase == _PH["optimizer"]
        step = np.zeros(n, dtype=np.int32)
        if opt.any():
            step[1:] = opt[:-1] & ~opt[1:]
            np.cumsum(step, out=step)
        else:
            step[:] = -1
        del opt

    # category: hint, else the lifetime rule of the allocating phase
    free_at = np.where(partner >= 0, partner, it(n + 1)).astype(it)
    cat = np.full(n, _CAT["other"], dtype=np.int8)
    rules = ((_PH["forward"], phase == _PH["backward"], _CAT["activation"]),
             (_PH["backward"], phase == _PH["optimizer"], _CAT["gradient"]),
             (_PH["optimizer"], phase != _PH["optimizer"], _CAT["optimizer"]))
    for ph, consumer, survivor in rules:
        m = is_alloc & (phase == ph)
        if m.any():
            nxt = _next_true(consumer)
            cat[m] = np.where(free_at[m] > nxt[m], survivor, _CAT["temporary"])
            del nxt
        del m
    cat[is_alloc & (phase == _PH["checkpoint"])] = _CAT["checkpoint"]
    cat[is_alloc & (phase == _PH["build"])] = _CAT["parameter"]
    if n:
        hint = contexts.hint[ctx]
        hinted = is_alloc & (hint >= 0)
        cat[hinted] = hint[hinted]
        # FSDP's reduce-scatter buffers: the output holds the sharded gradients (param.grad views it)
        # until the optimizer has used them; the input and a copy that dies in backward are the collective's
        reduction = is_alloc & (hint == _HINT_CODES[REDUCTION])
        if reduction.any():
            nxt = _next_true(phase == _PH["optimizer"])
            cat[reduction] = np.where(free_at[reduction] > nxt[reduction], _CAT["gradient"], _CAT["communication"])
            del nxt
        # what the build frees before it ends (a constructor's scratch, the unsharded weights fully_shard
        # replaces) is not a parameter: "other", as the recorder counts the build's other storages. The
        # build ends at the next allocation of another phase: a free's stack is wherever the last
        # reference went (a constructor's own line, without the device context's frame), so frees do not
        # end it
        built = is_alloc & (phase == _PH["build"]) & (cat == _CAT["parameter"])
        if built.any():
            nxt = _next_true(is_alloc & (phase != _PH["build"]))
            cat[built & (free_at <= nxt)] = _CAT["other"]
            del nxt
        del hint, hinted, reduction, built
    del free_at
    live = is_alloc & (partner < 0)
    if identities:
        known = {int(k): _CAT[_check_category(v)] for k, v in identities.items()}
        live_pos = np.flatnonzero(live)
        for i in live_pos[np.isin(addr[live_pos], np.fromiter(known, dtype=np.int64, count=len(known)))]:
            cat[i] = known[int(addr[i])]
    cat[paired] = cat[partner[paired]]
    cat[orphan] = _CAT["other"]

    module = contexts.module[ctx] if n else np.zeros(0, dtype=np.int32)
    module[paired] = module[partner[paired]]
    op = np.ones(n, dtype=np.int32)  # "(free)"
    if n:
        op[is_alloc] = contexts.op[ctx[is_alloc]]
    facts = {"orphan_bytes": int(size[orphan].sum()) if n else 0, "live_addr": addr[live]}
    rows = _Rows(t=np.asarray(t, dtype=np.float64), delta=delta, cat=cat, phase=phase, step=step.astype(np.int32),
                 module=module.astype(np.int32), op=op, id=ids)
    return rows, facts


def _check_category(c: str) -> str:
    if c not in _CAT:
        raise ValueError(f"unknown memory category {c!r} in identities; use one of {list(CATEGORIES)}")
    return c


def _merged_groups(rows: _Rows, total: np.ndarray, large: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """For the small events (``~large``): their positions and the (bin half, category) key of each.

    Runs of small events between large ones are cut into bins of ``b`` events; each bin is split after
    its highest total (the first event reaching it), so the peak ends a group."""
    n = len(rows)
    it = _index_dtype(n)
    small_pos = np.flatnonzero(~large).astype(it)
    if not len(small_pos):
        return small_pos, np.zeros(0, dtype=np.int64)
    last_large = np.maximum.accumulate(np.where(large, np.arange(n, dtype=it), it(-1)))[small_pos]
    bin_of = (small_pos - last_large - 1) // b  # position in the run, in bins
    new_bin = np.ones(len(small_pos), dtype=bool)
    new_bin[1:] = (last_large[1:] != last_large[:-1]) | (bin_of[1:] != bin_of[:-1])
    del last_large, bin_of
    starts = np.flatnonzero(new_bin)
    chunk = (np.cumsum(new_bin) - 1).astype(it)
    del new_bin
    tot = total[small_pos]
    cmax = np.maximum.reduceat(tot, starts)
    hit = np.flatnonzero(tot == cmax[chunk])
    del tot, cmax
    first_hit = np.full(len(starts), len(small_pos), dtype=it)
    np.minimum.at(first_hit, chunk[hit], hit.astype(it))
    del hit
    after_peak = np.arange(len(small_pos), dtype=it) > first_hit[chunk]
    key = (chunk.astype(np.int64) * 2 + after_peak) * len(CATEGORIES) + rows.cat[small_pos]
    return small_pos, key


def _downsample(rows: _Rows, base: int, max_events: int) -> tuple[_Rows, dict[str, Any]]:
    """At most ``max_events`` rows with the same totals at every kept row, the same peak and breakdown.

    The largest events stay as they are. Runs of smaller events between them are cut into bins of ``b``
    events; each bin is split at its highest total, and each half becomes one row per category
    (negative rows first, so no merged row rises above a real total). ``b`` doubles until the rows
    fit; when even whole runs do not fit (too many runs), fewer events are kept whole."""
    n = len(rows)
    total = base + np.cumsum(rows.delta)
    absd = np.abs(rows.delta)
    keep = max_events // 4
    while True:
        if keep > 0 and n > keep:
            threshold = int(np.partition(absd, n - keep)[n - keep])
            large = absd > threshold
        else:
            threshold, large = int(absd.max()) if n else 0, np.zeros(n, dtype=bool)
        n_large = int(large.sum())
        n_small = n - n_large
        b = max(1, n_small // max(1, max_events - n_large))
        while True:
            small_pos, key = _merged_groups(rows, total, large, b)
            # the rows a bin makes: one per category present in each half (keys are small and dense)
            present = np.zeros(int(key[-1] // len(CATEGORIES) + 1) * len(CATEGORIES) if len(key) else 0, dtype=bool)
            present[key] = True
            count = int(present.sum())
            if n_large + count <= max_events or b >= n_small:
                break
            b *= 2
        if n_large + count <= max_events:
            break
        del small_pos, key, present
        keep //= 2
    del absd
    uniq = np.flatnonzero(present)
    slot = np.cumsum(present, dtype=_index_dtype(len(present))) - 1
    del present
    inverse = slot[key]
    del slot
    sums = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(sums, inverse, rows.delta[small_pos])
    del inverse
    # the last event of a group places all its rows (keys grow along the events: groups are contiguous)
    group = key // len(CATEGORIES)
    ends = np.flatnonzero(np.r_[group[1:] != group[:-1], True]) if len(group) else np.zeros(0, dtype=np.int64)
    anchor = small_pos[ends][np.searchsorted(group[ends], uniq // len(CATEGORIES))].astype(np.int64)
    del key, group, ends, small_pos
    ucat = (uniq % len(CATEGORIES)).astype(np.int8)
    nonzero = sums != 0
    sums, ucat, anchor = sums[nonzero], ucat[nonzero], anchor[nonzero]
    merged = _Rows(t=rows.t[anchor], delta=sums, cat=ucat, phase=rows.phase[anchor], step=rows.step[anchor],
                   module=np.zeros(len(sums), dtype=np.int32), op=np.full(len(sums), 2, dtype=np.int32),
                   id=-1 - ucat.astype(np.int64))
    large_pos = np.flatnonzero(large)
    kept = rows.take(large_pos)
    # order: by anchor event; a group's negative rows before its positive ones, then by category
    order_key = np.concatenate([large_pos.astype(np.int64) * 4 + 3, anchor * 4 + (sums > 0)])
    sub = np.concatenate([np.zeros(len(large_pos), dtype=np.int8), ucat])
    order = np.lexsort((sub, order_key))
    both = _Rows(**{k: np.concatenate([getattr(kept, k), getattr(merged, k)])[order] for k in _ROW_FIELDS})
    return both, {"events": n, "rows": len(both), "kept_above_bytes": threshold, "bin_events": b}


def _frame(rank: int, rows: _Rows, base: int, contexts: _Contexts) -> pd.DataFrame:
    n = len(rows)
    return pd.DataFrame({
        "rank": np.full(n, rank, dtype=np.int32), "t": rows.t, "delta_bytes": rows.delta,
        "total_bytes": base + np.cumsum(rows.delta),
        "category": pd.Categorical.from_codes(rows.cat, categories=list(CATEGORIES)),
        "phase": pd.Categorical.from_codes(rows.phase, categories=list(PHASES)),
        "step": rows.step, "microbatch": np.full(n, -1, dtype=np.int32),
        "module": pd.Categorical.from_codes(rows.module, categories=contexts.module_vocab),
        "op": pd.Categorical.from_codes(rows.op, categories=contexts.op_vocab),
        "id": rows.id})


class _RankResult:
    """One rank's part of a timeline: frame, base and meta, with ``t`` in absolute seconds until placed."""

    def __init__(self, rank: int, frame: pd.DataFrame, base: int, base_by_category: dict[str, int],
                 meta: dict[str, Any], origin: float | None):
        self.rank, self.frame, self.base = rank, frame, base
        self.base_by_category, self.meta, self.origin = base_by_category, meta, origin


def _finish(rank: int, rows: _Rows, base: int, base_by_category: dict[str, int], contexts: _Contexts,
            max_events: int, meta: dict[str, Any], origin: float | None) -> _RankResult:
    if max_events < 16:
        raise ValueError(f"max_events={max_events} is too small to keep a timeline's shape; use 16 or more")
    if len(rows) > max_events:
        rows, info = _downsample(rows, base, max_events)
        meta.setdefault("downsampled", {})[str(rank)] = info
    return _RankResult(rank, _frame(rank, rows, base, contexts), base,
                       {k: v for k, v in base_by_category.items() if v}, meta, origin)


def _join(parts: Sequence[_RankResult], source: str, device: str, extra_meta: dict[str, Any]) -> MemoryTimeline:
    """Ranks on one clock: ``t`` from the earliest first event of any rank."""
    origins = [p.origin for p in parts if p.origin is not None]
    origin = min(origins) if origins else 0.0
    meta: dict[str, Any] = dict(extra_meta)
    frames = []
    for p in parts:
        f = p.frame
        if p.origin is not None and len(f):
            f = f.assign(t=f["t"].to_numpy() - origin)
        frames.append(f)
        for key, value in p.meta.items():
            if isinstance(value, dict):
                meta.setdefault(key, {}).update(value)
            else:
                meta[key] = value
        meta.setdefault("base_by_category", {})[str(p.rank)] = p.base_by_category
    frame = pd.concat(frames, ignore_index=True) if frames else empty_frame()
    return MemoryTimeline(frame, source=source, device=device, base_bytes={p.rank: p.base for p in parts},
                          meta=meta)
