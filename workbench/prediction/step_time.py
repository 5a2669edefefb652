"""Predict one training step's time on every distinct rank, for any layout and scale, as a StepTimeline.

How a prediction is made::

    for each distinct rank r (workbench.prediction.fake.distinct_ranks):
        the trainer's one build path and step code, on fake tensors and a fake process group   (fake.py)
        OpRecorder on top: every operator (FLOPs, bytes) and collective (kind, bytes, group)    (op_costs.py)
        a stage of N identical blocks simulated with 4 and unrolled to N (the middle block's
        operators repeated), gradient accumulation's middle micro-batches repeated, and a 1F1B / GPipe
        pipeline simulated with pp + 2 / 3 microbatches and unrolled to all of them in the schedule's order
    price each operator on the device profile's roofline and each collective on its link model
        (workbench.time.devices.DeviceProfile.compute_time / collective_time)
    play the operators in order on two streams per rank, compute and comm, with each technique's overlap:
        FSDP2 all-gathers      on the comm stream; the next compute waits for them; in forward one
                               starts while the previous unit computes (the host runs ahead of a GPU),
                               in backward where FSDP2 prefetches it (its place in the recorded order)
        gradient reductions    FSDP2's reduce-scatter, HSDP/DDP all-reduces: on the comm stream,
                               overlapping the rest of backward; the optimizer waits for them
        TP/SP, EP all-to-all   on the compute stream: exposed
        and anything else      (loss / grad-norm all-reduces, ZeRO-1's broadcasts)
        pipeline               each stage's actions in the schedule's real order (the recorded one); a
                               send goes on the comm stream, a receive waits for its matching send
                               (k-th send from stage a to b <-> k-th receive on b from a); the wait is
                               idle "wait:bubble"
    -> StepTimeline(source="predicted"), meta: device_model, layout, step_time_s, tokens_per_s, bound and
       flops per rank, rank_map (every rank -> the representative it equals)

The bytes of each collective are what the trainer's own code hands the process group, so they match the
plan's communication volume (``ShardingPlan.comm``) wherever the plan counts the same calls.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any

from workbench.config import JobConfig

__all__ = ["predict_time", "rank_ops", "schedule_ranks", "clear_cache"]

_CACHE: dict[tuple, list] = {}
_CACHE_MAX = 8  # ranks' operator lists kept (a llama-70b rank unrolled: ~40k operators, ~10 MB)
_LAYER = re.compile(r"(?<![\w])layers\.(\d+)(?=\.|$)")
_CATEGORY = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "other": "data",
             "data": "data", "checkpoint": "checkpoint"}


def clear_cache() -> None:
    """Forget the recorded operators of earlier predictions."""
    _CACHE.clear()


# --------------------------------------------------------------------------------------------------
# Recording: the operators of one rank's step
# --------------------------------------------------------------------------------------------------


def rank_ops(job: JobConfig, rank: int, target: str = "cpu", fold: bool = True) -> tuple[list, dict[str, Any]]:
    """The operators and collectives of one steady-state training step of ``rank`` (a list of
    :class:`~workbench.prediction.op_costs.Op`), and what was simulated. Cached per (job, rank, target)."""
    key = (job.to_json(), rank, target, fold)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit[0], dict(hit[1], cached=True)
    from workbench.prediction.fake import run_fake_steps, same_peak_job
    from workbench.prediction.fold import fold_plan
    from workbench.prediction.op_costs import OpRecorder

    plan = fold_plan(job, rank) if fold else None
    sim_job = plan.job if plan is not None else job
    pp = job.parallel.pp
    accum = 1 if pp > 1 else job.train.grad_accum(job.parallel.dp)
    if accum > 2:
        sim_job = same_peak_job(sim_job, rank)  # two micro-batches: the first, and the last (with the sync)
    m_real = job.parallel.pp_microbatches if pp > 1 else 0
    m_sim = _pipeline_microbatches(job) if fold else m_real
    if m_sim < m_real:
        sim_job = _with_microbatches(sim_job, m_sim)
    rec = OpRecorder(rank=rank)
    t0 = time.perf_counter()
    run_fake_steps(sim_job, rank, device="cpu", steps=1, mode_factory=lambda: rec,
                   on_built=lambda model, opt: rec.track(model, opt), microbatches="all", warm_start=True,
                   target=target)
    info: dict[str, Any] = {"simulate_s": round(time.perf_counter() - t0, 3), "ops_simulated": len(rec.ops)}
    ops = [o for o in rec.ops if o.step >= 0]  # not the warm start's optimizer state (step -1)
    if plan is not None:
        ops = _unfold(ops, plan.simulated, plan.real, plan.group, rec.optimizer_scale(plan))
        info["folded"] = {"simulated_layers": list(plan.simulated), "layers": len(plan.real)}
    if accum > 2:
        ops = _repeat_microbatches(ops, accum)
        info["microbatches_simulated"] = 2
    if m_sim < m_real:
        ops = _extend_pipeline(ops, m_real - m_sim)
        info["microbatches_simulated"] = m_sim
    if pp > 1:
        ops = _label_p2p(ops)
    info["ops"] = len(ops)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (ops, info)
    return ops, info


@functools.lru_cache(maxsize=4096)
def _block_of(module: str) -> int:
    m = _LAYER.search(module)
    return int(m.group(1)) if m else -1


def _renamer(table: dict[int, int]):
    """op -> the op with its module's layer ids mapped through ``table`` (module names cached: a llama-70b stage
    unrolls to ~40k operators over a few hundred module names)."""
    from workbench.prediction.op_costs import Op

    names: dict[str, str] = {}

    def rename(op):
        module = names.get(op.module)
        if module is None:
            module = names[op.module] = _LAYER.sub(
                lambda m: f"layers.{table.get(int(m.group(1)), int(m.group(1)))}", op.module)
        if module == op.module:
            return op
        return Op(op.cls, op.name, op.phase, op.step, op.microbatch, module, op.flops, op.nbytes, op.dtype, op.kind,
                  op.group, op.mode, op.peer)

    return rename


def _unfold(ops: list, simulated: list[int], real: list[int], group: int, opt_scale: float) -> list:
    """The operators of a stage of ``real`` blocks from those of the same stage simulated with ``simulated``:
    in every pass (phase, micro-batch) the contiguous run of the middle block M's operators is written
    ``len(real) - len(simulated) + 1`` times (M's neighbours are blocks like any other, see
    ``workbench.prediction.fold``); the optimizer's operators, which act on all parameters at once
    (foreach), are scaled by ``opt_scale`` (the real stage's parameters over the simulated one's)."""
    if group > 1:
        blocks = [simulated[i:i + group] for i in range(0, len(simulated), group)]
        real_blocks = [real[i:i + group] for i in range(0, len(real), group)]
    else:
        blocks = [[b] for b in simulated]
        real_blocks = [[b] for b in real]
    k = len(blocks)
    M = set(blocks[k - 2])
    copies = len(real_blocks) - k + 1
    base = {s: r for sb, rb in zip(blocks[:k - 2], real_blocks[:k - 2]) for s, r in zip(sb, rb)}
    base.update({s: r for s, r in zip(blocks[-1], real_blocks[-1])})

    def table(q: int) -> dict[int, int]:  # copy q (0-based) of M is real block k - 2 + q
        t = dict(base)
        t.update({s: r for s, r in zip(blocks[k - 2], real_blocks[k - 2 + q])})
        return t

    tables = [_renamer(table(q)) for q in range(copies)]
    out: list = []
    i, n = 0, len(ops)
    while i < n:
        op = ops[i]
        if op.phase == "optimizer":
            if opt_scale != 1.0 and op.cls != "view":
                op = dataclasses.replace(op, flops=op.flops * opt_scale, nbytes=int(op.nbytes * opt_scale))
            out.append(tables[0](op))
            i += 1
            continue
        if _block_of(op.module) in M:
            j = i
            key = (op.phase, op.microbatch)
            while j < n and _block_of(ops[j].module) in M and (ops[j].phase, ops[j].microbatch) == key:
                j += 1
            order = range(copies) if op.phase != "backward" else range(copies - 1, -1, -1)
            for q in order:
                out.extend(map(tables[q], ops[i:j]))
            i = j
            continue
        out.append(tables[0](op))
        i += 1
    return out


def _pipeline_microbatches(job: JobConfig) -> int:
    """Microbatches to simulate a pipeline step with: what shows every kind of segment of the schedule once
    (1F1B: pp + 2, so that every stage has two steady backward-forward pairs, the second one accumulating into
    gradients the first made; GPipe: a first, a middle and a last microbatch), extended to the job's by :func:`_extend_pipeline`; Interleaved1F1B: all of them."""
    par = job.parallel
    if par.pp == 1:
        return 0
    keep = {"1F1B": par.pp + 2, "GPipe": 3, "GPipeLean": 3}.get(par.pp_schedule, par.pp_microbatches)
    return min(keep, par.pp_microbatches)


def _with_microbatches(job: JobConfig, m: int) -> JobConfig:
    """``job`` with ``m`` pipeline microbatches of the same size (the global batch shrinks with them)."""
    par, train = job.parallel, job.train
    per_mb = train.global_batch // par.dp // par.pp_microbatches
    return dataclasses.replace(job, parallel=dataclasses.replace(par, microbatches=m),
                               train=dataclasses.replace(train, global_batch=per_mb * m * par.dp))


def _extend_pipeline(ops: list, extra: int) -> list:
    """A stage's step of ``extra`` more microbatches than simulated, in its schedule's order: a steady unit
    (1F1B: the second backward-then-forward pair, with the sends and receives between; GPipe: the second
    forward, and the second backward) written ``extra`` more times, then the forwards and the backwards renumbered in
    order (every stage of these schedules runs its forwards, and its backwards, in microbatch order). Sends
    and receives are matched by order (:func:`schedule_ranks`), so every stage adding the same units keeps
    them paired."""
    segs: list[tuple[str, list]] = []  # ("F" | "B" | "G", ops): actions, and the glue between them
    for op in ops:
        kind = ("F" if op.phase == "forward" else "B") if op.microbatch >= 0 and op.phase in ("forward", "backward") \
            else "G"
        key = (kind, op.microbatch)
        if segs and segs[-1][0] == key:
            segs[-1][1].append(op)
        else:
            segs.append((key, [op]))
    acts = [i for i, (k, _) in enumerate(segs) if k[0] != "G"]
    units: list[tuple[int, int]] = []
    pairs = [j for j in range(len(acts) - 1) if segs[acts[j]][0][0] == "B" and segs[acts[j + 1]][0][0] == "F"]
    pair = pairs[1] if len(pairs) > 1 else (pairs[0] if pairs else None)  # not the first backward: it makes grads
    if pair is not None:  # 1F1B: glue + B + glue + F
        start = acts[pair - 1] + 1 if pair > 0 else 0
        units.append((start, acts[pair + 1] + 1))
    else:  # GPipe: the second forward and the second backward, each with the glue before it
        for kind in ("F", "B"):
            mine = [j for j in range(len(acts)) if segs[acts[j]][0][0] == kind]
            if len(mine) >= 2:
                j = mine[1]
                units.append((acts[j - 1] + 1, acts[j] + 1))
    out: list = []
    ends = {e: (s0, e) for s0, e in units}
    for i, (_, seg_ops) in enumerate(segs):
        out.append(seg_ops)
        if i + 1 in ends:
            s0, e = ends[i + 1]
            for _ in range(extra):
                out.extend(list(x[1]) for x in segs[s0:e])
    flat: list = []
    counter = {"F": -1, "B": -1}
    last_key = None
    for seg_ops in out:
        first = seg_ops[0]
        if first.microbatch >= 0 and first.phase in ("forward", "backward"):
            kind = "F" if first.phase == "forward" else "B"
            key = id(seg_ops)
            if key != last_key:
                counter[kind] += 1
                last_key = key
            mb = counter[kind]
            flat.extend(o if o.microbatch == mb else dataclasses.replace(o, microbatch=mb) for o in seg_ops)
        else:
            flat.extend(seg_ops)
    return flat


def _label_p2p(ops: list) -> list:
    """A pipeline's sends and receives run between the stage's actions, outside their marks: a send belongs to
    the action before it (it sends that action's output), a receive to the action after it (it waits for its
    input); both get that action's phase and microbatch."""
    out = list(ops)
    nxt = None
    for i in range(len(out) - 1, -1, -1):
        o = out[i]
        if o.microbatch >= 0 and o.phase in ("forward", "backward"):
            nxt = (o.phase, o.microbatch)
        elif o.mode == "recv" and nxt is not None:
            out[i] = dataclasses.replace(o, phase=nxt[0], microbatch=nxt[1])
    prev = None
    for i, o in enumerate(out):
        if o.microbatch >= 0 and o.phase in ("forward", "backward") and o.mode != "recv":
            prev = (o.phase, o.microbatch)
        elif o.mode == "send" and prev is not None:
            out[i] = dataclasses.replace(o, phase=prev[0], microbatch=prev[1])
    return out


def _repeat_microbatches(ops: list, accum: int) -> list:
    """A step of ``accum`` micro-batches from one simulated with two: micro-batch 0 (no gradient sync)
    stands for micro-batches 0 .. accum - 2, micro-batch 1 (the sync) is the last."""
    first = [o for o in ops if o.microbatch == 0 and o.phase in ("forward", "backward")]
    out: list = []
    done = False
    for o in ops:
        if o.microbatch == 0 and o.phase in ("forward", "backward"):
            if not done:
                for m in range(accum - 1):
                    out.extend(dataclasses.replace(x, microbatch=m) for x in first)
                done = True
            continue
        out.append(dataclasses.replace(o, microbatch=accum - 1) if o.microbatch == 1 else o)
    return out


# --------------------------------------------------------------------------------------------------
# Scheduling: the operators on two streams per rank
# --------------------------------------------------------------------------------------------------


class _RankSim:
    """One rank's step played on its compute and comm streams (see the module docstring)."""

    def __init__(self, rank: int, ops: list, profile, gpus_per_node: int, stage_of=None, slow: float = 1.0):
        self.rank, self.ops, self.prof, self.gpn = rank, ops, profile, gpus_per_node
        self.slow = slow  # > 1: this rank's compute shares the host's cores with other ranks (CPU)
        self.runahead = profile.kind == "cuda"
        self.stage_of = stage_of
        self.i = 0
        self.tc = 0.0   # compute stream free
        self.tm = 0.0   # comm stream free
        self.gather_end = 0.0
        self.wait_gather = False
        self.unit_start = 0.0
        self.async_end = 0.0
        self.last_pass = None
        self.rows: list[dict] = []
        self._open: dict | None = None
        self.sent: dict[tuple, int] = {}
        self.received: dict[tuple, int] = {}
        self.stats = {"compute_s": 0.0, "overhead_s": 0.0, "flops": 0.0, "comm_s": 0.0, "bubble_s": 0.0,
                      "comm_bytes": 0.0}

    def _intra(self, group: tuple) -> bool:
        if not group:
            return True
        node = group[0] // self.gpn
        return all(g // self.gpn == node for g in group)

    def _span(self, start: float, end: float, category: str, op, stream: str, name: str, nbytes: int = 0) -> None:
        o = self._open
        if (o is not None and stream == "compute" and category != "communication" and category != "idle"
                and o["category"] == category and o["module"] == op.module and o["microbatch"] == op.microbatch
                and abs(o["end"] - start) < 1e-15):
            o["end"] = end  # consecutive operators of one module and pass: one span, named after its longest
            if end - start > o["_longest"]:
                o["_longest"], o["name"] = end - start, name
            return
        row = {"rank": self.rank, "start": start, "end": end, "category": category,
               "phase": op.phase if op.phase in ("forward", "backward", "optimizer") else "other",
               "step": 0, "microbatch": op.microbatch, "module": op.module, "stream": stream, "name": name,
               "bytes": int(nbytes), "_longest": end - start}
        self.rows.append(row)
        self._open = row if stream == "compute" else self._open

    def run(self, mailbox: dict[tuple, list[float]] | None = None) -> bool:
        """Play operators until done (True) or a receive whose message has not been sent yet (False)."""
        prof = self.prof
        ops = self.ops
        while self.i < len(ops):
            op = ops[self.i]
            pass_key = (op.phase, op.microbatch)
            if pass_key != self.last_pass:
                if self.last_pass is not None and self.last_pass[0] == "backward":
                    self.tc = max(self.tc, self.gather_end)  # a backward's last prefetch was waited for in it
                if op.phase == "optimizer":  # the optimizer waits for every gradient reduction
                    self.tc = max(self.tc, self.async_end, self.tm)
                self.last_pass = pass_key
                self.unit_start = self.tc
            if op.cls == "collective":
                if op.mode == "recv":
                    key = (self.stage_of(op.peer), self.stage_of(self.rank))
                    k = self.received.get(key, 0)
                    box = mailbox.get(key, []) if mailbox is not None else []
                    if k >= len(box):
                        return False
                    arrive = box[k]
                    self.received[key] = k + 1
                    if arrive > self.tc:
                        self._span(self.tc, arrive, "idle", op, "compute", "wait:bubble")
                        self.stats["bubble_s"] += arrive - self.tc
                        self.tc = arrive
                    self.i += 1
                    continue
                self._collective(op, mailbox)
                self.i += 1
                continue
            if self.wait_gather:
                self.tc = max(self.tc, self.gather_end)
                self.wait_gather = False
                self.unit_start = self.tc
            dur = prof.compute_time(op.flops, op.nbytes, op.cls, op.dtype) * self.slow
            over = (prof.view_overhead_s if op.cls == "view" else prof.op_overhead_s) * self.slow
            self._span(self.tc, self.tc + dur, _CATEGORY.get(op.phase, "data"), op, "compute", op.name)
            self.tc += dur
            self.stats["compute_s"] += dur - over
            self.stats["overhead_s"] += over
            self.stats["flops"] += op.flops
            self.i += 1
        self.tc = max(self.tc, self.tm, self.async_end)
        return True

    def _collective(self, op, mailbox) -> None:
        prof = self.prof
        name = op.kind if op.mode not in ("send", "recv") else op.mode
        # on a CPU a collective's copies and reductions run on the same shared cores as compute
        cpu_slow = self.slow if prof.kind == "cpu" else 1.0
        if op.mode == "send":
            dur = prof.collective_time("send/recv", op.nbytes, 2, self._intra(op.group)) * cpu_slow
            start = max(self.tc, self.tm)
            self.tm = start + dur
            key = (self.stage_of(self.rank), self.stage_of(op.peer))
            if mailbox is not None:
                mailbox.setdefault(key, []).append(self.tm)
            self._span(start, self.tm, "communication", op, "comm", "send", op.nbytes)
            self.stats["comm_s"] += dur
            self.stats["comm_bytes"] += op.nbytes
            return
        n = len(op.group) or 1
        dur = prof.collective_time(op.kind, op.nbytes, n, self._intra(op.group)) * cpu_slow
        if n <= 1 or dur <= 0:
            return
        self.stats["comm_s"] += dur
        from workbench.parallel.collectives import ring_bytes

        self.stats["comm_bytes"] += ring_bytes(op.kind, op.nbytes, n)
        if op.mode == "prefetch":
            if op.phase == "forward":  # gathered for the module about to run: the next compute waits
                issue = self.unit_start if self.runahead else self.tc
                self.wait_gather = True
            else:  # FSDP2 prefetches in backward: this one is waited for when the next one is issued
                self.tc = max(self.tc, self.gather_end)
                self.unit_start = self.tc
                issue = self.tc
                self.wait_gather = False
            start = max(self.tm, issue)
            self.tm = start + dur
            self.gather_end = max(self.gather_end, self.tm)
            self._span(start, self.tm, "communication", op, "comm", name, op.nbytes)
        elif op.mode == "async":
            start = max(self.tm, self.tc)
            self.tm = start + dur
            self.async_end = max(self.async_end, self.tm)
            self._span(start, self.tm, "communication", op, "comm", name, op.nbytes)
        else:  # sync: the compute stream waits for it
            start = self.tc
            self.tc = start + dur
            self._span(start, self.tc, "communication", op, "compute", name, op.nbytes)


def schedule_ranks(ops_by_rank: dict[int, list], profile, gpus_per_node: int, parallel,
                   slow: dict[int, float] | None = None) -> dict[int, _RankSim]:
    """Play every rank's operators; pipeline stages together, each receive waiting for its send. ``slow``:
    per rank, how much slower its compute runs (ranks sharing a CPU's cores)."""
    slow = slow or {}
    if parallel.pp == 1:
        sims = {r: _RankSim(r, ops, profile, gpus_per_node, slow=slow.get(r, 1.0)) for r, ops in ops_by_rank.items()}
        for s in sims.values():
            s.run()
        return sims

    def stage_of(r: int) -> int:
        return int(parallel.rank_coords(r)[0])

    sims = {r: _RankSim(r, ops, profile, gpus_per_node, stage_of, slow.get(r, 1.0)) for r, ops in ops_by_rank.items()}
    # one pipeline of representatives: the first representative of each stage (ranks of one stage play alike)
    by_stage: dict[int, list[int]] = {}
    for r in sorted(sims):
        by_stage.setdefault(stage_of(r), []).append(r)
    columns = [[by_stage[s][min(j, len(by_stage[s]) - 1)] for s in sorted(by_stage)]
               for j in range(max(len(v) for v in by_stage.values()))]
    done: set[int] = set()
    for col in columns:
        mailbox: dict[tuple, list[float]] = {}
        fresh = {r: (sims[r] if r not in done else _RankSim(r, ops_by_rank[r], profile, gpus_per_node, stage_of,
                                                            slow.get(r, 1.0)))
                 for r in col}
        pending = list(col)
        while pending:
            progressed = False
            for r in list(pending):
                before = fresh[r].i
                if fresh[r].run(mailbox):
                    pending.remove(r)
                    progressed = True
                elif fresh[r].i != before:
                    progressed = True
            if not progressed:
                where = {r: (fresh[r].i, fresh[r].ops[fresh[r].i].name) for r in pending}
                raise RuntimeError(f"the pipeline schedule deadlocked in prediction (rank: operator index, name "
                                   f"{where}); please report")
        for r in col:
            if r not in done:
                sims[r] = fresh[r]
                done.add(r)
    return sims


def share_cores(sims: dict[int, _RankSim], rank_map: dict[int, int], profile, world: int,
                gpus_per_node: int) -> dict[int, float]:
    """Per representative rank, how much slower its compute runs when the ranks of one host share
    ``profile.cores`` CPU cores ({} when they need not: a GPU per rank, or no more ranks than cores).

    Processor sharing: while k ranks compute on c cores, each runs at min(1, c / k) of its speed. A rank's
    factor is the mean, over its own compute time, of max(1, k / c), with k counted from the last schedule
    (every rank weighted by the ranks it stands for, on its host). Ranks waiting in a collective or a
    pipeline receive leave their core to the others, so a pipeline's stages contend less than data-parallel
    ranks that all compute at once."""
    import numpy as np

    cores = int(getattr(profile, "cores", 0) or 0)
    per_host = min(world, gpus_per_node)
    if profile.kind != "cpu" or cores <= 0 or per_host <= cores:
        return {}
    weight: dict[int, int] = {}
    for r, rep in rank_map.items():
        if rep in sims:
            weight[rep] = weight.get(rep, 0) + 1
    scale = per_host / max(1, sum(weight.values()))  # the ranks of one host, of those represented
    busy = {r: [(row["start"], row["end"]) for row in s.rows if row["category"] != "idle"] for r, s in sims.items()}
    edges, deltas = [], []
    for r, spans in busy.items():
        for a, b in spans:
            edges += [a, b]
            deltas += [weight.get(r, 1) * scale, -weight.get(r, 1) * scale]
    if not edges:
        return {}
    order = np.argsort(edges, kind="stable")
    t = np.asarray(edges)[order]
    k = np.cumsum(np.asarray(deltas)[order])  # ranks computing from t[i] to t[i + 1]
    excess = np.maximum(1.0, k[:-1] / cores) * np.diff(t)
    integral = np.concatenate([[0.0], np.cumsum(excess)])  # of max(1, k / c) dt, at each t
    out = {}
    for r, spans in busy.items():
        if not spans:
            continue
        a = np.array([s[0] for s in spans])
        b = np.array([s[1] for s in spans])
        length = float((b - a).sum())
        if length <= 0:
            continue
        # the integrand counts this rank too; a rank's own span never exceeds the merged count
        out[r] = max(1.0, float((np.interp(b, t, integral) - np.interp(a, t, integral)).sum()) / length)
    return out


# --------------------------------------------------------------------------------------------------
# The prediction
# --------------------------------------------------------------------------------------------------


def _profile(device: str, gpu: Any, profile: Any):
    from workbench.time.devices import device_profile

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: predict step time for 'cpu' or 'cuda'")
    if profile is not None:
        return device_profile(profile)
    if device == "cuda":
        return device_profile(gpu or "H100-SXM")
    if gpu is not None:
        raise ValueError(f"gpu={gpu!r} names a GPU, but device='cpu'; pass device='cuda' to predict for it")
    return device_profile("cpu")


def _bound(stats: dict[str, float], step_s: float) -> str:
    """What bounds a rank's step: the largest of its roofline compute, its per-operator overhead (host),
    its exposed communication and its pipeline bubble."""
    exposed = max(0.0, step_s - stats["compute_s"] - stats["overhead_s"] - stats["bubble_s"])
    parts = {"compute": stats["compute_s"], "host": stats["overhead_s"], "communication": exposed,
             "bubble": stats["bubble_s"]}
    return max(parts, key=parts.get)


def predict_time(job: Any, *, device: str = "cpu", gpu: str | None = None, profile: Any = None, nodes: int | None = None,
                 gpus_per_node: int | None = None, ranks: list[int] | None = None, progress: bool = False,
                 fold: bool = True, parallel: Any = None, train: Any = None, nproc: int | None = None,
                 **layout) -> Any:
    """The predicted step timeline of every distinct rank of ``job`` (a JobConfig, or a model name /
    ModelConfig with ``parallel=``, ``train=`` or shortcuts like ``tp=2, micro_batch=4``), as a
    :class:`~workbench.time.timeline.StepTimeline` with ``source="predicted"``.

    ``device``: ``"cpu"`` (this machine's calibrated profile, ``workbench time calibrate``, else a default
    marked uncalibrated) or ``"cuda"`` with ``gpu`` (a profile name: ``H100-SXM``, ``H200``,
    ``A100-SXM-80GB``; default H100-SXM). ``profile``: a DeviceProfile or a profile's path/name, instead.
    ``nodes`` / ``gpus_per_node``: which groups cross nodes (default: the profile's gpus_per_node; CPU:
    one node). ``ranks``: only the representatives of these ranks. ``fold=False`` simulates every block and
    every microbatch (by default a stage of N identical blocks is simulated with 4, a pipeline with the fewest
    microbatches that show each segment of its schedule, and both are unrolled: see the module docstring).
    """
    from workbench.prediction.fake import distinct_ranks
    from workbench.prediction.memory import _check_rank, _job
    from workbench.time.timeline import StepTimeline, span_frame

    from workbench import compat

    compat.require("time.predict", "a step-time prediction", "use a torch release that has it (2.11 to 2.13 do)")
    prof = _profile(device, gpu, profile)
    job = _job(job, parallel, train, nproc, **layout)
    world = job.parallel.world_size
    if gpus_per_node is None:
        gpus_per_node = -(-world // nodes) if nodes else (prof.gpus_per_node if prof.kind == "cuda" else world)
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node}: give at least 1")
    if nodes is not None and nodes * gpus_per_node < world:
        raise ValueError(f"{nodes} nodes x {gpus_per_node} GPUs hold {nodes * gpus_per_node} ranks, but "
                         f"{job.parallel.describe()} has {world}; give more nodes or GPUs per node")
    # Without the model, distinct_ranks takes FSDP2's shards as even: ranks whose uneven shards differ by
    # a few rows (what a memory prediction tells apart) compute and send alike, up to FSDP2's padding.
    rank_map = distinct_ranks(job.parallel)
    reps = sorted(set(rank_map.values())) if ranks is None else sorted(
        {rank_map[_check_rank(r, rank_map)] for r in ranks})
    if job.parallel.pp > 1 and ranks is not None:  # a pipeline needs every stage to play its schedule
        stages = {job.parallel.rank_coords(r)[0] for r in reps}
        reps = sorted(reps + [r for r in set(rank_map.values()) if job.parallel.rank_coords(r)[0] not in stages])
    t0 = time.perf_counter()
    target = "cuda" if device == "cuda" else "cpu"
    ops_by_rank, infos = {}, {}
    for r in _progress(reps, job, progress):
        ops_by_rank[r], infos[str(r)] = rank_ops(job, r, target, fold)
    t1 = time.perf_counter()
    sims = schedule_ranks(ops_by_rank, prof, gpus_per_node, job.parallel)
    slow = share_cores(sims, rank_map, prof, world, gpus_per_node)
    if slow:
        sims = schedule_ranks(ops_by_rank, prof, gpus_per_node, job.parallel, slow)
        for _ in range(3):  # the schedule changes with the slowdown: a few rounds settle it
            again = share_cores(sims, rank_map, prof, world, gpus_per_node)
            slow = {r: 0.5 * (slow[r] + again.get(r, 1.0)) for r in slow}
            sims = schedule_ranks(ops_by_rank, prof, gpus_per_node, job.parallel, slow)
    rows = [row for r in reps for row in sims[r].rows]
    frame = span_frame(rows)
    steps = {r: sims[r].tc for r in reps}
    step_s = max(steps.values()) if steps else 0.0
    tokens = job.train.global_batch * job.train.seq_len
    meta = {
        "device_model": prof.describe(), "model": job.model.name, "layout": job.parallel.describe(),
        "world_size": world, "gpus_per_node": gpus_per_node, "nodes": -(-world // gpus_per_node),
        "step_time_s": step_s, "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "tokens_per_s_per_rank": tokens / step_s / world if step_s > 0 else 0.0,
        "step_time_s_by_rank": {str(r): steps[r] for r in reps},
        "bound": {str(r): _bound(sims[r].stats, steps[r]) for r in reps},
        "flops": {str(r): sims[r].stats["flops"] for r in reps},
        "comm_bytes": {str(r): sims[r].stats["comm_bytes"] for r in reps},
        "seconds": {str(r): {k: v for k, v in sims[r].stats.items() if k.endswith("_s")} for r in reps},
        "rank_map": {str(k): int(v) for k, v in rank_map.items() if v in steps},
        "core_sharing": {str(r): round(v, 4) for r, v in (slow or {}).items()},
        "simulated": infos, "simulate_s": round(t1 - t0, 3), "schedule_s": round(time.perf_counter() - t1, 3),
        "job": {"model": job.model.to_dict(), "parallel": job.parallel.to_dict(), "train": job.train.to_dict()},
    }
    return StepTimeline(frame, source="predicted", device=prof.name, meta=meta)


def _progress(reps: list[int], job: JobConfig, progress: bool):
    if not progress or len(reps) < 2:
        return reps
    from workbench.progress import tqdm

    return tqdm(reps, desc=f"predict time {job.model.name} [{job.parallel.describe()}]", unit="rank")
