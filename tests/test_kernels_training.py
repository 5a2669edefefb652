"""Training with our kernels: ``--kernels triton`` (Triton's interpreter on CPU) against ``--kernels torch``,
and residual dropout (the fused dropout+add) against the single-process run on the parity layouts.

Every run: tiny, residual dropout 0.1, seed 7, 2 steps of 8 sequences of 32 tokens.

Tolerances. One process, triton vs torch: every loss within 1e-6 (measured: equal; the dropout masks and
values are bit-identical, and the embedding's index_put gradient sums in fp32 like torch's). Layouts
against the single-process torch run: tests/parity.py's tolerances (1e-3 per step, 1e-5 at step 0),
which hold only because a sequence is dropped the same way on every layout: its masks are drawn from
its index in the global batch (workbench.kernels.dropout). Under sequence parallelism the residual
stream is a local slice of the sequence, so its masks are valid but not the single-process ones: that
layout is compared with the torch backend on the same layout instead.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import workbench
from parity import LAYOUTS, assert_matches_reference  # tests/parity.py

TIMEOUT_S = 150  # a hang fails here, not at the CI limit
COMMON = dict(steps=2, seed=7, seq_len=32, dropout=0.1)
SAME_BACKEND_TOL = 1e-6



def _run(tmp_path_factory, name, **kw):
    out = tmp_path_factory.mktemp("".join(c if c.isalnum() else "_" for c in name))
    return workbench.launch("tiny", out=out, **{**COMMON, **kw}).wait(TIMEOUT_S)


def _same(df, ref, name, tol=SAME_BACKEND_TOL):
    for rank, g in df.groupby("rank"):
        diff = (g.set_index("step")["loss"] - ref["loss"]).abs().max()
        assert diff <= tol, f"{name} rank {rank}: loss differs from the torch backend's by {diff:.2e} (> {tol})"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the torch reference path."""
    return _run(tmp_path_factory, "ref", nproc=1, kernels="torch")


@pytest.mark.multirank
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_triton_matches_torch_and_config_records_backend(reference, tmp_path_factory):
    run = _run(tmp_path_factory, "triton", nproc=1, kernels="triton")
    _same(run.metrics, reference.metrics.set_index("step"), "triton")
    for r, backend in ((run, "triton"), (reference, "torch")):
        assert json.loads((r.run_dir / "config.json").read_text())["kernels"] == backend
        assert [e["kernels"] for e in r.events_since(0) if e["type"] == "start"] == [backend]
    assert json.loads((run.run_dir / "config.json").read_text())["model"]["dropout"] == 0.1


@pytest.mark.multirank
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("name,kw", [
    pytest.param(name, kw, id=name) for name, kw in (
        ("dp_shard=2 x accum", dict(nproc=2, dp_shard=2, micro_batch=2)),  # rank and micro-batch offsets
        ("ac=full", dict(nproc=1, activation_checkpointing="full")),        # the recomputation draws the same
        ("pp=2 x 4 microbatches", dict(nproc=2, pp=2, pp_schedule="GPipe", microbatches=4)))])
def test_dropout_matches_single_process(name, kw, reference, tmp_path_factory):
    """The default backend (torch on CPU): a sequence is dropped the same whatever the layout."""
    run = _run(tmp_path_factory, name, **kw)
    assert_matches_reference(run.metrics[run.metrics["rank"] == run.metrics["rank"].max()],
                             reference.metrics.set_index("step"), name)


@pytest.mark.multirank
@pytest.mark.timeout(2 * TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_triton_on_parity_layouts(name, reference, tmp_path_factory):
    run = _run(tmp_path_factory, name + " triton", kernels="triton", **LAYOUTS[name])
    df = run.metrics
    assert sorted(df["rank"].unique()) == list(range(LAYOUTS[name]["nproc"]))
    # Every layout draws the single-process run's masks (tp=2+sp too: each rank's sequence chunk at its
    # global positions), so the losses match it within the parity suite's tolerances.
    assert_matches_reference(df, reference.metrics.set_index("step"), name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton compiles for CUDA here")
def test_triton_where_it_cannot_run_is_refused_before_anything_starts(workbench_cli, tmp_path):
    """Without CUDA and without the interpreter, --kernels triton is one line and exit 2; nothing starts."""
    proc = subprocess.run([*workbench_cli, "train", "tiny", "--kernels", "triton", "--steps", "1",
                           "--out", str(tmp_path / "run")], env={**os.environ, "TRITON_INTERPRET": "0"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: kernels='triton' cannot run on cpu tensors: ")
    assert not (tmp_path / "run").exists()
