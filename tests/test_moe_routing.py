"""MoE routing in memory predictions (workbench.prediction.routing): measured routing, the band, bad input.

* a skewed routing's all-to-all sizes agree across senders and receivers on a real 2-rank gloo ep group,
  and the real expert-parallel forward runs with them;
* the band's low end is the balanced prediction, and the high end is above it;
* the prediction with a tiny MoE run's own measured routing matches that run's recorded peak (0.5%);
* bad routing input is a one-line ValueError.
"""

from __future__ import annotations

import json
import os
import subprocess
import traceback

import numpy as np
import pytest
import torch
from helpers import spawn_ranks  # tests/helpers.py

import workbench
from workbench.config import ParallelConfig
from workbench.memory import load
from workbench.prediction.fake import distinct_ranks
from workbench.prediction.memory import _job, peak_per_rank, predict
from workbench.prediction.routing import (MemoryBand, RoutingSkew, RoutingTable, as_routing, predict_band,
                                          split_slots)

EP = 2
TABLE = [250, 150, 100, 12]  # one layer's global counts over 4 experts (top_k=2: at most half per expert)
SLOTS = 24                   # token-slots one rank routes in a micro-batch (12 tokens x top_k)
LAYOUT = dict(nproc=2, dp_shard=2, ep=2, steps=3, global_batch=4, seq_len=32)
TOLERANCE = 0.005            # measured routing vs the recorder's peak; seen: +0.023% / -0.003% (bench_memory)


# -- a real all-to-all with the simulated sizes ----------------------------------------------------------

def _a2a_worker(rank: int, store: str, result: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from workbench.config import ModelConfig
    from workbench.models.moe import MoEFeedForward
    from workbench.parallel.expert import apply_ep, simulated_splits

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store, EP), rank=rank, world_size=EP)
        split = split_slots(np.array(TABLE) / sum(TABLE), SLOTS)  # what every rank routes (one table)
        send, recv_splits, rows = simulated_splits(split, EP, rank)
        n_local = len(split) // EP
        # the counts exchange the real forward makes: what my peers send me is what I expect to receive
        counts = torch.tensor(split)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)
        recv = recv.view(EP, n_local)
        assert counts.view(EP, n_local).sum(1).tolist() == send
        assert recv.sum(1).tolist() == recv_splits and recv.sum(0).tolist() == rows
        # the rows themselves, tagged (source, destination): each lands where the sizes say
        tags = torch.tensor([[rank, d] for d in range(EP) for _ in range(send[d])], dtype=torch.float32)
        got = torch.empty(sum(recv_splits), 2)
        dist.all_to_all_single(got, tags, recv_splits, send)
        assert got[:, 1].eq(rank).all()
        assert [int(got[:, 0].eq(s).sum()) for s in range(EP)] == recv_splits
        # and the expert-parallel module runs a forward and backward with those sizes
        cfg = ModelConfig("moe-unit", dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=24, vocab_size=32,
                          n_experts=4, top_k=2)
        torch.manual_seed(0)
        ff = MoEFeedForward(cfg)
        apply_ep(ff, init_device_mesh("cpu", (EP,), mesh_dim_names=("ep",)))
        x = torch.randn(SLOTS, cfg.dim, requires_grad=True)
        out = ff.experts(x, counts)
        out.sum().backward()
        assert out.shape == (SLOTS, cfg.dim) and torch.isfinite(x.grad).all()
        with open(result, "w") as f:
            json.dump({"ok": True, "split": split, "send": send, "recv": recv_splits, "rows": rows}, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(result, "w") as f:
            json.dump({"ok": False, "traceback": traceback.format_exc()}, f)
        raise


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_skewed_splits_agree_across_a_real_gloo_all_to_all(tmp_path):
    results = [tmp_path / f"rank{r}.json" for r in range(EP)]
    out = spawn_ranks(_a2a_worker, lambda r: (r, str(tmp_path / "store"), str(results[r])), results, 60)
    assert out[0]["split"] == out[1]["split"] == [12, 7, 5, 0]  # 24 slots by 250:150:100:12
    # skewed: rank 0 holds the busy experts 0 and 1; rank 1's expert 3 runs no rows at all
    assert [o["recv"] for o in out] == [[19, 19], [5, 5]] and [o["rows"] for o in out] == [[24, 14], [10, 0]]
    assert out[0]["send"] == out[1]["send"] == [19, 5]


# -- the simulated routing itself ------------------------------------------------------------------------

def test_routing_shares_and_distinct_ranks():
    assert split_slots(np.array([0.5, 0.25, 0.25]), 7) == [3, 2, 2] and sum(split_slots(np.ones(5) / 5, 13)) == 13
    job = _job("tiny-moe", nproc=4, dp_shard=4, ep=2)
    skew = RoutingSkew(1.5).check(job)
    for rank in range(4):  # the rank's own experts at the cap (1.5 x the mean 1/4), the rest even
        hot = slice(0, 2) if rank % 2 == 0 else slice(2, 4)
        shares = skew.shares(job, rank)
        assert shares.shape == (4, 4) and np.allclose(shares.sum(axis=1), 1.0)
        assert np.allclose(shares[:, hot], 0.375)
    table = RoutingTable(np.array([[[10, 0, 5, 5]] * 4, [[1, 1, 9, 9]] * 4]), "test").check(job)
    assert np.allclose(table.shares(job, 0)[0], [0.5, 0, 0.25, 0.25])  # rank 0's busiest step is step 0
    assert np.allclose(table.shares(job, 1)[0], [0.05, 0.05, 0.45, 0.45])  # rank 1's is step 1
    # ep ranks are simulated apart only when the routing loads them differently
    assert set(distinct_ranks(job).values()) == {0}
    assert distinct_ranks(job, symmetric_routing=False) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert set(distinct_ranks(ParallelConfig(dp_shard=4), symmetric_routing=False).values()) == {0}


def test_band_low_end_is_the_balanced_prediction():
    balanced = peak_per_rank(predict("tiny-moe", progress=False, **LAYOUT))
    band = predict_band("tiny-moe", progress=False, **LAYOUT)
    assert isinstance(band, MemoryBand) and band.capacity_factor == 2.0  # the default, E/top_k for tiny-moe
    peaks = band.peaks().set_index("rank")
    assert peaks["low_peak"].to_dict() == balanced.to_dict()
    assert (peaks["high_peak"] > peaks["low_peak"] * 1.05).all()
    inside = band.contains(balanced.to_dict())
    assert inside["contains"].all() and (inside["measured"] == inside["band_low"]).all()
    assert not band.contains({0: int(peaks.at[0, "high_peak"]) + 1})["contains"].any()
    doc = json.loads(band.to_json())
    assert doc["capacity_factor"] == 2.0 and doc["max_high_peak_bytes"] == int(peaks["high_peak"].max())
    assert band.low.meta.get("routing") is None and band.high.meta["routing"]["kind"] == "skew"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A real 2-rank ep run of tiny-moe with the memory recorder (its moe events hold the routing)."""
    return workbench.launch("tiny-moe", out=tmp_path_factory.mktemp("moe") / "run", memory=True, **LAYOUT).wait(90)


@pytest.mark.timeout(120)
def test_measured_routing_prediction_matches_the_runs_recorded_peak(moe_run):
    run = moe_run
    measured = load(run.run_dir)
    peaks = {r: measured.peak(r).bytes for r in measured.ranks}
    routed = predict(run.job, routing=run, progress=False)
    assert routed.meta["rank_map"] == {"0": 0, "1": 1}  # each ep rank with its own load
    assert routed.meta["routing"]["kind"] == "measured" and routed.meta["routing"]["steps"] == 3
    got = peak_per_rank(routed).to_dict()
    errors = {r: got[r] / peaks[r] - 1 for r in peaks}
    assert max(abs(e) for e in errors.values()) <= TOLERANCE, errors
    balanced = peak_per_rank(predict(run.job, progress=False)).to_dict()
    assert max(abs(balanced[r] / peaks[r] - 1) for r in peaks) > 2 * max(abs(e) for e in errors.values())


@pytest.mark.timeout(120)
def test_measured_routing_travels_to_worker_processes(moe_run):
    """The same routing from the events file, predicted in worker processes (the routing goes with the job)."""
    here = peak_per_rank(predict(moe_run.job, routing=moe_run, progress=False)).to_dict()
    there = predict(moe_run.job, routing=moe_run.run_dir / "events.jsonl", workers=2, progress=False)
    assert peak_per_rank(there).to_dict() == here and there.meta["routing"]["kind"] == "measured"


# -- bad input -------------------------------------------------------------------------------------------

def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and len(text) < 400, text
    return text


def test_bad_routing_input_is_one_line(tmp_path, workbench_cli):
    job = _job("tiny-moe", **LAYOUT)
    with pytest.raises(ValueError) as e:
        as_routing([[5, 5, 5, 5]] * 3, job)
    assert "3 layer(s) of counts but 'tiny-moe' has 4 MoE layers" in _one_line(e)
    with pytest.raises(ValueError) as e:
        as_routing([[5, 5, 5, 5]] * 3 + [[5, -1, 5, 5]], job)
    assert "non-negative whole numbers; layer 3 expert 1 is -1" in _one_line(e)
    with pytest.raises(ValueError) as e:
        as_routing([[9, 1, 0, 0]] * 4, job)
    assert "90% of its token-slots to expert 0" in _one_line(e)
    with pytest.raises(ValueError) as e:
        as_routing([[5, 5, 5]] * 4, job)
    assert "counts 3 experts per layer" in _one_line(e)
    with pytest.raises(ValueError) as e:
        as_routing([[5, 5, 5, 5]] * 4, _job("tiny", nproc=1))
    assert "'tiny' is dense" in _one_line(e)
    with pytest.raises(ValueError) as e:
        RoutingSkew(2.5).check(job)
    assert "choose 1 (balanced) to 2" in _one_line(e)

    # a run directory whose events.jsonl leads out of it is refused before it is read
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps({"type": "moe", "rank": 0, "time": 0.0, "step": 0,
                                   "tokens_per_expert": [[5, 5, 5, 5]] * 4}) + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(outside, run_dir / "events.jsonl")
    with pytest.raises(ValueError) as e:
        as_routing(run_dir, job)
    assert "events.jsonl" in _one_line(e)
    with pytest.raises(ValueError) as e:
        as_routing(tmp_path, job)  # no events.jsonl at all
    assert "not a run directory" in _one_line(e)
    with pytest.raises(ValueError) as e:
        as_routing(outside, job)  # a file that is no run's events.jsonl
    assert "not a run directory" in _one_line(e)

    # the CLI says the same in one error line
    proc = subprocess.run([*workbench_cli, "memory", "predict", "tiny-moe", "--routing", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and "events.jsonl" in proc.stderr


@pytest.mark.timeout(120)
def test_cli_predict_gives_the_band_and_takes_a_routing(moe_run, workbench_cli):
    layout = ["--nproc", "2", "--dp-shard", "2", "--ep", "2", "--global-batch", "4", "--seq-len", "32"]
    proc = subprocess.run([*workbench_cli, "memory", "predict", "tiny-moe", *layout, "--moe-skew", "1.5", "--json"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    band = doc["band"]  # both ends, per rank; the low end is the prediction the document reports
    assert band["capacity_factor"] == 1.5 and band["low_peak_bytes_per_rank"] == doc["peak_bytes_per_rank"]
    assert all(band["high_peak_bytes_per_rank"][r] > v for r, v in band["low_peak_bytes_per_rank"].items())
    proc = subprocess.run([*workbench_cli, "memory", "predict", "tiny-moe", *layout, "--routing", str(moe_run.run_dir),
                           "--json"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "band" not in doc and doc["peak_bytes_per_rank"] == {
        str(r): int(v) for r, v in peak_per_rank(predict(moe_run.job, routing=moe_run, progress=False)).items()}
