"""Fuzzing the step-time trace importer (workbench.time.trace.import_trace) with hypothesis.

* made-up traces: events of every shape the rules know (steps, labels, collectives, kernels, waits, modules,
  pipeline microbatches) and of shapes they do not (wrong types, negative and zero durations, partial
  overlaps, stray fields), at random times on a few threads and streams. Each either imports into a
  well-formed timeline (no two spans of one stream overlap, times finite, at most a few spans per event,
  payloads >= 0, and ``max_spans`` keeps every category's seconds), or is one ValueError of one line;
* a real trace with its bytes damaged (flipped, cut, gzipped): the same, never another exception.

A few seconds in all (deadline-free, bounded examples).
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.time.timeline import CATEGORIES
from workbench.time.trace import import_trace

NAMES = ["ProfilerStep#1", "ProfilerStep#2", "workbench.step", "workbench.step#9", "workbench.forward#mb1",
         "workbench.backward", "workbench.optimizer", "workbench.data", "workbench.checkpoint", "aten::mm",
         "aten::add_", "autograd::engine::evaluate_function: MmBackward0", "Optimizer.step#AdamW.step",
         "Optimizer.zero_grad#AdamW.zero_grad", "enumerate(DataLoader)#_Iter.__next__", "c10d::allreduce_",
         "c10d::_allgather_base_", "gloo:all_reduce", "record_param_comms", "nccl:all_reduce", "aten::wait",
         "_c10d_functional::wait_tensor", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "sgemm_kernel",
         "cudaLaunchKernel", "nn.Module: Linear_0", "Forward 2", "Backward 2", "PP:0F3", "PP:1B2",
         "FSDP::all_gather (layers.0)", "FSDP::post_backward_rs_wait (layers.1)", "", "x" * 300]
CATS = ["cpu_op", "user_annotation", "kernel", "gpu_memcpy", "cuda_runtime", "python_function", "Trace", "",
        None, 3]
_JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_DIMS = st.one_of(st.lists(st.lists(st.integers(0, 1 << 40), max_size=3), max_size=3),
                  st.lists(st.lists(st.lists(st.integers(0, 64), max_size=2), max_size=2), max_size=2), _JUNK)
_ARGS = st.one_of(_JUNK, st.fixed_dictionaries({}, optional={
    "External id": st.one_of(st.integers(0, 6), _JUNK), "correlation": st.one_of(st.integers(0, 6), _JUNK),
    "stream": st.one_of(st.integers(0, 3), _JUNK), "In msg nelems": st.one_of(st.integers(-5, 1 << 62), _JUNK),
    "Out msg nelems": st.integers(0, 1 << 20), "dtype": st.sampled_from(["Float", "BFloat16", "Nope", 7]),
    "Input Dims": _DIMS, "Input type": st.one_of(st.lists(st.sampled_from(["float", "TensorList", "c10::Half", ""]),
                                                        max_size=3), _JUNK)}))
_TIME = st.one_of(st.integers(0, 400), st.floats(0, 400, allow_nan=False))
_SANE = st.fixed_dictionaries(  # an event the rules read: most of each trace
    {"ph": st.just("X"), "name": st.sampled_from(NAMES), "ts": _TIME, "dur": st.integers(0, 150),
     "pid": st.sampled_from([1, 1, 1, 0]), "tid": st.sampled_from([1, 1, 1, 2, 3, 7])},
    optional={"cat": st.sampled_from(CATS[:6]), "args": _ARGS})
_STEP = st.builds(lambda n, ts, dur: {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts,
                                      "dur": dur, "pid": 1, "tid": 1}, st.integers(0, 3), _TIME, st.integers(0, 500))
_ODD = st.fixed_dictionaries(  # and a few of any shape
    {"ph": st.sampled_from(["X", "M", "i", "s", None])},
    optional={"name": st.one_of(st.sampled_from(NAMES), _JUNK), "cat": st.sampled_from(CATS),
              "ts": st.one_of(_TIME, st.sampled_from([1e16, -5, 1e300]), _JUNK),
              "dur": st.one_of(st.integers(-3, 200), st.floats(allow_nan=True), _JUNK),
              "pid": st.sampled_from([1, 0, "Spans", None, [1]]), "tid": st.sampled_from([1, 2, "x", {}]),
              "args": _ARGS})
_TRACE = st.fixed_dictionaries(
    {"traceEvents": st.builds(lambda steps, rest: steps + rest, st.lists(_STEP, max_size=3),
                              st.lists(st.one_of(_SANE, _SANE, _SANE, _SANE, _SANE, _SANE, _ODD, _JUNK), max_size=60))},
    optional={"distributedInfo": st.one_of(st.fixed_dictionaries({"rank": st.integers(0, 3)}),
                                           st.fixed_dictionaries({"rank": st.integers(0, 3)}), _JUNK),
              "baseTimeNanoseconds": st.one_of(st.integers(0, 1 << 62), _JUNK)})


def _one_line_or_timeline(path: Path, **kw):
    try:
        return import_trace(path, **kw)
    except ValueError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) < 1000, msg
        return None


def _well_formed(tl, events: int) -> None:
    f = tl.frame
    assert np.isfinite(f[["start", "end"]].to_numpy()).all() and (f["end"] >= f["start"]).all()
    assert (f["start"] >= -1e-12).all() and (f["bytes"] >= 0).all()
    assert set(f["category"].astype(str)) <= set(CATEGORIES)
    assert len(f) <= 4 * events + 4  # in proportion to the input
    for _, g in f.groupby(["rank", "stream"]):
        s = g.sort_values(["start", "end"])
        assert (s["start"].to_numpy()[1:] >= s["end"].to_numpy()[:-1] - 1e-9).all()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_TRACE, cap=st.integers(1, 12))
def test_made_up_traces_import_well_formed_or_fail_in_one_line(doc, cap):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.pt.trace.json"
        path.write_text(json.dumps(doc))
        tl = _one_line_or_timeline(path)
        if tl is None:
            return
        n = sum(1 for e in doc["traceEvents"] if isinstance(e, dict))
        _well_formed(tl, n)
        capped = import_trace(path, max_spans=cap)
        _well_formed(capped, n)
        assert len(capped) <= len(tl)
        assert np.allclose(capped.totals().to_numpy(), tl.totals().to_numpy(), rtol=1e-9, atol=1e-12)
        assert capped.frame["bytes"].sum() == tl.frame["bytes"].sum()


@pytest.fixture(scope="module")
def real_bytes(tmp_path_factory) -> bytes:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    model = torch.nn.Linear(8, 8)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2)) as prof:
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            prof.step()
    path = tmp_path_factory.mktemp("real") / "t.json"
    prof.export_chrome_trace(str(path))
    return path.read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=8), cut=st.floats(0.05, 1.0),
       zipped=st.booleans())
def test_a_damaged_real_trace_is_read_or_refused_in_one_line(real_bytes, flips, cut, zipped):
    raw = bytearray(real_bytes[: max(1, int(len(real_bytes) * cut))] if cut < 0.999 else real_bytes)
    for where, byte in flips:
        raw[min(int(where * len(raw)), len(raw) - 1)] = byte
    data = gzip.compress(bytes(raw)) if zipped else bytes(raw)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("t.json.gz" if zipped else "t.json")
        path.write_bytes(data)
        tl = _one_line_or_timeline(path)
        if tl is not None:
            _well_formed(tl, real_bytes.count(b'"ph": "X"') + 8)
