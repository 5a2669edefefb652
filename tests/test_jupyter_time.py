"""Issue 33: JupyterLab opens profiler traces and profile folders in the step-time tab, over HTTP against a
real ``jupyter server`` (the helpers of tests/test_jupyter_server.py).

The root holds a real CPU profile of three training steps of the tiny model (torch.profiler, exported as
``host_1.pt.trace.json`` and gzipped), a profile folder of two ranks' traces (``profile/rank{r}.pt.trace.json.gz``,
what ``train --profile`` writes), a saved ``StepTimeline``, and damaged files named like traces. ``open``
names the step-time view; ``time/timeline`` answers what ``StepTimelineView`` draws, checked against the
core called in-process; damaged files are one line, 422.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from test_jupyter_server import _start_server, _stop, _wait_ready

pytest.importorskip("workbench.time.trace", reason="the trace reader (issue 33, H-trace) is not installed")
pytestmark = pytest.mark.timeout(180)


def _profile(path: Path, steps: int = 3) -> None:
    """A real torch.profiler trace of ``steps`` training steps of the tiny model, on CPU."""
    import os

    import torch
    import torch.nn.functional as F

    from workbench.config import PRESETS
    from workbench.models import build_model

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    model = build_model(PRESETS["tiny"], seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for s in range(steps):
            with torch.profiler.record_function(f"ProfilerStep#{s}"):
                loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
    prof.export_chrome_trace(str(path))


def _gzip(src: Path, dst: Path) -> None:
    with open(src, "rb") as a, gzip.open(dst, "wb") as b:
        shutil.copyfileobj(a, b)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("jtime")
    root = base / "root"
    root.mkdir()
    server = _start_server(base, root)
    try:
        trace = root / "host_1.pt.trace.json"
        _profile(trace)
        _gzip(trace, root / "host_1.pt.trace.json.gz")
        (root / "profile").mkdir()
        for r in (0, 1):
            _gzip(trace, root / "profile" / f"rank{r}.pt.trace.json.gz")
        from workbench.time import import_trace

        import_trace(trace).save(root / "saved")
        (root / "broken.pt.trace.json.gz").write_bytes(b"\x1f\x8b" + b"\0" * 40)
        (root / "notatrace.pt.trace.json").write_text('{"hello": 1}')
        _wait_ready(server)
        yield server, root
    finally:
        _stop(server.proc)


def test_traces_and_profile_folders_open_in_the_step_time_tab(served):
    server, _ = served
    cases = {"host_1.pt.trace.json": "trace", "host_1.pt.trace.json.gz": "trace", "profile": "profile",
             "saved": "step_timeline", "saved/step_timeline.json": "step_timeline"}
    for path, fmt in cases.items():
        body = server.ok("open", path=path)
        assert (body["view"], body["format"]) == ("time", fmt), (path, body)


def test_the_tab_gets_what_the_notebook_view_draws(served):
    server, root = served
    from workbench.time import import_trace

    tl = import_trace(root / "host_1.pt.trace.json.gz")
    body = server.ok("time/timeline", path="host_1.pt.trace.json.gz")
    assert body["steps"] == tl.steps and body["step"] == tl.steps[-1]  # the steady state first
    assert body["spans"] == len(tl) and body["ranks"] == tl.ranks
    assert sum(b["spans"] for b in body["bars"]) == len(tl.select(step=body["step"]))
    assert {b["category"] for b in body["bars"]} <= set(body["categories"])
    assert body["colors"]["forward"] and all(b["end_ms"] >= b["start_ms"] >= 0 for b in body["bars"])
    tot = tl.select(step=body["step"]).totals()
    for c in ("forward", "backward", "optimizer"):
        assert body["totals"][0][c] == pytest.approx(tot.loc[0, c] * 1e3)
    # every step, and a step picked
    every = server.ok("time/timeline", path="host_1.pt.trace.json.gz", step=-1)
    assert every["step"] == -1 and every["spans_shown"] == len(tl)
    first = server.ok("time/timeline", path="host_1.pt.trace.json.gz", step=tl.steps[0])
    assert first["spans_shown"] == len(tl.select(step=tl.steps[0]))
    # a folder of ranks: one row (and a comm row where there is communication) per rank
    prof = server.ok("time/timeline", path="profile")
    assert prof["ranks"] == [0, 1] and {r["rank"] for r in prof["rows"]} == {0, 1}
    saved = server.ok("time/timeline", path="saved")
    assert saved["spans"] == len(tl)


def test_damaged_traces_are_one_line(served):
    server, _ = served
    assert "broken.pt.trace.json.gz" in server.error("time/timeline", 422, path="broken.pt.trace.json.gz")
    assert "notatrace.pt.trace.json" in server.error("time/timeline", 422, path="notatrace.pt.trace.json")
    assert "step 99 is not in" in server.error("time/timeline", 404, path="host_1.pt.trace.json", step=99)
    assert "no such file" in server.error("time/timeline", 404, path="nope.pt.trace.json")
