"""The trainer's own step on fake tensors (workbench.prediction.fake): every layout, any world size, no memory.

Each test builds a job as one rank of its world builds it (fake process group, FakeTensorMode) and runs
real training steps of ``workbench.train.step``, then checks what the step did: the optimizer state it
made and its local shapes, the collectives it issued and when, the phases and microbatches the step
marked, the dtypes it computed in, what the pipeline schedule ran. A small dispatch mode entered where
the memory recorder is entered (``mode_factory``, on top of FakeTensorMode) watches every operator.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import DTensor

from workbench import compat
from workbench.config import PRESETS, JobConfig, ModelConfig, ParallelConfig, TrainConfig, validate
from workbench.prediction.fake import distinct_ranks, fake_rank, run_fake_steps, same_peak_job
from workbench.memory.marks import MARKS
from workbench.memory.probe import PeakMemoryProbe

TINY, MOE = PRESETS["tiny"], PRESETS["tiny-moe"]
TRAIN = TrainConfig(global_batch=8, seq_len=16)

pytestmark = pytest.mark.skipif(not compat.available("memory.fake_step"),
                                reason=f"torch {compat.TORCH_VERSION} lacks {compat.skip_reason('memory.fake_step')}")


def job(parallel: ParallelConfig, model: ModelConfig = TINY, **train) -> JobConfig:
    t = dataclasses.replace(TRAIN, **train)
    validate(model, parallel, t)
    return JobConfig(model=model, parallel=parallel, train=t)


class OpLog:
    """Every operator the fake step runs, with the step's marks and whether autograd was running."""

    def __init__(self):
        self.ops: list[tuple] = []
        base = compat.get("TorchDispatchMode")
        graph_task = torch._C._current_graph_task_id
        log = self.ops

        class Mode(base):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                first = out[0] if isinstance(out, (tuple, list)) and out else out
                dtype = first.dtype if isinstance(first, torch.Tensor) else None
                log.append((func.name(), MARKS.phase, MARKS.step, MARKS.microbatch, graph_task() != -1, dtype))
                return out

        self.mode = Mode()

    def factory(self):
        return self.mode

    def count(self, name: str, **where) -> int:
        keys = ("op", "phase", "step", "microbatch", "autograd", "dtype")
        return sum(all(rec[keys.index(k)] == v for k, v in where.items()) for rec in self.ops if rec[0] == name)

    def marks(self, phase: str) -> set[tuple[int, int]]:
        return {(s, m) for _, p, s, m, _, _ in self.ops if p == phase}


def run(j: JobConfig, rank: int = 0, steps: int = 2, **kw):
    log = OpLog()
    seen = {}

    def on_built(model, opt):
        seen["model"], seen["opt"] = model, opt
        seen["state_at_build"] = len(opt.state)

    info = run_fake_steps(j, rank, steps=steps, mode_factory=log.factory, on_built=on_built, **kw)
    return info, log, seen["model"], seen["opt"], seen["state_at_build"]


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def adam_states(opt) -> list[dict]:
    inner = getattr(opt, "optim", opt)  # ZeRO-1 keeps this rank's AdamW inside
    return [s for s in inner.state.values() if "exp_avg" in s]


# --------------------------------------------------------------------------------------------------
# No memory, big worlds
# --------------------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_7b_shaped_model_trains_without_allocating_it():
    # 4 llama-7b layers + embeddings: 1.1e9 parameters; one real step would hold ~18 GB (fp32 weights,
    # grads, AdamW). On fake tensors the process grows by what Python objects take.
    cfg = dataclasses.replace(PRESETS["llama-7b"], name="7b-4l", n_layers=4)
    j = job(ParallelConfig(dp_shard=1), cfg, global_batch=1, seq_len=256)
    before = _rss()
    info, log, model, opt, _ = run(j, steps=1)
    grown = _rss() - before
    assert grown < 300 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
    assert compat.is_fake(info.result.loss_sum) and compat.is_fake(next(model.parameters()))
    exp_avg = adam_states(opt)[0]["exp_avg"]
    assert compat.is_fake(exp_avg)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params > 1e9


def test_one_rank_of_a_1024_rank_70b_job():
    # llama-70b's widths on 4 layers (one per pipeline stage): rank 300 is pp 1, dp_shard 5, tp 4
    cfg = dataclasses.replace(PRESETS["llama-70b"], name="70b-4l", n_layers=4)
    p = ParallelConfig(dp_shard=32, tp=8, pp=4, sequence_parallel=True, microbatches=8)
    j = job(p, cfg, global_batch=256, seq_len=128, mixed_precision="bf16", activation_checkpointing="full")
    info, log, model, opt, _ = run(j, rank=300, steps=1, microbatches="peak")
    assert info.coords == {"pp": 1, "dp_replicate": 0, "dp_shard": 5, "tp": 4} and info.stages == [1]
    assert info.job.parallel.pp_microbatches == 4  # same_peak_job: pp under 1F1B on stages > 0 (pp + 1 on stage 0)
    assert same_peak_job(j, 0).parallel.pp_microbatches == 5 and same_peak_job(j).parallel.pp_microbatches == 5
    wq = next(p for n, p in model.named_parameters() if n.endswith("attention.wq.weight"))
    assert local(opt.state[wq]["exp_avg"]).shape == (8192 // 8 // 32, 8192)  # tp rows, then FSDP rows
    assert log.count("aten::mm", phase="forward", dtype=torch.bfloat16) > 0


def test_fake_rank_sees_its_coordinates_and_fakes_cuda():
    p = ParallelConfig(dp_shard=4, tp=2, pp=2)
    with fake_rank(16, 13, "cuda", p) as fr:
        assert tuple(fr.mesh.get_coordinate()) == (1, 0, 2, 1)
        t = torch.ones(3, device="cuda")
        assert t.device.type == "cuda" and compat.is_fake(t)
        torch.distributed.all_reduce(t)  # a collective on a fake tensor returns at once
    assert not torch.distributed.is_initialized()


# --------------------------------------------------------------------------------------------------
# Data parallelism: DDP, ZeRO-1, FSDP2 (zero 2 / 3), HSDP; gradient accumulation
# --------------------------------------------------------------------------------------------------


def test_single_process_step_marks_phases_and_makes_adam_state():
    info, log, model, opt, at_build = run(job(ParallelConfig(dp_shard=1)))
    assert at_build == 0  # on_built runs before the first step
    states = adam_states(opt)
    assert len(states) == len(list(model.parameters()))
    assert all(s["exp_avg"].shape == p.shape for s, p in zip(states, model.parameters()))
    assert log.marks("forward") == {(0, 0), (1, 0)} and log.marks("backward") == {(0, 0), (1, 0)}
    assert {s for s, _ in log.marks("optimizer")} == {0, 1}
    assert log.count("aten::embedding", phase="build") == 0 and log.marks("build")  # the mode saw the build
    assert log.count("aten::mm", phase="backward", autograd=True) > 0


def test_ddp_all_reduces_on_the_last_micro_batch_only():
    j = job(ParallelConfig(dp_replicate=2, dp_shard=1), micro_batch=1)  # 4 micro-batches per rank
    info, log, model, opt, _ = run(j)
    assert log.marks("forward") == {(s, m) for s in (0, 1) for m in range(4)}
    for step in (0, 1):
        assert log.count("c10d::allreduce_", step=step, microbatch=3) > 0
        assert all(log.count("c10d::allreduce_", step=step, microbatch=m) == 0 for m in range(3))


def test_zero1_each_dp_shard_rank_owns_other_optimizer_state():
    j = job(ParallelConfig(dp_shard=4, zero=1))
    owned = []
    for rank in (0, 1, 2, 3):
        _, log, model, opt, _ = run(j, rank, steps=1)
        n_params = len(list(model.parameters()))
        states = adam_states(opt)
        assert 0 < len(states) < n_params
        owned.append({tuple(s["exp_avg"].shape) for s in states})
        assert log.count("c10d::broadcast_", phase="optimizer") > 0  # ZeRO-1 broadcasts updated partitions
    assert len({frozenset(o) for o in owned}) > 1
    assert set(distinct_ranks(j).values()) == {0, 1, 2, 3}


def test_fsdp_state_is_sharded_and_reduce_scatter_once_per_step():
    gathers = {}
    for zero in (2, 3):
        j = job(ParallelConfig(dp_shard=4, zero=zero), micro_batch=1)  # 2 micro-batches per rank
        _, log, model, opt, _ = run(j)
        wq = dict(model.named_parameters())["layers.0.attention.wq.weight"]
        assert local(opt.state[wq]["exp_avg"]).shape == (TINY.dim // 4, TINY.dim)
        units = len(model.layers) + 1  # one FSDP unit per block, plus the root
        for step in (0, 1):  # gradients are reduce-scattered once per step, on the last micro-batch
            assert log.count("c10d::_reduce_scatter_base_", step=step) == units
            assert log.count("c10d::_reduce_scatter_base_", step=step, microbatch=0) == 0
        gathers[zero] = log.count("c10d::_allgather_base_", step=1)
    # zero=3 gathers the blocks again in backward; zero=2 keeps them gathered from forward to backward
    assert gathers[3] > gathers[2] >= 2 * units


def test_hsdp_shards_within_and_replicates_across():
    j = job(ParallelConfig(dp_replicate=2, dp_shard=2))
    _, log, model, opt, _ = run(j, rank=3, steps=1)
    w = dict(model.named_parameters())["layers.1.feed_forward.w1.weight"]
    assert [m for m in w.device_mesh.mesh_dim_names] == ["dp_replicate", "dp_shard"]
    assert local(opt.state[w]["exp_avg"]).shape == (TINY.ffn_hidden // 2, TINY.dim)
    assert log.count("c10d::allreduce_", phase="backward") > 0  # the replicate all-reduce of HSDP


# --------------------------------------------------------------------------------------------------
# Tensor and sequence parallelism
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_local_shapes(sp):
    j = job(ParallelConfig(dp_shard=2, tp=2, sequence_parallel=sp))
    _, log, model, opt, _ = run(j, rank=1, steps=1)
    params = dict(model.named_parameters())
    wo = params["layers.0.attention.wo.weight"]
    assert local(opt.state[wo]["exp_avg"]).shape == (TINY.dim // 2, TINY.dim // 2)  # tp on dim 1, fsdp on 0
    if sp:  # sequence parallel: the norms' activations are split over the sequence, gathered for attention
        assert log.count("_c10d_functional::all_gather_into_tensor", phase="forward") > 0
        assert log.count("_c10d_functional::reduce_scatter_tensor", phase="forward") > 0


# --------------------------------------------------------------------------------------------------
# Pipeline parallelism: every schedule
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "GPipeLean"])
def test_pipeline_schedule_runs_every_action_on_every_stage(schedule):
    if schedule == "GPipeLean" and not compat.available("pipeline.lean_schedule"):
        pytest.skip(compat.skip_reason("pipeline.lean_schedule"))
    p = ParallelConfig(dp_shard=2, pp=2, pp_schedule=schedule, microbatches=4)
    j = job(p)
    reps = sorted(set(distinct_ranks(j).values()))
    assert reps == [0, 2]  # one rank per pipeline stage
    v = p.pp_stages_per_rank
    for rank in reps:
        info, log, model, opt, _ = run(j, rank)
        assert len(info.stages) == v
        assert Counter(a["phase"] for a in info.actions) == {"F": 4 * v, "B": 4 * v}
        assert {(a["stage"], a["microbatch"]) for a in info.actions if a["phase"] == "B"} == \
            {(s, m) for s in info.stages for m in range(4)}
        assert log.marks("backward") >= {(1, m) for m in range(4)}  # the stages mark their microbatches
        assert log.count("c10d::send", step=1) > 0 and log.count("c10d::recv_", step=1) > 0
        last = info.stages[-1] == p.pp * v - 1
        assert compat.is_fake(info.result.loss_sum)
        assert last == any(n.endswith("output.weight") for n, _ in model.named_parameters())
        assert len(adam_states(opt)) == len(list(model.parameters()))


def test_pipeline_with_tp_sp_and_bf16():
    p = ParallelConfig(dp_shard=2, tp=2, pp=2, sequence_parallel=True, pp_schedule="1F1B")
    for train in (dict(mixed_precision="bf16"), dict(dtype="bfloat16")):
        j = job(p, **train)
        info, log, model, opt, _ = run(j, rank=5, steps=1)  # pp=1, dp_shard=0, tp=1: the last stage
        assert info.stages == [1] and Counter(a["phase"] for a in info.actions) == {"F": 2, "B": 2}
        assert log.count("aten::mm", phase="forward", dtype=torch.bfloat16) > 0


# --------------------------------------------------------------------------------------------------
# Expert parallelism, activation checkpointing, precision
# --------------------------------------------------------------------------------------------------


def test_expert_parallel_all_to_all_with_balanced_routing():
    j = job(ParallelConfig(dp_shard=4, ep=2), MOE, micro_batch=1)
    _, log, model, opt, _ = run(j, rank=1, steps=1)
    w1 = dict(model.named_parameters())["layers.0.feed_forward.experts.w1"]
    # 2 of the 4 experts on this ep rank, FSDP2-sharded by expert over the 2 ranks that hold the same ones
    assert local(opt.state[w1]["exp_avg"]).shape == (1, MOE.ffn_hidden, MOE.dim)
    assert log.count("c10d::alltoall_base_", phase="forward") > 0
    assert log.count("c10d::alltoall_base_", phase="backward") > 0
    assert set(distinct_ranks(j).values()) == {0}


def test_moe_without_ep():
    _, log, model, opt, _ = run(job(ParallelConfig(dp_shard=1), MOE), steps=1)
    assert log.count("aten::mm", phase="backward") > 0 and adam_states(opt)


@pytest.mark.parametrize("layout", [ParallelConfig(dp_shard=2, tp=2), ParallelConfig(dp_shard=1, pp=2)])
def test_activation_checkpointing_recomputes_in_backward(layout):
    mm = {}
    for ac in ("none", "selective", "full"):
        j = job(layout, activation_checkpointing=ac)
        rank = layout.world_size - 1
        _, log, *_ = run(j, rank=rank, steps=1)
        mm[ac] = log.count("aten::mm", phase="backward")
    assert mm["none"] < mm["selective"] < mm["full"]


@pytest.mark.parametrize("layout", [ParallelConfig(dp_shard=1), ParallelConfig(dp_shard=2),
                                    ParallelConfig(dp_shard=2, zero=0), ParallelConfig(dp_shard=1, tp=2)])
def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_state(layout):
    _, log, model, opt, _ = run(job(layout, mixed_precision="bf16"), steps=1)
    assert log.count("aten::mm", phase="forward", dtype=torch.bfloat16) > 0
    assert log.count("aten::mm", phase="forward", dtype=torch.float32) == 0
    assert all(s["exp_avg"].dtype == torch.float32 for s in adam_states(opt))


def test_bfloat16_training_keeps_bf16_state():
    _, log, model, opt, _ = run(job(ParallelConfig(dp_shard=2), dtype="bfloat16"), steps=1)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in adam_states(opt))


# --------------------------------------------------------------------------------------------------
# Distinct ranks
# --------------------------------------------------------------------------------------------------


def test_distinct_ranks_rules():
    big = ParallelConfig(dp_shard=32, tp=8, pp=4)
    m = distinct_ranks(JobConfig(PRESETS["llama-70b"], big, TRAIN))
    assert len(m) == 1024 and sorted(set(m.values())) == [0, 256, 512, 768]
    assert m[1023] == 768 and m[300] == 256
    # tp, sp and replicas never split ranks
    assert set(distinct_ranks(ParallelConfig(dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=True)).values()) == {0}
    # ZeRO-1 gives each dp_shard rank its own optimizer partition
    assert sorted(set(distinct_ranks(ParallelConfig(dp_shard=4, zero=1)).values())) == [0, 1, 2, 3]
    # FSDP2 with a dimension the shard degree does not divide: uneven shards (tiny: dim 128, kv 64, ffn 384)
    assert set(distinct_ranks(JobConfig(TINY, ParallelConfig(dp_shard=3), TRAIN)).values()) == {0, 1, 2}
    assert set(distinct_ranks(JobConfig(TINY, ParallelConfig(dp_shard=4), TRAIN)).values()) == {0}


def test_uneven_fsdp_ranks_really_differ():
    j = job(ParallelConfig(dp_shard=3), global_batch=3)
    shapes = []
    for rank in (0, 2):
        *_, opt, _ = run(j, rank, steps=1)
        shapes.append(sorted(tuple(local(s["exp_avg"]).shape) for s in adam_states(opt)))
    assert shapes[0] != shapes[1]


# --------------------------------------------------------------------------------------------------
# Shortcuts that keep the peak: fewer micro-batches, a warm optimizer
# --------------------------------------------------------------------------------------------------


def _peaks(j: JobConfig, rank: int, **kw) -> list[int]:
    """Peak live bytes after each step (PeakMemoryProbe on top of FakeTensorMode; the layouts below do
    not resize storages in place, which the probe would not see)."""
    probe, peaks = PeakMemoryProbe("cpu"), []
    run_fake_steps(j, rank, mode_factory=lambda: probe, on_step=lambda s, r: peaks.append(probe.peak_bytes), **kw)
    return peaks


@pytest.mark.parametrize("layout, train", [
    (ParallelConfig(dp_shard=1, pp=2, pp_schedule="1F1B", microbatches=6), dict(global_batch=6)),
    (ParallelConfig(dp_shard=1, pp=2, pp_schedule="Interleaved1F1B", microbatches=8), dict(global_batch=8)),
    (ParallelConfig(dp_replicate=2, dp_shard=1), dict(global_batch=8, micro_batch=1)),
])
def test_fewer_microbatches_reach_the_same_peak(layout, train):
    j = job(layout, **train)
    short = same_peak_job(j)
    m, m_short = (j.parallel.pp_microbatches, short.parallel.pp_microbatches) if layout.pp > 1 else \
        (j.train.grad_accum(layout.dp), short.train.grad_accum(layout.dp))
    assert m_short < m
    per_mb = j.train.global_batch // layout.dp // m
    for rank in sorted(set(distinct_ranks(j).values())):
        if layout.pp > 1:  # 1F1B: one microbatch fewer on stages > 0
            m_short = same_peak_job(j, rank).parallel.pp_microbatches
        dropped_tokens = (m - m_short) * per_mb * (j.train.seq_len + 1) * 8 * 2  # ids of the dropped microbatches
        full, fast = _peaks(j, rank, steps=2), _peaks(j, rank, steps=2, microbatches="peak")
        assert all(0 <= a - b <= dropped_tokens for a, b in zip(full, fast)), (rank, full, fast)


def test_each_1f1b_stage_runs_the_fewest_microbatches_that_reach_its_exact_peak():
    """Issue 32: 1F1B stage s holds pp - s microbatches in flight, and reaches its peak at its second backward
    (the first with gradients made) once a forward came between, which takes pp - s + 1 microbatches: pp + 1
    on stage 0, and pp (torch's 1F1B runs no fewer) on the others. Each stage's peak, and what it holds by
    category, is the exact prediction's (every microbatch, two steps, no warm start), up to the token ids of
    the dropped microbatches (data, and what the embedding and the loss save of them) and the 64 bytes the
    warm start may differ by (AdamW's step counters)."""
    from workbench.memory import predict

    cfg = dataclasses.replace(TINY, n_layers=8)
    p = ParallelConfig(dp_shard=1, pp=4, pp_schedule="1F1B", microbatches=8)
    j = job(p, cfg, global_batch=8, seq_len=32, steps=2)
    keep = [same_peak_job(j, r).parallel.pp_microbatches for r in range(4)]
    assert keep == [5, 4, 4, 4]
    fast = predict(j, workers=1, progress=False)
    exact = predict(j, workers=1, progress=False, exact=True)
    per_mb = j.train.global_batch // p.dp // p.pp_microbatches
    for r in range(4):
        a, b = exact.peak(r), fast.peak(r)
        dropped = (p.pp_microbatches - keep[r]) * per_mb * (j.train.seq_len + 1) * 8 * 2
        assert 0 <= a.bytes - b.bytes <= dropped + 64, (r, a.bytes, b.bytes)
        assert a.phase == b.phase == "backward"
        # stages before the last peak at their second backward, the last at its last (the gradients' sync)
        assert (a.microbatch, b.microbatch) == ((1, 1) if r < 3 else (p.pp_microbatches - 1, keep[r] - 1)), r
        for c in ("parameter", "gradient", "optimizer", "communication", "checkpoint"):
            assert a.by_category.get(c, 0) == b.by_category.get(c, 0), (r, c)
        for c in ("activation", "other", "temporary"):
            assert 0 <= a.by_category.get(c, 0) - b.by_category.get(c, 0) <= dropped + 64, (r, c)


def test_warm_start_reaches_the_second_steps_peak_in_one_step():
    j = job(ParallelConfig(dp_shard=1, pp=2, pp_schedule="1F1B"))
    for rank in (0, 1):
        two = _peaks(j, rank, steps=2)
        one = _peaks(j, rank, steps=1, warm_start=True)
        assert two[0] < two[1] and abs(one[0] - two[1]) <= 64  # AdamW's step counters aside


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_steps_need_cuda():
    with pytest.raises(ValueError, match="device='cuda'.*needs a torch built with CUDA"):
        run_fake_steps(job(ParallelConfig(dp_shard=1)), 0, device="cuda")
