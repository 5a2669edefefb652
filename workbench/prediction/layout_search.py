"""The layout advisor's search space and its analytic screen (:mod:`workbench.prediction.advise` uses them).

Every layout of ``gpus`` ranks is enumerated from the degrees that multiply to it, and each candidate gets
a closed-form estimate of its peak memory per rank and of its step time, in microseconds of Python, so
tens of thousands can be ranked before the exact predictors (a fake training step each, seconds to
tens of seconds for a 70B model) are run on the few that could make the top. The estimate is a screen,
not a prediction: its figures are replaced by the predictors' wherever they ran, and it prunes only
with a stated slack (:data:`SCREEN_SLACK`).

Per rank of the fullest stage, holding ``Ls = ceil(L / pp)`` of the model's ``L`` blocks (dim ``h``, kv width ``kv``, feed-forward
``f``, vocabulary ``V``), micro batch ``b`` sequences of ``s`` tokens, ``T = b*s``::

    parameters   P = (Ls * (2h^2 + 2h*kv + 3hf [* n_experts] + 2h) + V*h [stage 0] + V*h [last]) / tp
    state        P / dp_shard * (master + grad + 2 Adam moments)       16 B per parameter in fp32 / bf16-mixed
    gathered     FSDP2: two blocks' unsharded parameters (this one and the prefetched next) in compute dtype;
                 accumulating (micro-batches, or a pipeline) keeps the stage's unsharded gradients, P * 4 B
    activations  per block and token, compute dtype: (3h + 3kv + 4f [* top_k]) / tp  split by TP, + 12h not
                 split (/ tp under SP: the norms' fp32 upcasts count double); full AC keeps only the block input h, op about half the split part and a
                 quarter of the rest, selective every k-th block whole; times the micro-batches in flight on stage 0
                 (1; GPipe m; 1F1B min(m, pp); interleaved ~ (3 pp - 1) / 2 stage-chunks)
    logits       last stage: T * V * (compute + 3 * 4 B) (the output head gathers the whole vocabulary)

    compute      T * (3 F + R) / (peak * matmul efficiency) per micro-batch, F = 2 * matmul params + 2 Ls s h
                 (causal attention) per token; R the recomputed forward (full: F, selective: F/k, op: F/2)
    TP           4 all-reduces of T*h per block and micro-batch (+2 under full AC), intra-node, exposed
    FSDP2        all-gathers per micro-batch (forward, and backward again at zero=3) overlapped with compute,
                 one reduce-scatter at the last micro-batch; HSDP/DDP one all-reduce over dp_replicate
    EP           4 all-to-alls of T*top_k*h per MoE block, exposed
    pipeline     (m + (pp - 1) / v) micro-batch slots, v = 2 virtual stages under Interleaved1F1B; the
                 (pp - 1) / v slots are the bubble
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from workbench.config import AC_MODES, PP_INTERLEAVED_STAGES_PER_RANK, PP_SCHEDULES, ModelConfig

__all__ = ["Candidate", "Estimate", "enumerate_layouts", "estimate", "divisors", "SCREEN_SLACK"]

# A candidate whose estimated peak is more than this fraction over the room is pruned without the exact
# predictor; below it the memory predictor decides.
SCREEN_SLACK = 0.25
ALLOCATOR_OVERHEAD = 1.08  # the caching allocator's rounding and fragmentation over the live tensors (typical)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Candidate:
    """One layout of the search: the degrees, the pipeline schedule, AC and the local micro batch."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    sp: bool
    schedule: str | None  # None without pipeline parallelism
    microbatches: int     # pipeline micro-batches (pp > 1) or gradient-accumulation steps (pp == 1)
    ac: str
    micro: int            # sequences per micro-batch per data-parallel rank

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def family(self) -> tuple:
        """The degrees and schedule: what stays when AC and the micro batch change."""
        return (self.dp_replicate, self.dp_shard, self.tp, self.pp, self.ep, self.sp, self.schedule)

    def layout(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate={self.dp_replicate}")
        parts.append(f"dp_shard={self.dp_shard}")
        parts += [f"tp={self.tp}"] + (["sp"] if self.sp else []) + [f"pp={self.pp}"]
        if self.pp > 1:
            parts += [f"schedule={self.schedule}", f"microbatches={self.microbatches}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts += [f"ac={self.ac}", f"micro={self.micro}"]
        return " ".join(parts)

    def settings(self) -> dict[str, Any]:
        """The ParallelConfig / TrainConfig settings of this layout (``predict(model, **settings)``)."""
        out: dict[str, Any] = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp,
                               "pp": self.pp, "ep": self.ep, "sequence_parallel": self.sp,
                               "activation_checkpointing": self.ac}
        if self.pp > 1:
            out.update(pp_schedule=self.schedule, microbatches=self.microbatches)
        else:
            out["micro_batch"] = self.micro
        return out


@dataclass(frozen=True)
class Estimate:
    peak_bytes: float     # per rank, the worst stage, with the allocator's overhead (no CUDA/NCCL margin)
    step_s: float
    compute_s: float
    comm_s: float         # exposed communication
    bubble_s: float

    @property
    def bound(self) -> str:
        parts = {"compute": self.compute_s, "communication": self.comm_s, "bubble": self.bubble_s}
        return max(parts, key=parts.get)


def _pruned(layout: str, reason: str) -> dict[str, Any]:
    return {"layout": layout, "reason": reason}


def enumerate_layouts(model: ModelConfig, gpus: int, gpus_per_node: int, global_batch: int, seq_len: int, *,
                      zero: int = 3, schedules: tuple[str, ...] = PP_SCHEDULES,
                      ac_modes: tuple[str, ...] = AC_MODES) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """Every candidate layout of ``gpus`` ranks, and the degree combinations pruned by a rule (layout,
    reason): one row per pruned combination, not per AC mode and micro batch under it."""
    cands: list[Candidate] = []
    pruned: list[dict[str, Any]] = []
    heads = {"n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads, "ffn_hidden": model.ffn_hidden,
             "vocab_size": model.vocab_size}
    for tp in divisors(gpus):
        if tp > gpus_per_node or gpus_per_node % tp:
            pruned.append(_pruned(f"tp={tp}", f"TP within a node: tp={tp} does not divide the {gpus_per_node} "
                                              "GPUs of a node"))
            continue
        bad = [f"{k}={v}" for k, v in heads.items() if v % tp]
        if bad:
            pruned.append(_pruned(f"tp={tp}", f"divisibility: tp={tp} does not divide {', '.join(bad)}"))
            continue
        for pp in divisors(gpus // tp):
            where = f"tp={tp} pp={pp}"
            if pp > model.n_layers:
                pruned.append(_pruned(where, f"pipeline: pp={pp} is more stages than n_layers={model.n_layers}"))
                continue
            if pp > 1 and (model.n_experts or model.tie_embeddings):
                why = "a mixture of experts" if model.n_experts else "tied embeddings"
                pruned.append(_pruned(where, f"pipeline: pp={pp} is not supported with {why}"))
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                pruned.append(_pruned(where, f"divisibility: global_batch={global_batch} is not divisible by "
                                             f"dp={dp}"))
                continue
            local = global_batch // dp
            for dp_rep in divisors(dp):
                dp_shard = dp // dp_rep
                eps = [1] + ([e for e in divisors(model.n_experts) if e > 1 and dp_shard % e == 0]
                             if model.n_experts else [])
                for ep in eps:
                    cands.extend(_under(model, tp, pp, dp_rep, dp_shard, ep, local, seq_len, zero, schedules,
                                        ac_modes, pruned))
    return cands, pruned


def _under(model: ModelConfig, tp: int, pp: int, dp_rep: int, dp_shard: int, ep: int, local: int, seq_len: int,
           zero: int, schedules: tuple[str, ...], ac_modes: tuple[str, ...],
           pruned: list[dict[str, Any]]) -> Iterator[Candidate]:
    where = f"dp_replicate={dp_rep} dp_shard={dp_shard} tp={tp} pp={pp}"
    if zero < 2 and dp_shard > 1 and (tp > 1 or dp_rep > 1 or ep > 1):
        pruned.append(_pruned(where, f"ZeRO: zero={zero} (DDP) combines with neither tp, dp_replicate nor ep"))
        return
    sps = [False] + ([True] if tp > 1 and not model.n_experts and seq_len % tp == 0 else [])
    for sched in (schedules if pp > 1 else (None,)):
        if sched == "Interleaved1F1B" and pp * PP_INTERLEAVED_STAGES_PER_RANK > model.n_layers:
            pruned.append(_pruned(f"{where} schedule={sched}", f"pipeline: Interleaved1F1B's "
                                  f"{pp * PP_INTERLEAVED_STAGES_PER_RANK} stages are more than "
                                  f"n_layers={model.n_layers}"))
            continue
        for micro in divisors(local):
            m = local // micro
            if sched in ("1F1B", "Interleaved1F1B") and m < pp:
                continue  # fewer micro-batches than stages: the schedule refuses (a bigger micro batch is it)
            if sched == "Interleaved1F1B" and m % max(1, m // pp):
                continue
            for sp in sps:
                for ac in ac_modes:
                    yield Candidate(dp_rep, dp_shard, tp, pp, ep, sp, sched, m, ac, micro)


# --------------------------------------------------------------------------------------------------
# The analytic screen
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """What the screen needs besides the layout: the model, the sequence, the dtypes and the device."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    compute_bytes: int  # 2 under bf16 (mixed precision or bf16 parameters), else 4
    state_bytes: int    # master + grad + Adam moments per parameter
    grad_bytes: int     # an unsharded gradient element while accumulating
    ac_every: int
    zero: int
    profile: Any        # workbench.time.devices.DeviceProfile
    gpus_per_node: int
    dtype: str          # the matmuls' dtype key of the profile ("bf16", "fp32")


def setting_for(model: ModelConfig, train: Any, profile: Any, gpus_per_node: int, zero: int) -> Setting:
    bf16 = train.mixed_precision == "bf16" or train.dtype == "bfloat16"
    pbytes = 2 if train.dtype == "bfloat16" else 4
    state = 4 * pbytes if train.mixed_precision == "none" else 16
    return Setting(model, train.seq_len, train.global_batch, 2 if bf16 else 4, state, pbytes, train.ac_every,
                   zero, profile, gpus_per_node, "bf16" if bf16 else "fp32")


def _block(model: ModelConfig) -> tuple[float, float, float]:
    """Parameters of one block: (all, active per token, one expert-free part)."""
    h, kv, f = model.dim, model.n_kv_heads * model.head_dim, model.ffn_hidden
    attn = 2 * h * h + 2 * h * kv + 2 * h
    if model.n_experts:
        return attn + model.n_experts * 3 * h * f + h * model.n_experts, attn + model.top_k * 3 * h * f, attn
    return attn + 3 * h * f, attn + 3 * h * f, attn


def estimate(c: Candidate, st: Setting) -> Estimate:
    """The screen's peak bytes per rank (worst stage) and step time of candidate ``c``."""
    m, prof = st.model, st.profile
    h, f, V, s = m.dim, m.ffn_hidden, m.vocab_size, st.seq_len
    kv = m.n_kv_heads * m.head_dim
    Ls = -(-m.n_layers // c.pp)  # the fullest stage (stages may be uneven)
    blk, active, _ = _block(m)
    T = c.micro * s
    cb = st.compute_bytes
    tp_sp = c.tp if c.sp else 1
    k = top = m.top_k if m.n_experts else 1
    # ---- memory: stage 0 (embedding, most micro-batches in flight) and the last stage (head, logits)
    emb = V * h
    p_first = (Ls * blk + emb) / c.tp
    p_last = (Ls * blk + (emb if c.pp > 1 else 0) + emb + h) / c.tp
    split = (3 * h + 3 * kv + 4 * f * top) / c.tp  # q, k, v (+ RoPE's fp32 q, k), attention out, SwiGLU
    rep = 12 * h / tp_sp  # two RMSNorms (their fp32 upcasts), the residual stream, the block outputs
    full_layer = (split + rep) * cb * T
    keep_in = h / tp_sp * cb * T
    if c.ac == "none":
        per_layer = full_layer
    elif c.ac == "full":
        per_layer = keep_in
    elif c.ac == "op":
        per_layer = keep_in + (0.5 * split + 0.25 * rep) * cb * T
    else:  # selective: every k-th block whole
        whole = math.ceil(Ls / st.ac_every)
        per_layer = (whole * keep_in + (Ls - whole) * full_layer) / Ls
    transient = full_layer if c.ac != "none" else 0.0  # one block recomputed in backward
    v = PP_INTERLEAVED_STAGES_PER_RANK if c.schedule == "Interleaved1F1B" else 1
    if c.pp == 1:
        flight = 1.0
    elif c.schedule in ("GPipe", "GPipeLean"):
        flight = float(c.microbatches)
    elif c.schedule == "1F1B":
        flight = float(min(c.microbatches, c.pp))
    else:  # interleaved, stage 0: (v - 1) pp + 2 (pp - 1) + 1 chunk-micro-batches of Ls / v blocks
        flight = min(c.microbatches * v, (v - 1) * c.pp + 2 * (c.pp - 1) + 1) / v
    acts = per_layer * Ls * flight + transient
    accumulate = c.microbatches > 1 and c.dp_shard > 1 and st.zero >= 2

    def rank_bytes(p: float, logits: bool) -> float:
        state = p / c.dp_shard * st.state_bytes if st.zero >= 2 else p * (st.state_bytes - 8) + p / c.dp_shard * 8
        gathered = 2 * blk / c.tp * cb if c.dp_shard > 1 and st.zero >= 2 else 0.0
        grads = p * st.grad_bytes if accumulate else 0.0
        lg = T * V * (cb + 12) if logits else 0.0  # logits, their fp32 copy, log-softmax, its gradient
        return state + gathered + grads + lg

    peak = max(rank_bytes(p_first, c.pp == 1) + acts,
               rank_bytes(p_last, True) + acts * (1.0 / max(flight, 1.0) if c.pp > 1 else 1.0))
    peak = peak * ALLOCATOR_OVERHEAD
    # ---- time: one micro-batch slot of the slowest stage
    peak_flops = prof.flops_per_s(st.dtype) * prof.eff("matmul")
    F = (2 * Ls * active + 2 * Ls * s * h) / c.tp + 2 * h * V / c.tp  # causal attention: 2 s h per token
    Fl = (2 * Ls * active) / c.tp
    R = {"none": 0.0, "full": Fl, "op": Fl / 2, "selective": Fl / st.ac_every}[c.ac]
    ew_bytes = 3 * (split + rep) * cb * T * Ls
    ew = ew_bytes / (prof.elementwise_bytes_per_s * prof.eff("elementwise"))
    ops = 130 * Ls * (1.5 if c.ac != "none" else 1.0)
    t_comp = T * (3 * F + R) / peak_flops + ew + ops * prof.op_overhead_s
    gpn = st.gpus_per_node
    t_tp = 0.0
    if c.tp > 1:
        n_ar = 4 + (2 if c.ac == "full" else 0)
        t_tp = Ls * n_ar * prof.collective_time("all_reduce", T * h * cb, c.tp, True) + \
            2 * prof.collective_time("all_reduce", T * h * cb, c.tp, True)
    t_ep = 0.0
    if c.ep > 1:
        t_ep = 4 * Ls * prof.collective_time("all_to_all", T * k * h * cb, c.ep, c.ep * c.tp <= gpn)
    t_p2p = 0.0
    if c.pp > 1:
        stride = c.dp * c.tp
        t_p2p = 2 * prof.collective_time("send/recv", T * h * cb / tp_sp, 2, stride * 2 <= gpn)
    slot = t_comp + t_tp + t_ep + t_p2p
    slots = c.microbatches + (c.pp - 1) / v
    bubble = (c.pp - 1) / v * slot if c.pp > 1 else 0.0
    # FSDP2 / HSDP / DDP gradient and parameter traffic, overlapped with compute where it can be
    p_max = max(p_first, p_last)
    exposed = 0.0
    overlap = prof.kind == "cuda"
    if c.dp_shard > 1:
        intra = c.tp * c.dp_shard <= gpn
        gathers = (2 if st.zero == 3 else 1) * c.microbatches
        ag = gathers * prof.collective_time("all_gather", p_max * cb, c.dp_shard, intra)
        rs = prof.collective_time("reduce_scatter", p_max * 4, c.dp_shard, intra)
        one = prof.collective_time("all_gather", blk / c.tp * cb, c.dp_shard, intra)
        busy = c.microbatches * t_comp
        exposed += (max(0.0, ag + rs - busy) + one + rs / max(Ls, 1)) if overlap else ag + rs
    if c.dp_replicate > 1:
        intra = c.dp * c.tp <= gpn
        ar = prof.collective_time("all_reduce", p_max / c.dp_shard * 4, c.dp_replicate, intra)
        exposed += max(0.0, ar - 2 / 3 * t_comp) if overlap else ar
    p_rank = p_max / c.dp_shard
    t_opt = p_rank * 28 / (prof.elementwise_bytes_per_s * prof.eff("elementwise")) + 12 * prof.op_overhead_s
    step = slots * slot + exposed + t_opt
    # CPU ranks share the host's cores (processor sharing, as step_time.share_cores): every part of the step
    # slows by the ranks computing at once over the cores; a pipeline's stages compute for m of its slots
    share = 1.0
    cores = int(getattr(prof, "cores", 0) or 0)
    if prof.kind == "cpu" and cores > 0:
        busy = c.microbatches / slots if c.pp > 1 else 1.0
        share = max(1.0, min(c.dp * c.tp * c.pp, gpn) * busy / cores)
    return Estimate(peak, step * share, (c.microbatches * t_comp + t_opt) * share,
                    (c.microbatches * (t_tp + t_ep + t_p2p) + exposed) * share, bubble * share)
