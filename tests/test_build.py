"""One build path: ranks build only their own shards, initialised exactly like the one-process model."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import workbench
from workbench.compat import compute_local_shape_and_global_offset
from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig
from workbench.memory.probe import PeakMemoryProbe
from workbench.mesh import build_mesh
from workbench.models import build_model
from workbench.parallel.build import build_stages, param_name
from workbench.plan.simulate import fake_world
from workbench.train.launcher import memory_shortfall, training_state_bytes

LAYOUTS = [
    ("tiny", {"dp_shard": 2}),
    ("tiny", {"tp": 2, "sequence_parallel": True}),
    ("tiny", {"dp_shard": 2, "tp": 2}),
    ("tiny", {"pp": 2, "dp_shard": 2}),
    ("tiny-moe", {"dp_shard": 4, "ep": 2}),
]


def _block(p: torch.Tensor, whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's local values of ``p``, the same block cut from the one-process ``whole``)."""
    if not isinstance(p, DTensor):
        return p.detach(), whole.detach()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return p.to_local().detach(), whole.detach()[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


@pytest.mark.parametrize("model,layout", LAYOUTS)
def test_every_rank_builds_only_its_shards_with_the_one_process_values(model, layout):
    cfg = PRESETS[model]
    parallel = ParallelConfig(**{"dp_shard": 1, **layout})
    train = TrainConfig(seed=11)
    reference = dict(build_model(cfg, seed=11).named_parameters())
    whole_bytes = sum(p.numel() * 4 for p in reference.values())
    seen = set()
    for rank in range(parallel.world_size):  # every rank's build, one at a time, under a fake group
        with fake_world(parallel.world_size, rank):
            probe = PeakMemoryProbe("cpu")
            with probe:
                stages = build_stages(cfg, parallel, train, build_mesh(parallel, "cpu"), "cpu")
            # Its own shards plus one whole parameter at a time: well under one model copy.
            assert probe.peak() < 0.7 * whole_bytes, (rank, probe.peak(), whole_bytes)
            for module in stages.modules:
                for name, p in module.named_parameters():
                    assert p.device.type == "cpu"
                    local, expected = _block(p, reference[param_name(name)])
                    assert torch.equal(local, expected), (rank, name)
                    seen.add(param_name(name))
    assert seen == set(reference)  # together the ranks hold every parameter


def test_plan_build_allocates_nothing_and_factories_cannot_be_materialized():
    parallel = ParallelConfig(dp_shard=2, tp=2)
    with fake_world(4, 3):
        stages = build_stages(PRESETS["llama-70b"], parallel, TrainConfig(), build_mesh(parallel, "cpu"))
        assert all(p.is_meta for p in stages.model.parameters())
    with pytest.raises(ValueError, match="model factory can only be planned"):
        build_stages(lambda: torch.nn.Linear(2, 2), ParallelConfig(dp_shard=1), TrainConfig(), None, "cpu")


def test_memory_floor_comes_from_the_plan():
    job = JobConfig(model=PRESETS["small"], parallel=ParallelConfig(dp_shard=2, tp=2), train=TrainConfig())
    plan = workbench.plan("small", job.parallel, job.train)
    need = training_state_bytes(job)
    assert need == int(plan.rank_bytes()["total"].sum())
    assert memory_shortfall(job, available=int(need / 0.9) + 1) is None
    problem = memory_shortfall(job, available=need)
    assert problem.startswith(f"small ({PRESETS['small'].n_params / 1e9:.2f}B params) needs at least "
                              f"{need / 2**30:.1f} GiB") and problem.endswith("choose a smaller model (e.g. tiny or small)")


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_a_real_two_rank_job_never_builds_the_whole_model(tmp_path):
    cfg = PRESETS["small"]
    run = workbench.launch("small", nproc=2, dp_shard=2, steps=1, global_batch=2, seq_len=16, out=tmp_path).wait(170)
    starts = [e for e in run._all_events() if e["type"] == "start"]
    assert len(starts) == 2
    for e in starts:
        # fp32 weights of the whole model would be n_params * 4 bytes; each rank built half plus one tensor.
        assert e["build_peak_bytes"] < 0.7 * cfg.n_params * 4, e
        assert e["local_params"] < 0.6 * cfg.n_params
