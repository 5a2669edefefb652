"""workbench.plan: simulated sharding plans, checked against DTensor's own arithmetic and real runs.

* every rank's local shape/offset the plan derives (numpy over all ranks) equals DTensor's
  ``_compute_local_shape_and_global_offset`` for that rank, including FSDP2's _StridedShard under tp
  and expert-parallel sub-dimensions, on uneven sizes;
* a real gloo job (torchrun, 2 and 4 processes) reports what each rank holds after one optimizer
  step: parameters, gradients and AdamW states equal the plan's ``local()`` for that rank;
* the 1024-rank llama-70b plan is complete, conserves bytes, and is fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import workbench
from workbench.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from workbench.plan import ShardingPlan

LIVE_TIMEOUT_S = 240  # a hung torchrun job fails here


# --------------------------------------------------------------------------------------------------
# the API surface
# --------------------------------------------------------------------------------------------------


def test_plan_is_callable_package_and_exports_types():
    from workbench.plan import TensorPlan

    assert callable(workbench.plan) and workbench.plan.TensorPlan is TensorPlan
    p = workbench.plan("tiny", ParallelConfig(dp_shard=2))
    assert isinstance(p, ShardingPlan)
    assert p.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert p.coords(1) == (0, 0, 1, 0) and p.rank_of((0, 0, 1, 0)) == 1
    frame = p.to_frame()
    assert set(frame["kind"]) == {"parameter", "gradient", "optimizer"}
    assert {"name", "kind", "dtype", "global_shape", "numel", "bytes", "placements", "pp", "dp_replicate",
            "dp_shard", "tp", "stage", "local_shape_rank0"} <= set(frame.columns)
    assert "tiny" in p._repr_html_()


def test_llama70b_fsdp_tp_1024_ranks_complete_conserved_and_fast():
    t0 = time.perf_counter()
    p = workbench.plan("llama-70b", ParallelConfig(dp_shard=128, tp=8))
    rb = p.rank_bytes()
    doc = json.loads(p.to_json())
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, f"planning 1024 ranks took {elapsed:.1f}s"  # ~1.5 s on an idle 2-core CPU

    cfg = PRESETS["llama-70b"]
    assert list(rb.index) == list(range(1024)) and (rb["total"] > 0).all()
    assert len(doc["rank_bytes"]["total"]) == 1024
    # Every weight is split over all 1024 ranks, except norm weights: tp leaves them whole, so each of
    # the 8 tp ranks of a dp_shard slice holds a copy of its 1/128.
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    assert rb["parameter"].sum() == 4 * (cfg.n_params + (8 - 1) * norms)
    assert rb["optimizer"].sum() == 2 * rb["parameter"].sum()
    assert rb["master"].sum() == 0
    assert rb["total"].max() / rb["total"].min() < 1.01  # balanced: ceil-chunking costs < 1%
    comm = p.comm()
    fsdp = comm[(comm.collective == "all_gather") & (comm.mesh_dim == "dp_shard")]
    assert set(fsdp.phase) == {"forward", "backward"}  # zero=3 gathers again in backward
    assert {"reduce_scatter", "all_reduce"} <= set(comm.collective)


def test_local_shape_rule_is_torch_even_chunking():
    cfg = ModelConfig("odd", dim=96, n_layers=1, n_heads=6, n_kv_heads=2, ffn_hidden=200, vocab_size=250)
    p = workbench.plan(cfg, ParallelConfig(dp_shard=3, tp=2))
    # vocab 250 -> tp halves of 125 -> dp_shard chunks of ceil(125/3) = 42: 42, 42, 41
    lengths = [p.local("tok_embeddings.weight", p.rank_of((0, 0, s, 1)))[0][0] for s in range(3)]
    offsets = [p.local("tok_embeddings.weight", p.rank_of((0, 0, s, 1)))[1][0] for s in range(3)]
    assert lengths == [42, 42, 41] and offsets == [125, 167, 209]


# --------------------------------------------------------------------------------------------------
# against DTensor's arithmetic, every rank
# --------------------------------------------------------------------------------------------------


def _dtensor_blocks(model, parallel):
    """{name: [(local_shape, offsets) per rank]} from DTensor's own rule, for a parallelized meta model.

    Independent of the plan's arithmetic: each rank's model is parallelized in a fake world seen from
    that rank, and DTensor says what that rank holds (``compute_local_shape_and_global_offset`` on the
    parameter's own mesh and placements, what a real rank would compute), checked against the local
    tensor DTensor actually made."""
    from torch.distributed.tensor import DTensor

    from workbench import compat
    from workbench.compat import compute_local_shape_and_global_offset
    from workbench.mesh import build_mesh
    from workbench.models import build_model
    from workbench.parallel.apply import parallelize
    from workbench.plan.simulate import fake_world

    out: dict[str, list] = {}
    for r in range(parallel.world_size):
        with fake_world(parallel.world_size, r):
            mesh = build_mesh(parallel)
            m = parallelize(build_model(model, seed=None, device="meta"), parallel, mesh, TrainConfig())
            for name, p in m.named_parameters():
                assert isinstance(p, DTensor)
                shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                assert tuple(compat.local_tensor(p).shape) == tuple(shape), (name, r)
                out.setdefault(name, []).append((tuple(shape), tuple(off)))
    return out


ODD = ModelConfig("odd", dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=200, vocab_size=250)
ODD_MOE = ModelConfig("odd-moe", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=40, vocab_size=250,
                      n_experts=6, top_k=2)


@pytest.mark.parametrize("model,layout", [
    (ODD, dict(dp_shard=3, tp=2)),                        # _StridedShard on uneven rows
    (ODD, dict(dp_replicate=2, dp_shard=2, tp=2)),        # HSDP x TP
    (ODD_MOE, dict(dp_shard=6, ep=3, tp=2)),              # experts: ep and dp_shard_mod_ep inside dp_shard
    (PRESETS["tiny-moe"], dict(dp_replicate=2, dp_shard=4, ep=2)),
    (PRESETS["tiny-moe"], dict(dp_shard=8, ep=4)),         # 1 expert per ep rank over 2: one holds it
], ids=["fsdp3xtp2", "hsdpxtp", "ep3-in-dp6xtp2", "hsdp-ep2", "ep4-one-expert"])
def test_plan_local_equals_dtensor_on_every_rank(model, layout):
    parallel = ParallelConfig(**layout)
    p = workbench.plan(model, parallel)
    truth = _dtensor_blocks(model, parallel)
    assert truth
    for name, blocks in truth.items():
        for kind in ("parameter", "gradient", "optimizer"):
            key = name + ".exp_avg" if kind == "optimizer" else name
            mine = [p.local(key, r, kind) for r in range(parallel.world_size)]
            assert mine == blocks, f"{kind} {key}"


@pytest.mark.parametrize("model,layout,train", [
    ("small", dict(dp_shard=4, tp=2), {}),                                    # FSDP2 x TP: one block for 8
    ("small", dict(dp_shard=1, tp=4), {"dtype": "bfloat16"}),                 # TP alone: gradients probed
    ("tiny", dict(dp_shard=2, tp=2, sequence_parallel=True), {"activation_checkpointing": "full"}),
    ("small", dict(dp_shard=2, tp=2), {"activation_checkpointing": "selective", "ac_every": 3}),
    ("llama-7b", dict(pp=3, dp_shard=2), {"activation_checkpointing": "selective", "ac_every": 3}),  # 11+11+10
    ("small", dict(pp=2, dp_shard=2, tp=2, pp_schedule="Interleaved1F1B", microbatches=4), {}),
    ("small", dict(dp_replicate=2, dp_shard=2, tp=2), {"mixed_precision": "bf16"}),   # HSDP x TP
    ("small", dict(dp_replicate=2, dp_shard=1), {}),                           # DDP
    ("tiny-moe", dict(dp_shard=4, ep=2, tp=2), {}),                            # experts: their own units
    ("tiny-moe", dict(dp_shard=8, ep=4, zero=2), {"mixed_precision": "bf16"}),
], ids=["fsdpxtp", "tp-only-bf16", "sp-full-ac", "selective-ac", "pp3-uneven-selective", "interleaved", "hsdp-bf16",
        "ddp", "ep2xtp2", "ep4-zero2"])
def test_reused_blocks_give_the_plan_of_the_whole_build(model, layout, train):
    # A plan builds one block per distinct stage position (workbench.plan.reuse): every number it gives
    # (tensors, placements, splits, rank_bytes, comm rows) is the one of building every block.
    from workbench.plan import plan_configs
    from workbench.plan.reuse import representatives
    from workbench.plan.simulate import plan

    parallel, tcfg = plan_configs(**layout, **train)
    reps = representatives(PRESETS[model], parallel, tcfg)
    assert reps is not None and reps.model.n_layers < PRESETS[model].n_layers  # the reduced build runs
    whole = plan(model, parallel, tcfg, reuse_blocks=False)
    reused = plan(model, parallel, tcfg)
    assert json.loads(reused.to_json()) == json.loads(whole.to_json())
    assert repr(reused) == repr(whole)


def test_zero1_and_model_factories_build_every_block():
    # ZeRO-1 hands whole tensors to ranks by their sizes, and a factory has no config to shrink.
    from workbench.models.llama import Transformer
    from workbench.plan import plan_configs
    from workbench.plan.reuse import representatives

    parallel, tcfg = plan_configs(dp_shard=4, zero=1)
    assert representatives(PRESETS["small"], parallel, tcfg) is None
    assert representatives(None, *plan_configs(dp_shard=4)) is None
    p = workbench.plan(lambda: Transformer(PRESETS["tiny"]), ParallelConfig(dp_shard=2, tp=2))
    assert p.n_params == PRESETS["tiny"].n_params


# --------------------------------------------------------------------------------------------------
# pipeline, experts, ZeRO-1, mixed precision
# --------------------------------------------------------------------------------------------------


def test_pipeline_stages_hold_disjoint_layers():
    p = workbench.plan("tiny", ParallelConfig(dp_shard=2, pp=2))
    params = p.to_frame().query("kind == 'parameter'")
    by_stage = {s: set(g["name"]) for s, g in params.groupby("stage")}
    assert set(by_stage) == {0, 1} and not by_stage[0] & by_stage[1]
    layers = {s: sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
              for s, names in by_stage.items()}
    assert layers == {0: [0, 1, 2], 1: [3, 4]}  # split_layers: 5 over 2, earlier stage larger
    assert "tok_embeddings.weight" in by_stage[0] and "output.weight" in by_stage[1]
    # ranks 0,1 are pp=0; ranks 2,3 are pp=1: each holds only its stage
    assert p.local("output.weight", 0) is None and p.local("output.weight", 2) == ((128, 128), (0, 0))
    blocks = p.blocks("layers.4.attention.wq.weight")
    assert list(blocks["state"]) == ["absent", "absent", "sharded", "sharded"]
    comm = p.comm()
    sends = comm[comm.collective == "send/recv"]
    assert set(sends.stage) == {0, 1}  # stage 0 sends activations forward, stage 1 gradients back
    assert set(sends[sends.stage == 0].phase) == {"forward"} and set(sends[sends.stage == 1].phase) == {"backward"}


def test_expert_parallel_plan_for_tiny_moe():
    p = workbench.plan("tiny-moe", ParallelConfig(dp_shard=4, ep=2))
    # 4 experts, ep=2 owns 2 each (ep index = dp_shard % 2), FSDP splits those over dp_shard // 2
    firsts = [p.local("layers.0.feed_forward.experts.w1", r)[1][0] for r in range(4)]
    assert firsts == [0, 2, 1, 3]
    assert p.tensor("layers.0.feed_forward.experts.w1").placements[2] == "_S(0)"
    comm = p.comm()
    a2a = comm[comm.collective == "all_to_all"]
    assert set(a2a.mesh_dim) == {"ep"} and a2a.bytes_per_rank.sum() > 0
    assert "dp_shard_mod_ep" in set(comm.mesh_dim)  # expert weights gather over the ranks sharing them


def test_zero1_optimizer_state_is_owned_whole_by_one_rank():
    p = workbench.plan("tiny", ParallelConfig(dp_shard=4, zero=1))
    cfg = PRESETS["tiny"]
    rb = p.rank_bytes()
    assert rb["optimizer"].sum() == 2 * 4 * cfg.n_params  # each state once, on its owner
    assert (rb["parameter"] == 4 * cfg.n_params).all()  # DDP keeps whole weights everywhere
    holders = p.blocks("layers.0.attention.wq.weight.exp_avg", "optimizer")
    assert (holders["state"] == "replicated").sum() == 1 and (holders["state"] == "absent").sum() == 3


def test_bf16_mixed_precision_master_weights():
    p = workbench.plan("tiny", ParallelConfig(dp_shard=2), {"global_batch": 4, "seq_len": 32,
                                                           "mixed_precision": "bf16"})
    rb = p.rank_bytes().iloc[0]
    assert rb["parameter"] * 2 == rb["master"] == rb["gradient"]  # bf16 copy, fp32 master and grads
    assert rb["optimizer"] == 2 * rb["master"]
    assert p.tensor("output.weight.master", "master").dtype == "float32"


def test_model_factory_and_invalid_layouts():
    from workbench.models.llama import Transformer

    p = workbench.plan(lambda: Transformer(PRESETS["tiny"]), ParallelConfig(tp=2))
    assert p.n_params == PRESETS["tiny"].n_params
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=8"):
        workbench.plan("tiny", ParallelConfig(tp=3))


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def test_cli_json_round_trip_and_errors(capsys):
    from workbench.cli import main

    assert main(["plan", "tiny", "--dp-shard", "2", "--tp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "ok" and len(doc["rank_bytes"]["total"]) == 4
    back = ShardingPlan.from_json(json.dumps(doc))
    direct = workbench.plan("tiny", ParallelConfig(dp_shard=2, tp=2))
    assert back.rank_bytes().equals(direct.rank_bytes())
    assert back.local("layers.0.attention.wq.weight", 3) == direct.local("layers.0.attention.wq.weight", 3)
    assert back.summary() == direct.summary()

    assert main(["plan", "tiny", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: tp=3 does not divide n_heads=8; choose tp in {1, 2, 4}"]
    assert main(["plan", "tiny", "--tp", "3", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["status"] == "error"


def test_cli_text_summary_reads_hf_config(tmp_path, capsys):
    from workbench.cli import main

    hf = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert main(["plan", str(path), "--dp-shard", "4", "--tp", "2", "--mixed-precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "8 ranks" in out and "reduce_scatter" in out and "master" in out
    params = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256) + 2 * 1000 * 256 + 256
    assert f"{params:,} parameters" in out


def test_cli_memory_json_gives_the_predicted_peak_of_every_rank_and_the_fit():
    from workbench import memory
    from workbench.config import JobConfig
    from workbench.plan import plan_configs

    cmd = [sys.executable, "-m", "workbench.cli", "plan", "tiny", "--dp-shard", "2", "--memory", "cpu", "--budget",
           "64MiB", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "ok" and doc["memory_device"] == "cpu"

    # The same job the CLI builds (plan_configs from the flags), predicted here.
    parallel, train = plan_configs(dp_shard=2)
    job = JobConfig(model=PRESETS["tiny"], parallel=parallel, train=train)
    expected = memory.peak_per_rank(memory.predict(job, device="cpu", progress=False))
    assert {int(r): b for r, b in doc["predicted_peak_bytes"].items()} == {int(r): int(b) for r, b in expected.items()}
    assert doc["summary"]["max_predicted_peak_bytes"] == int(expected.max())

    fit = doc["fit"]
    assert fit["device"] == "cpu" and fit["budget_bytes"] == 64 * 2**20 and fit["peak_bytes"] == int(expected.max())
    assert fit["fits"] is True and fit["fits"] == (fit["peak_bytes"] <= fit["budget_bytes"])
    fitting = [int(m) for m, peak in fit["tried"].items() if peak <= fit["budget_bytes"]]
    assert fit["micro_batch"] == max(fitting) and fit["peak_at_micro_batch"] == fit["tried"][str(fit["micro_batch"])]
    assert fit["text"].startswith("fits in 64.00 MiB")


def test_cli_memory_text_and_errors(capsys):
    from workbench.cli import main

    p = workbench.plan("tiny", ParallelConfig(dp_shard=2))
    assert "predicted_peak_bytes" not in p.to_dict() and "memory_device" not in p.summary()  # exports never predict

    assert main(["plan", "tiny", "--tp", "2", "--memory", "cpu"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("predicted peak memory per rank (cpu"):].splitlines()
    # tp=2 ranks run alike: one line, one value, both ranks.
    assert len(section) == 2 and section[1].split("ranks ")[1].startswith("0-1  at ")
    assert "activation" in section[1]

    assert main(["plan", "tiny", "--tp", "2", "--memory", "cpu", "--budget", "80 gigs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: memory budget '80 gigs': write bytes or a size like 80GiB, 24GB, 512MiB"]
    # --memory alone targets cuda (predicted on any machine).
    assert main(["plan", "tiny", "--tp", "2", "--memory", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["memory_device"] == "cuda" and set(doc["predicted_peak_bytes"]) == {"0", "1"}


def test_plan_inside_an_initialised_process_group_uses_a_subprocess(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        p = workbench.plan("tiny", ParallelConfig(dp_shard=2))
        assert p.world_size == 2 and p.local("output.weight", 1) == ((128, 128), (128, 0))
        with pytest.raises(RuntimeError, match="model factory"):
            workbench.plan(lambda: torch.nn.Linear(2, 2), ParallelConfig(dp_shard=2))
        assert dist.get_world_size() == 1  # the real group is untouched
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# plan vs real run
# --------------------------------------------------------------------------------------------------


def _live(tmp_path, nproc: int, layouts: list[str]) -> list[dict]:
    out = tmp_path / "live"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           "-m", "workbench.plan.live", "--out", str(out)]
    for layout in layouts:
        cmd += ["--layout", layout]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIVE_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / str(i) / f"rank{r}.json").read_text()) for i in range(len(layouts)) for r in range(nproc)]


def _assert_live_matches_plan(docs: list[dict]) -> None:
    from workbench.plan.live import check

    plans = {}
    for doc in docs:
        key = (doc["model"], json.dumps(doc["parallel"]), json.dumps(doc["train"]))
        if key not in plans:
            plans[key] = workbench.plan(doc["model"], ParallelConfig.from_dict(doc["parallel"]),
                                        TrainConfig.from_dict(doc["train"]))
        kinds = {row["kind"] for row in doc["rows"]}
        assert kinds == {"parameter", "gradient", "optimizer"}, kinds  # after one step all three exist
        assert check(plans[key], doc["rows"], doc["rank"]) == []


@pytest.mark.multirank
@pytest.mark.timeout(LIVE_TIMEOUT_S + 30)
def test_plan_matches_real_two_rank_runs(tmp_path):
    docs = _live(tmp_path, 2, ["tiny:dp_shard=2", "tiny:tp=2", "tiny:tp=2,sequence_parallel=true",
                               "tiny:dp_shard=2,zero=1", "tiny:dp_shard=2,mixed_precision=bf16",
                               "tiny-moe:dp_shard=2,ep=2"])
    _assert_live_matches_plan(docs)


@pytest.mark.multirank
@pytest.mark.timeout(LIVE_TIMEOUT_S + 30)
def test_plan_matches_real_four_rank_runs(tmp_path):
    docs = _live(tmp_path, 4, ["tiny:dp_shard=2,tp=2", "tiny-moe:dp_shard=2,ep=2,tp=2"])
    _assert_live_matches_plan(docs)
    strided = [r for d in docs for r in d["rows"] if r["name"] == "layers.0.attention.wq.weight"]
    assert len({tuple(r["offsets"]) for r in strided if r["kind"] == "parameter"}) == 4  # 4 distinct blocks
