"""The layout advisor: the fastest layouts of a model that fit a GPU, from the memory and step-time predictors.

    advice = advise("llama-70b", gpus=1024, gpu_memory="80GiB", gpu="H100-SXM", global_batch=1024)
    advice            # the ranked layouts in a notebook; advice.to_frame(), advice.to_json(), advice.pareto()

How it searches (the rules, also in ``Advice.meta["rules"]`` and ``workbench advise --json``)::

    1. enumerate      tp x pp x dp_replicate x dp_shard (x ep for a mixture of experts) = gpus; under each
                      sp on/off, the pipeline schedule, the activation checkpointing mode and the micro
                      batch (every divisor of the per-rank batch; under pp the micro-batch count follows)
    2. prune by rule  TP within a node (tp divides the GPUs of a node); divisibility (heads, kv heads, ffn and
                      vocabulary by tp; experts by ep, dp_shard by ep; global batch by dp, then by the micro
                      batch); pipeline: at most n_layers stages (2 pp under Interleaved1F1B; uneven stages are
                      allowed, as the trainer splits them), 1F1B and interleaved need at least pp
                      micro-batches; ZeRO 0/1 with neither tp, dp_replicate nor ep; then ParallelConfig
                      and validate()'s own errors, word for word, for each layout checked
    3. screen         a closed-form estimate of every candidate's peak memory and step time
                      (workbench.prediction.layout_search): a candidate estimated more than 25% over the room
                      (gpu_memory - the CUDA context and NCCL margin) is pruned without a prediction
    4. check          in the screen's order, the exact predictors, until `top` layouts fit (at most `exact`
                      checks, default 2 x top): the memory predictor (predict(device="cuda"), the caching
                      allocator's reserved peak + margin against gpu_memory; under pp the first and last
                      stages, which hold the most), and for the layouts that fit, predict_time (the step
                      timeline on the device profile of `gpu`); one prediction per distinct per-rank shape.
                      Each check also calibrates the screen: a candidate whose screened peak times the smallest
                      ratio (predicted / screened peak, same AC mode) seen so far is over the room is pruned
                      without a prediction. Checks run in forked workers, one per usable CPU, where forking
                      is safe (workbench.prediction.workers.can_fork). ``time_limit`` stops starting checks
                      after that many seconds
    5. rank           the checked layouts that fit by predicted tokens/s; each says what bounds it: memory
                      (the same degrees with a bigger micro batch or less recomputation would be faster but
                      do not fit), else its slowest rank's compute, exposed communication or pipeline bubble
Layouts not checked keep the screen's figures (``estimate="screen"``) and are not ranked, unless ``exact=0``
asks for the screen alone: then its figures rank them.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import tempfile
import time
from typing import Any, Callable

import pandas as pd

from workbench.config import PRESETS, ModelConfig, TrainConfig, resolve_model
from workbench.display import RendersInNotebook
from workbench.prediction.layout_search import (SCREEN_SLACK, Candidate, enumerate_layouts, estimate,
                                                setting_for)
from workbench.units import format_bytes, parse_bytes

__all__ = ["advise", "Advice", "RULES"]

RULES = [
    "TP within a node: tp divides the GPUs of a node",
    "divisibility: tp divides n_heads, n_kv_heads, ffn_hidden and vocab_size; ep divides n_experts and dp_shard; "
    "dp divides the global batch and the micro batch the per-rank batch",
    "pipeline: at most n_layers stages (pp, or 2 pp under Interleaved1F1B; uneven stages allowed); 1F1B and "
    "Interleaved1F1B need at least pp micro-batches; no pp with experts or tied embeddings",
    "config: ParallelConfig / validate() refuse the layout (their message)",
    f"memory (screen): the closed-form estimate is more than {SCREEN_SLACK:.0%} over gpu_memory - margin",
    "memory (screen x ratio): the screen's peak times the smallest ratio of predicted to screened peak seen in "
    "this search's checks (same AC mode) exceeds gpu_memory - margin",
    "memory: the memory predictor's peak (CUDA: the caching allocator's reserved peak) + margin (CUDA context "
    "512 MiB + 256 MiB per NCCL communicator) exceeds gpu_memory",
    "ranked by predict_time's tokens/s among the checked layouts that fit",
]
COLUMNS = ["rank", "layout", "fits", "peak_bytes", "needed_bytes", "tokens_per_s", "tokens_per_s_per_gpu",
           "step_time_s", "bound", "estimate", "reason", "dp_replicate", "dp_shard", "tp", "sp", "pp", "schedule",
           "microbatches", "ep", "ac", "micro"]


# --------------------------------------------------------------------------------------------------
# The result
# --------------------------------------------------------------------------------------------------


class Advice(RendersInNotebook):
    """The advisor's answer: every layout considered (``to_frame()``), the ranked ones first, and the rules.

    Columns: ``rank`` (1 = fastest that fits; empty when not ranked), ``layout``, ``fits`` (True/False, None
    for layouts not checked or pruned by a rule), ``peak_bytes`` (predicted peak per rank: reserved on
    CUDA), ``needed_bytes`` (with the margin), ``tokens_per_s`` (global), ``tokens_per_s_per_gpu``,
    ``step_time_s``, ``bound`` (memory, compute, communication, bubble, host), ``estimate`` ("predicted":
    the predictors'; "screen": the closed form only), ``reason`` (why a layout is not ranked), then the
    layout's settings."""

    def __init__(self, rows: pd.DataFrame, meta: dict[str, Any], model: str | ModelConfig | None = None):
        self.rows = rows
        self.meta = meta
        # what a plan, memory or time prediction of a row takes as its model: the preset's name, else the config
        self.model = model if model is not None else meta.get("model")

    def to_frame(self) -> pd.DataFrame:
        return self.rows.copy()

    @property
    def ranked(self) -> pd.DataFrame:
        """The layouts that fit, fastest first."""
        r = self.rows[self.rows["rank"].notna()]
        return r.sort_values("rank").reset_index(drop=True)

    @property
    def best(self) -> dict[str, Any] | None:
        r = self.ranked
        return None if r.empty else _row_dict(r.iloc[0])

    def pareto(self) -> pd.DataFrame:
        """The checked layouts that fit and that no other beats on both tokens/s and peak memory."""
        r = self.ranked.sort_values(["peak_bytes", "tokens_per_s"], ascending=[True, False])
        keep, best = [], -1.0
        for i, row in r.iterrows():
            if row["tokens_per_s"] > best:
                keep.append(i)
                best = row["tokens_per_s"]
        return r.loc[keep].reset_index(drop=True)

    def summary_line(self) -> str:
        m = self.meta
        head = (f"{m['model']} on {m['gpus']} x {m['gpu']} ({format_bytes(m['gpu_memory_bytes'])}), global batch "
                f"{m['global_batch']} x {m['seq_len']} tokens")
        if self.ranked.empty:
            return f"{head}: nothing fits. {m['nothing_fits']}"
        b = self.best
        return (f"{head}: best {b['layout']} at {b['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak "
                f"{format_bytes(b['peak_bytes'])}, {b['bound']}-bound")

    def to_dict(self, rows: str = "top") -> dict[str, Any]:
        """The JSON document: the settings, rules, ranked layouts, the Pareto front, and the pruned layouts
        counted by rule (with a few examples); ``rows="all"`` lists every row."""
        frame = self.rows if rows == "all" else self.ranked
        pruned = self.rows[self.rows["rank"].isna()]
        by_rule = pruned["reason"].fillna("").map(lambda r: r.split(":", 1)[0]).value_counts()
        examples = pruned.drop_duplicates("reason").head(20)
        return {"status": "ok", **{k: v for k, v in self.meta.items() if k != "nothing_fits"},
                "nothing_fits": None if not self.ranked.empty else self.meta["nothing_fits"],
                "summary": self.summary_line(),
                "rows": [_row_dict(r) for _, r in frame.iterrows()],
                "pareto": [_row_dict(r) for _, r in self.pareto().iterrows()],
                "pruned": {str(k): int(v) for k, v in by_rule.items()},
                "pruned_examples": [{"layout": r["layout"], "reason": r["reason"]} for _, r in examples.iterrows()]}

    def to_json(self, rows: str = "top") -> str:
        return json.dumps(self.to_dict(rows), indent=1, default=_json_default)

    def __repr__(self) -> str:
        lines = [self.summary_line()]
        for _, r in self.ranked.iterrows():
            lines.append(f"  {int(r['rank']):>2}. {r['layout']:<70} {r['tokens_per_s_per_gpu']:>10,.0f} tok/s/GPU "
                         f"{format_bytes(r['peak_bytes']):>11}  {r['bound']}")
        lines.append(f"  ({self.meta['counts']['candidates']:,} layouts considered, "
                     f"{self.meta['counts']['checked']} checked with the predictors, "
                     f"{self.meta['seconds']['total']:.1f} s)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = f"<p><b>{html.escape(self.summary_line())}</b></p>"
        cols = ["rank", "layout", "tokens_per_s_per_gpu", "step_time_s", "peak_bytes", "bound"]
        r = self.ranked[cols].copy()
        r["peak_bytes"] = r["peak_bytes"].map(format_bytes)
        return head + r.to_html(index=False, float_format=lambda v: f"{v:,.3f}")


_INTS = ["rank", "dp_replicate", "dp_shard", "tp", "pp", "microbatches", "ep", "micro"]


def _row_dict(r: pd.Series) -> dict[str, Any]:
    out = {}
    for k, v in r.items():
        if v is pd.NA or v is None or isinstance(v, float) and v != v:
            v = None
        elif hasattr(v, "item"):
            v = v.item()
        out[k] = v
    return out


def _json_default(o: Any) -> Any:
    return o.item() if hasattr(o, "item") else str(o)


# --------------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------------


def advise(model: str | ModelConfig | dict, *, gpus: int, gpu_memory: int | float | str, gpu: str = "H100-SXM",
           nodes: int | None = None, gpus_per_node: int = 8, global_batch: int | None = None,
           seq_len: int | None = None, top: int = 10, progress: bool = False, exact: int | None = None,
           train: TrainConfig | dict | None = None, zero: int = 3, workers: int | None = None,
           margin: int | str | None = None, include: list[dict[str, Any]] | None = None,
           time_limit: float | None = None) -> Advice:
    """The fastest layouts of ``model`` on ``gpus`` GPUs of ``gpu_memory`` each (the module docstring's rules).

    ``gpu``: a device profile (``H100-SXM``, ``H200``, ``A100-SXM-80GB``, or ``cpu``: CPU ranks, whose memory
    is predicted for the CPU). ``nodes`` x ``gpus_per_node`` must hold ``gpus`` (TP stays within a node).
    ``global_batch`` (sequences; default: one per GPU) and ``seq_len`` (default: the model's max_seq_len)
    are the same for every layout. ``top``: layouts to rank; ``exact``: at most this many layouts checked
    with the predictors (default 2 x top; 0: the closed-form screen alone). ``train``: other training
    settings every layout shares (default: bf16 mixed precision on a GPU). ``workers``: processes for the
    checks (default: the CPUs this process may use). ``margin``: memory outside the allocator per GPU
    (default: the memory predictor's CUDA context + NCCL margin; 0 on CPU). ``include``: layouts to check
    with the predictors whatever the screen says (e.g. the one you run now), each a dict of
    ``dp_replicate, dp_shard, tp, pp, ep, sp, schedule, ac, micro`` (missing: 1, False, 1F1B, none, the whole
    per-rank batch); they are ranked with the others. ``time_limit``: seconds after which no further check
    starts (one running finishes); the layouts left keep the screen's figures, unranked."""
    t0 = time.perf_counter()
    mcfg = resolve_model(model)
    gpus, gpus_per_node, nodes = _check_counts(gpus, nodes, gpus_per_node)
    budget = parse_bytes(gpu_memory)
    if budget <= 0:
        raise ValueError(f"gpu_memory={gpu_memory!r}: give the memory of one GPU, e.g. 80GiB")
    for name, v in (("top", top), ("exact", exact), ("zero", zero)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{name}={v!r}: give a whole number >= 0")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or not time_limit > 0):
        raise ValueError(f"time_limit={time_limit!r}: give seconds > 0, or None for no limit")
    from workbench.time.devices import device_profile

    prof = device_profile(gpu)
    device = "cpu" if prof.kind == "cpu" else "cuda"
    tcfg = _train(train, mcfg, gpus, global_batch, seq_len, device)
    exact = 2 * top if exact is None else exact
    st = setting_for(mcfg, tcfg, prof, gpus_per_node, zero)
    cands, pruned = enumerate_layouts(mcfg, gpus, gpus_per_node, tcfg.global_batch, tcfg.seq_len, zero=zero)
    t_enum = time.perf_counter()
    est = [estimate(c, st) for c in cands]
    margins = [_margin(c, device, margin, gpus) for c in cands]
    room = [budget - mg for mg in margins]
    t_screen = time.perf_counter()
    rows: dict[Candidate, dict[str, Any]] = {}
    order = sorted(range(len(cands)), key=lambda i: (est[i].step_s, est[i].peak_bytes))
    screened = []
    for i in order:
        c, e = cands[i], est[i]
        row = _row(c, e, margins[i], tcfg, gpus)
        if e.peak_bytes > room[i] * (1 + SCREEN_SLACK):
            row["reason"] = (f"memory (screen): estimated {format_bytes(e.peak_bytes + margins[i])} > "
                             f"{format_bytes(budget)}")
            row["fits"] = False
        else:
            screened.append(c)
        rows[c] = row
    wanted = [_included(d, cands, pruned, gpus, tcfg.global_batch) for d in include or []]
    for c in wanted:
        if c in rows and rows[c]["fits"] is False:  # screened out: checked anyway, as asked
            rows[c].update(fits=None, reason=None)
    log: dict[str, Any] = {"memory_s": [], "time_s": [], "time_limit_reached": False}
    checked = _check(mcfg, tcfg, wanted + [c for c in screened if c not in wanted], rows, device, prof, budget,
                     exact + len(wanted) if exact else 0, top + len(wanted), progress, workers, zero, gpus_per_node, nodes,
                     None if time_limit is None else t0 + time_limit, log, wanted)
    basis = "predicted"
    if exact == 0:  # the screen alone: its figures decide, its peak against the whole room
        basis = "screen"
        for c in screened:
            r = rows[c]
            r["fits"] = bool(r["needed_bytes"] <= budget)
            if not r["fits"]:
                r["reason"] = (f"memory (screen): estimated {format_bytes(r['needed_bytes'])} > "
                               f"{format_bytes(budget)}")
    _bounds(rows, cands, est, room)
    ranked = sorted((r for r in rows.values() if r["fits"] and r["estimate"] == basis),
                    key=lambda r: -r["tokens_per_s"])[:top]
    for k, r in enumerate(ranked, 1):
        r["rank"] = k
    for r in rows.values():
        if r["rank"] is None and r["reason"] is None:
            r["reason"] = ("ranked below the top" if r["fits"] and r["estimate"] == basis
                           else "not checked: the time limit was reached" if log["time_limit_reached"]
                           and r["fits"] is None else f"not checked: below the top {top} of the screen")
    frame = pd.DataFrame(list(rows.values()) + [_pruned_row(p) for p in pruned], columns=COLUMNS)
    frame = frame.astype({k: "Int64" for k in _INTS}).astype({"fits": "boolean", "sp": "boolean"})
    frame = frame.sort_values(["rank", "step_time_s"], na_position="last", kind="stable").reset_index(drop=True)
    t_end = time.perf_counter()
    meta = {"model": mcfg.name, "gpus": gpus, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": prof.name,
            "device": device, "device_model": prof.describe(), "gpu_memory_bytes": budget,
            "global_batch": tcfg.global_batch, "seq_len": tcfg.seq_len, "top": top, "exact": exact,
            "train": {k: getattr(tcfg, k) for k in ("dtype", "mixed_precision", "ac_every")}, "zero": zero,
            "rules": RULES, "nothing_fits": _nothing(rows, budget, pruned, log, checked, exact),
            "counts": {"candidates": len(cands), "pruned_by_rule": len(pruned),
                       "screened_out": len(cands) - len(screened), "checked": checked,
                       "ranked": len(ranked)},
            "seconds": {"enumerate": round(t_enum - t0, 3), "screen": round(t_screen - t_enum, 3),
                        "check": round(t_end - t_screen, 3), "total": round(t_end - t0, 3),
                        "memory_predictions": log["memory_s"], "time_predictions": log["time_s"]},
            "time_limit": time_limit, "time_limit_reached": log["time_limit_reached"]}
    preset = PRESETS.get(mcfg.name) == mcfg
    meta["model_config"] = mcfg.to_dict()
    return Advice(frame, meta, model=mcfg.name if preset else mcfg)


def _included(d: dict[str, Any], cands: list[Candidate], pruned: list[dict[str, Any]], gpus: int,
              global_batch: int) -> Candidate:
    """The candidate a user's layout dict names (``include=``); one ValueError when the search has none."""
    known = {"dp_replicate", "dp_shard", "tp", "pp", "ep", "sp", "schedule", "ac", "micro"}
    if not isinstance(d, dict) or set(d) - known:
        raise ValueError(f"include: each layout is a dict of {sorted(known)}; got {d!r}"[:300])
    g = {"dp_replicate": 1, "tp": 1, "pp": 1, "ep": 1, "sp": False, "ac": "none", **d}
    rest = g["dp_replicate"] * g["tp"] * g["pp"]
    g.setdefault("dp_shard", gpus // rest if gpus % rest == 0 else 0)
    g.setdefault("schedule", "1F1B" if g["pp"] > 1 else None)
    dp = g["dp_replicate"] * g["dp_shard"]
    g.setdefault("micro", global_batch // dp if dp and global_batch % dp == 0 else 0)
    for c in cands:
        if all(getattr(c, k) == v for k, v in g.items()):
            return c
    words = {f"{k}={v}" for k, v in g.items()}
    why = [p["reason"] for p in pruned if set(p["layout"].split()) <= words]
    raise ValueError(f"include: {d} is not a layout of {gpus} GPUs the search holds"
                     + (f" ({why[0]})" if why else "; check that its degrees multiply to the GPUs and that micro "
                        "divides the per-rank batch"))


def _check_counts(gpus: Any, nodes: Any, gpus_per_node: Any) -> tuple[int, int, int]:
    for name, v in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r}: give a positive whole number")
    from workbench.config import MAX_RANKS

    if gpus > MAX_RANKS:
        raise ValueError(f"gpus={gpus} is over the limit of {MAX_RANKS:,}; choose fewer GPUs")
    if nodes is not None:
        if nodes * gpus_per_node != gpus:
            raise ValueError(f"nodes={nodes} x gpus_per_node={gpus_per_node} = {nodes * gpus_per_node} GPUs, but "
                             f"gpus={gpus}; make them agree")
        return gpus, gpus_per_node, nodes
    if gpus <= gpus_per_node:
        return gpus, gpus, 1
    if gpus % gpus_per_node:
        raise ValueError(f"gpus={gpus} is not a whole number of {gpus_per_node}-GPU nodes; give a multiple of "
                         f"{gpus_per_node} or set gpus_per_node")
    return gpus, gpus_per_node, gpus // gpus_per_node


def _train(train: Any, model: ModelConfig, gpus: int, global_batch: int | None, seq_len: int | None,
           device: str) -> TrainConfig:
    base: dict[str, Any] = {"mixed_precision": "bf16"} if device == "cuda" else {}
    if isinstance(train, TrainConfig):
        base = train.to_dict()
    elif isinstance(train, dict):
        base.update(train)
    elif train is not None:
        raise ValueError(f"train={type(train).__name__}: give a TrainConfig or a dict of its settings")
    for name in ("micro_batch", "activation_checkpointing"):
        if base.get(name) not in (None, "none"):
            raise ValueError(f"train {name}={base[name]!r}: the advisor searches it; leave it out")
    if global_batch is not None:
        base["global_batch"] = global_batch
    elif train is None or "global_batch" not in base:
        base["global_batch"] = gpus  # one sequence per GPU
    if seq_len is not None:
        base["seq_len"] = seq_len
    elif train is None or "seq_len" not in base:
        base["seq_len"] = model.max_seq_len
    base.pop("micro_batch", None)
    base["activation_checkpointing"] = "none"
    tcfg = TrainConfig.from_dict(base)
    if tcfg.seq_len > model.max_seq_len:
        raise ValueError(f"seq_len={tcfg.seq_len} exceeds max_seq_len={model.max_seq_len} of model {model.name!r}; "
                         f"choose seq_len <= {model.max_seq_len}")
    return tcfg


def _margin(c: Candidate, device: str, margin: Any, gpus: int) -> int:
    """Bytes per GPU outside the allocator: ``margin`` when given, else the memory predictor's default
    (:func:`workbench.prediction.memory.default_margin`: CUDA context + one NCCL communicator per degree > 1)."""
    if isinstance(margin, str) and margin.strip().lower() in ("0", "0b"):
        return 0
    if margin is not None and not (isinstance(margin, str) and margin.strip().lower() == "auto"):
        return parse_bytes(margin)
    if device != "cuda":
        return 0
    from workbench.prediction.memory import CONTEXT_MARGIN, NCCL_MARGIN

    degrees = (c.dp_replicate, c.dp_shard, c.tp, c.pp, c.ep)  # memory.nccl_communicators, for a candidate
    return CONTEXT_MARGIN + NCCL_MARGIN * ((gpus > 1) + sum(d > 1 for d in degrees))


def _row(c: Candidate, e: Any, margin: int, tcfg: TrainConfig, gpus: int) -> dict[str, Any]:
    tokens = tcfg.global_batch * tcfg.seq_len
    return {"rank": None, "layout": c.layout(), "fits": None, "peak_bytes": e.peak_bytes,
            "needed_bytes": e.peak_bytes + margin, "tokens_per_s": tokens / e.step_s,
            "tokens_per_s_per_gpu": tokens / e.step_s / gpus, "step_time_s": e.step_s, "bound": e.bound,
            "estimate": "screen", "reason": None, "dp_replicate": c.dp_replicate, "dp_shard": c.dp_shard,
            "tp": c.tp, "sp": c.sp, "pp": c.pp, "schedule": c.schedule, "microbatches": c.microbatches,
            "ep": c.ep, "ac": c.ac, "micro": c.micro, "_margin": margin}


def _pruned_row(p: dict[str, Any]) -> dict[str, Any]:
    """A degree combination pruned by a rule: its layout text, the degrees it names, and the rule."""
    named = dict(w.split("=", 1) for w in p["layout"].split() if "=" in w)
    degrees = {k: int(v) for k, v in named.items() if k in ("dp_replicate", "dp_shard", "tp", "pp")}
    if "schedule" in named:
        degrees["schedule"] = named["schedule"]
    return {"rank": None, "layout": p["layout"], "fits": None, "reason": p["reason"], "estimate": "rule", **degrees}


def _nothing(rows: dict[Candidate, dict[str, Any]], budget: int, pruned: list[dict[str, Any]],
             log: dict[str, Any], checked: int, exact: int) -> str:
    """One line for when nothing fits: the smallest need seen, and what to change."""
    left = sum(1 for r in rows.values() if r["fits"] is None and r["needed_bytes"] <= budget)
    if left and (log["time_limit_reached"] or checked >= exact):
        why = "the time limit was reached" if log["time_limit_reached"] else f"exact={exact} checks were spent"
        return (f"{why} before a layout was predicted to fit ({checked} checked); {left} more pass the screen: "
                "raise --exact or --time-limit")
    seen = [r for r in rows.values() if r["needed_bytes"] == r["needed_bytes"]]
    if not seen:
        return (f"no layout passes the rules ({len(pruned)} combinations pruned, e.g. {pruned[0]['reason']})"
                if pruned else "no layout to consider")
    low = min(seen, key=lambda r: r["needed_bytes"])
    return (f"the smallest layout needs {format_bytes(low['needed_bytes'])} per GPU ({low['layout']}, "
            f"{low['estimate']}) against {format_bytes(budget)}; give more GPUs or memory, or a smaller "
            "global batch or seq_len")


# --------------------------------------------------------------------------------------------------
# The exact checks
# --------------------------------------------------------------------------------------------------


def _shape_key(c: Candidate) -> tuple:
    """What a rank's memory depends on: every degree but dp_replicate's size (a copy holds the same)."""
    return (c.dp_replicate > 1, c.dp_shard, c.tp, c.pp, c.ep, c.sp, c.schedule, c.microbatches, c.ac, c.micro)


def _check(model: ModelConfig, tcfg: TrainConfig, screened: list[Candidate], rows: dict[Candidate, dict[str, Any]],
           device: str, prof: Any, budget: int, exact: int, top: int, progress: bool, workers: int | None,
           zero: int, gpus_per_node: int, nodes: int, deadline: float | None, log: dict[str, Any],
           first: list[Candidate]) -> int:
    """Run the predictors on the screen's best candidates until ``top`` fit; returns how many were checked.
    Each round takes the next few candidates (as many as workers): their memory (once per distinct
    per-rank shape, :func:`_shape_key`), then the step time of those that fit, in forked workers."""
    from workbench.config import JobConfig, ParallelConfig, validate

    if exact == 0 or not screened:
        return 0
    if workers is None:
        from workbench.cpu_quota import usable_cpus

        workers = usable_cpus()
    bar = None
    if progress:
        from workbench.progress import tqdm

        class _Bar(tqdm):  # type: ignore[misc, valid-type]
            monitor_interval = 0  # no monitor thread: the checks fork (workers.can_fork wants one thread)

        bar = _Bar(total=min(exact, len(screened)), desc=f"advise {model.name}", unit="layout", leave=False)
    memo: dict[tuple, dict[str, Any]] = {}
    ratios: dict[str, list[float]] = {}  # AC mode -> the predictor's peak over the screen's, per check
    fitting = checked = 0
    queue = iter(screened)
    try:
        while fitting < top and checked < exact:
            if deadline is not None and time.perf_counter() > deadline:
                log["time_limit_reached"] = True
                break
            batch: list[tuple[Candidate, Any]] = []
            while len(batch) < max(1, min(workers, top - fitting, exact - checked)):
                c = next(queue, None)
                if c is None:
                    break
                seen = ratios.get(c.ac) or [v for vs in ratios.values() for v in vs]
                if seen and c not in first and rows[c]["peak_bytes"] * min(seen) > budget - rows[c]["_margin"]:
                    r = min(seen)
                    rows[c]["fits"] = False
                    rows[c]["reason"] = (f"memory (screen x {r:.2f}, the smallest ratio of the predictor's peak to "
                                         f"the screen's so far): {format_bytes(rows[c]['peak_bytes'] * r)} + margin > "
                                         f"{format_bytes(budget)}")
                    continue
                try:
                    par = ParallelConfig(**{k: v for k, v in c.settings().items() if k in _PARALLEL}, zero=zero)
                    tr = dataclasses.replace(tcfg, activation_checkpointing=c.ac,
                                             micro_batch=c.micro if c.pp == 1 else None)
                    validate(model, par, tr)
                except ValueError as e:
                    rows[c]["reason"] = f"config: {e}"
                    continue
                batch.append((c, JobConfig(model=model, parallel=par, train=tr)))
            if not batch:
                break
            todo = {}
            for c, job in batch:
                todo.setdefault(_shape_key(c), job)
            keys = [k for k in todo if k not in memo]
            for k, res in zip(keys, _run(lambda job: _memory(job, device), [todo[k] for k in keys], workers)):
                memo[k] = res
                log["memory_s"].append(res.get("seconds"))
            fit = []
            for c, job in batch:
                checked += 1
                screen_peak = rows[c]["peak_bytes"]
                if "error" not in memo[_shape_key(c)]:
                    ratios.setdefault(c.ac, []).append(memo[_shape_key(c)]["peak_bytes"] / screen_peak)
                if _apply_memory(rows[c], memo[_shape_key(c)], budget):
                    fit.append((c, job))
            times = _run(lambda job: _time(job, device, prof, gpus_per_node, nodes), [job for _, job in fit], workers)
            for (c, _), res in zip(fit, times):
                fitting += _apply_time(rows[c], res)
                log["time_s"].append(res.get("seconds"))
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    return checked


_PARALLEL = {"dp_replicate", "dp_shard", "tp", "pp", "ep", "sequence_parallel", "pp_schedule", "microbatches"}


def _memory(job: Any, device: str) -> dict[str, Any]:
    """The memory predictor's worst-rank peak of ``job`` (CUDA: the caching allocator's reserved peak)."""
    from workbench.prediction.memory import peak_per_rank, predict, reserved_per_rank

    p = job.parallel
    ranks = [0] if p.pp == 1 else [0, p.world_size - 1]  # the first and last stages hold the most
    tl = predict(job, device=device, ranks=ranks, progress=False, workers=1)
    peak = int((reserved_per_rank(tl) if device == "cuda" else peak_per_rank(tl)).max())
    return {"peak_bytes": peak, "seconds": tl.meta.get("prediction_s")}


def _time(job: Any, device: str, prof: Any, gpus_per_node: int, nodes: int) -> dict[str, Any]:
    """predict_time's step of ``job``: seconds, tokens/s and the bound of its slowest rank."""
    from workbench.prediction.step_time import predict_time

    t0 = time.perf_counter()
    meta = predict_time(job, device=device, profile=prof, gpus_per_node=gpus_per_node, nodes=nodes).meta
    by_rank = meta["step_time_s_by_rank"]
    slowest = max(by_rank, key=by_rank.get)
    return {"step_time_s": meta["step_time_s"], "tokens_per_s": meta["tokens_per_s"], "bound": meta["bound"][slowest],
            "seconds": round(time.perf_counter() - t0, 3)}


def _apply_memory(row: dict[str, Any], res: dict[str, Any], budget: int) -> bool:
    """Put the memory predictor's result into the candidate's row; whether it fits."""
    if "error" in res:
        row["reason"] = f"prediction failed: {res['error']}"
        return False
    row["peak_bytes"] = res["peak_bytes"]
    row["needed_bytes"] = res["peak_bytes"] + row["_margin"]
    row["fits"] = bool(row["needed_bytes"] <= budget)
    row["estimate"] = "predicted"
    if not row["fits"]:
        row["reason"] = (f"memory: predicted {format_bytes(row['needed_bytes'])} (peak + margin) > "
                         f"{format_bytes(budget)}")
    return row["fits"]


def _apply_time(row: dict[str, Any], res: dict[str, Any]) -> int:
    """Put predict_time's result into a fitting candidate's row; 1 if it has one."""
    if "error" in res:
        row["estimate"] = "screen"
        row["reason"] = f"step time prediction failed: {res['error']}"
        return 0
    gpus = row["tokens_per_s"] / row["tokens_per_s_per_gpu"]
    row["step_time_s"] = res["step_time_s"]
    row["tokens_per_s"] = res["tokens_per_s"]
    row["tokens_per_s_per_gpu"] = res["tokens_per_s"] / gpus
    row["bound"] = res["bound"]
    return 1


def _bounds(rows: dict[Candidate, dict[str, Any]], cands: list[Candidate], est: list[Any], room: list[int]) -> None:
    """Mark a fitting layout memory-bound when the same degrees with a bigger micro batch or less
    recomputation are faster (by the screen) but do not fit (by the predictor, or the screen)."""
    lighter = {"none": 0, "op": 1, "selective": 2, "full": 3}
    by_family: dict[tuple, list[int]] = {}
    for i, c in enumerate(cands):
        by_family.setdefault(c.family(), []).append(i)
    for members in by_family.values():
        for i in members:
            row = rows[cands[i]]
            if not row["fits"]:
                continue
            c = cands[i]
            for j in members:
                o = cands[j]
                if j == i or est[j].step_s >= est[i].step_s:
                    continue
                if o.micro >= c.micro and lighter[o.ac] <= lighter[c.ac] and rows[o]["fits"] is not True:
                    over = rows[o]["fits"] is False or est[j].peak_bytes > room[j]
                    if over:
                        row["bound"] = "memory"
                        break
    for r in rows.values():
        r.pop("_margin", None)


# --------------------------------------------------------------------------------------------------
# Forked workers for the checks
# --------------------------------------------------------------------------------------------------


def _run(fn: Callable[[Any], dict[str, Any]], items: list[Any], workers: int) -> list[dict[str, Any]]:
    """``[fn(x) for x in items]``, up to ``workers`` at once in forked processes when forking is safe
    (:func:`workbench.prediction.workers.can_fork`); an error becomes ``{"error": message}``."""
    if not items:
        return []
    from workbench.prediction.workers import can_fork

    if workers <= 1 or len(items) == 1 or not can_fork():
        return [_guard(fn, x) for x in items]
    import importlib

    for name in ("workbench.prediction.memory", "workbench.prediction.step_time", "workbench.prediction.fake",
                 "workbench.parallel.build", "workbench.train.step", "workbench.prediction.op_costs"):
        importlib.import_module(name)  # imported once, before the fork
    out: list[dict[str, Any] | None] = [None] * len(items)
    with tempfile.TemporaryDirectory(prefix="workbench-advise-") as d:
        running: dict[int, int] = {}
        pending = list(range(len(items)))
        while pending or running:
            while pending and len(running) < workers:
                i = pending.pop(0)
                path = os.path.join(d, f"{i}.json")
                pid = os.fork()
                if pid == 0:  # the child: never returns into the caller's code
                    code = 1
                    try:
                        import torch

                        torch.set_num_threads(1)
                        with open(path, "w") as f:
                            json.dump(_guard(fn, items[i]), f)
                        code = 0
                    finally:
                        os._exit(code)
                running[pid] = i
            pid, status = os.wait()
            i = running.pop(pid)
            path = os.path.join(d, f"{i}.json")
            if os.waitstatus_to_exitcode(status) == 0 and os.path.exists(path):
                with open(path) as f:
                    out[i] = json.load(f)
            else:
                out[i] = {"error": f"worker exited with status {os.waitstatus_to_exitcode(status)}"}
    return [o or {"error": "no result"} for o in out]


def _guard(fn: Callable[[Any], dict[str, Any]], x: Any) -> dict[str, Any]:
    try:
        return fn(x)
    except Exception as e:  # noqa: BLE001 - one layout's failed prediction is reported in its row; the search goes on
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}

