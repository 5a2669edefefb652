"""The dashboard sends the page a bounded number of redraws, whatever the step rate (issue 28, finding 4).

What reaches the page is counted at the comm: ``comm.create_comm`` (the hook the ``comm`` package offers for
this) is replaced by one that records every message each widget sends, as a kernel would publish it. The run
is a real process writing a real ``events.jsonl`` at 60 steps a second (``fake_live_run``), so the rate is
the dashboard's doing, not the machine's. A page that draws slowly is played by a thread that echoes the
dashboard's ``PagePace`` ticks late, as the browser side does once it has drawn.
"""

from __future__ import annotations

import json
import threading
import time

import comm
import pytest

import workbench.widgets.dashboard as dashboard_module
from fake_live_run import fake_run
from workbench.widgets import RunDashboard
from workbench.widgets.page_pace import PagePace

MAX_REDRAWS_PER_S = 4
STEPS, RATE, QUIET_S = 300, 60.0, 1.5


class _RecordingComm(comm.DummyComm):
    sent: list[tuple[float, str, str]] = []  # (wall time, comm_id, method) of every message sent

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        if msg_type == "comm_msg":
            _RecordingComm.sent.append((time.time(), self.comm_id, (data or {}).get("method", "")))


@pytest.fixture
def sent(monkeypatch):
    _RecordingComm.sent = []
    monkeypatch.setattr(comm, "create_comm", _RecordingComm)
    return _RecordingComm.sent


def _messages_per_batch(dash: RunDashboard, sent: list) -> int:
    """What one batched change of two lines costs this figure class in messages (plotly's FigureWidget sends
    several per batch, a figure that syncs whole sends one): the unit of the figures' budget."""
    fig = dash._figure("calibration", "y")
    fig.add_scatter(x=[0], y=[0])
    fig.add_scatter(x=[0], y=[1])
    before = len(sent)
    with fig.batch_update():
        fig.data[0].x, fig.data[0].y = (0, 1), (0, 1)
        fig.data[1].x, fig.data[1].y = (0, 1), (1, 2)
    return max(1, len(sent) - before)


def _events(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
def test_a_fast_run_reaches_the_page_as_a_few_redraws_a_second_and_its_end_at_once(sent, tmp_path, monkeypatch):
    run = fake_run(tmp_path / "run", steps=STEPS, rate=RATE, quiet_s=QUIET_S)
    monkeypatch.setattr(dashboard_module, "launch", lambda *args, **kwargs: run)
    dash = RunDashboard(preset="tiny", nproc=2, dp_shard=2, steps=STEPS, out_root=tmp_path / "runs")
    per_batch = _messages_per_batch(dash, sent)
    sent.clear()
    try:
        assert dash.launch() is run
        dash.wait(90)
        returned = time.time()
    finally:
        run.stop(grace_s=2)
    events = _events(run)
    steps = [e["time"] for e in events if e["type"] == "step"]
    ended = next(e["time"] for e in events if e["type"] == "run_end")

    # While the steps come at 60 a second: at most four redraws a second reach the page.
    burst = (steps[0], steps[-1] + dash.poll_s)
    budget = MAX_REDRAWS_PER_S * (burst[1] - burst[0]) + 2

    def count(widget, window) -> int:
        return sum(1 for t, cid, _ in sent if cid == widget.model_id and window[0] <= t <= window[1])

    progress = count(dash.progress, burst)
    figures = {name: count(fig, burst) for name, fig in
               {**dash.metric_figs, "memory": dash.memory_fig}.items()}
    seconds = burst[1] - burst[0]
    print(f"\n{STEPS} steps x 2 ranks in {seconds:.1f} s ({STEPS / seconds:.0f} steps/s): progress bar "
          f"{progress} messages ({progress / seconds:.1f}/s), figures {figures} at {per_batch} message(s) per "
          f"batch; the end drawn {returned - ended:.2f} s after the run's last event")
    assert progress <= budget, f"{progress} progress updates in {seconds:.1f} s: over {MAX_REDRAWS_PER_S}/s"
    for name, n in figures.items():
        assert n <= per_batch * budget, f"figure {name}: {n} messages in {seconds:.1f} s over {MAX_REDRAWS_PER_S} redraws/s"

    # Then nothing for QUIET_S seconds: nothing changed, so nothing is sent.
    quiet = (steps[-1] + 2 * dash.poll_s + 0.1, ended - 0.05)
    assert quiet[1] - quiet[0] > 0.5
    noise = [(round(t - quiet[0], 2), m) for t, _, m in sent if quiet[0] <= t <= quiet[1]]
    assert noise == [], f"sent while nothing changed: {noise}"

    # The end, complete, soon after the run's last event: every step of every rank, the bar full.
    assert returned - ended <= 0.5 + 0.25, f"the end was drawn {returned - ended:.2f} s after the run ended"
    assert dash.progress.value == STEPS and dash.progress.bar_style == "success"
    assert "succeeded" in dash.status.value
    assert sorted(len(t.x) for t in dash.loss_fig.data) == [STEPS, STEPS]
    assert [len(t.x) for t in dash.tps_fig.data] == [STEPS]


def _echo_after(pace: PagePace, draw_s: float, stop: threading.Event) -> threading.Thread:
    """A page that takes ``draw_s`` to draw each redraw, then echoes its tick as the browser side does."""

    def page() -> None:
        seen = pace.tick
        while not stop.is_set():
            if pace.tick != seen:
                seen = pace.tick
                time.sleep(draw_s)
                pace._handle_custom_msg({"drawn": seen}, [])  # what ipywidgets calls for the page's message
            time.sleep(0.01)

    thread = threading.Thread(target=page, daemon=True)
    thread.start()
    return thread


def test_the_page_sets_the_pace_of_redraws_once_it_echoes():
    pace = PagePace()
    assert pace.ready(2.0)  # no page has said anything: nothing to wait for
    pace.sent()
    assert pace.ready(2.0)
    pace._handle_custom_msg({"drawn": pace.tick}, [])  # a page, drawing at once
    pace.sent()
    assert not pace.ready(2.0)  # it has not drawn this one yet
    time.sleep(0.3)
    pace._handle_custom_msg({"drawn": pace.tick}, [])  # drawn, after 0.3 s
    assert not pace.ready(2.0)  # and it gets as long again to itself
    time.sleep(0.4)
    assert pace.ready(2.0)
    pace.sent()
    time.sleep(0.3)
    assert pace.ready(0.2)  # silent for a whole wait: the page is gone (a closed tab) ...
    pace.sent()
    assert pace.ready(0.2)  # ... and not waited for, until it speaks again
    pace._handle_custom_msg({"drawn": "x"}, [])  # anything else from a page is ignored
    pace.sent()
    assert pace.ready(0.2)


@pytest.mark.timeout(120)
def test_a_slow_page_slows_the_plots_not_the_status_line(sent, tmp_path, monkeypatch):
    draw_s = 0.5
    run = fake_run(tmp_path / "run", steps=STEPS, rate=RATE)
    monkeypatch.setattr(dashboard_module, "launch", lambda *args, **kwargs: run)
    dash = RunDashboard(preset="tiny", nproc=2, dp_shard=2, steps=STEPS, out_root=tmp_path / "runs")
    per_batch = _messages_per_batch(dash, sent)
    stop = threading.Event()
    _echo_after(dash.page_pace, draw_s, stop)
    dash.page_pace._handle_custom_msg({"drawn": 0}, [])  # the page is there
    sent.clear()
    try:
        dash.launch()
        dash.wait(90)
    finally:
        stop.set()
        run.stop(grace_s=2)
    steps = [e["time"] for e in _events(run) if e["type"] == "step"]
    burst = (steps[0], steps[-1])
    seconds = burst[1] - burst[0]
    in_burst = [(t, cid) for t, cid, _ in sent if burst[0] <= t <= burst[1]]
    loss = sum(1 for _, cid in in_burst if cid == dash.loss_fig.model_id) / per_batch
    status = sum(1 for _, cid in in_burst if cid == dash.status.model_id)
    print(f"\npage drawing {draw_s} s per redraw, {seconds:.1f} s of steps: loss plot redrawn {loss:.0f} times, "
          f"status line {status} times")
    # Each redraw: the page draws it (draw_s), then gets as long again; the status line does not wait for it.
    assert loss <= seconds / (2 * draw_s) + 2, f"{loss} plot redraws: faster than the page draws them"
    assert status >= 2 * loss, f"the status line ({status}) waited for the plots ({loss})"
    # The end is still complete.
    assert sorted(len(t.x) for t in dash.loss_fig.data) == [STEPS, STEPS] and dash.progress.value == STEPS
