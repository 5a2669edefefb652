"""Issue 28, finding 5: "peak" means one thing. The run tab's answer (``run/events``) shows the recorded
peak (the events' ``peak_mem_bytes``, or a ``--memory`` run's ``memory`` events, or on CUDA the allocator's
``max_memory_allocated``) per rank and per pipeline stage, and the resident set only as ``rss_bytes``.

Before issue 28 the summary's ``peak_mem_bytes`` was the largest step ``mem_bytes``, which on CPU is the
process's RSS (359 MiB in the report, against 42 MiB recorded), and no stage had a peak: the assertions
on ``peak_mem_bytes``, ``memory`` and ``pipeline.stages`` below fail there.
"""

from __future__ import annotations

from workbench.jupyter.runs import run_events
from workbench.train.events import EventWriter

MiB = 1 << 20
RSS = [359 * MiB, 351 * MiB]  # what /proc/self/statm says of each rank's process
PEAKS = {0: [40 * MiB, 42 * MiB], 1: [17 * MiB, 18 * MiB]}  # the probe's peak_mem_bytes per step


def _pp_run(d):
    """A 2-step pp=2 run on CPU, its events as the trainer writes them (start, pipeline, step, schedule)."""
    d.mkdir()
    with EventWriter(d, -1) as w:
        w.emit("launch", nproc=2)
    for rank in (0, 1):
        with EventWriter(d, rank) as w:
            w.emit("start", pid=100 + rank, world_size=2, layout="pp=2", device="cpu", build_peak_bytes=MiB)
            w.emit("pipeline", schedule="1F1B", microbatches=2, stages={str(rank): [f"layers.{rank}"]})
            for step in (0, 1):
                w.emit("step", step=step, loss=2.0 - step, tokens_per_s=10.0, step_time_s=0.1,
                       mem_bytes=RSS[rank] - (1 - step) * MiB, peak_mem_bytes=PEAKS[rank][step])
                acts = [{"stage": rank, "microbatch": m, "phase": ph, "start": step + i, "end": step + i + 0.5}
                        for i, (m, ph) in enumerate([(0, "F"), (1, "F"), (0, "B"), (1, "B")])]
                w.emit("schedule", step=step, actions=acts)
    with EventWriter(d, -1) as w:
        w.emit("run_end", status="succeeded")
    return d


def test_pipeline_run_shows_the_recorded_peak_per_rank_and_stage_and_labels_rss(tmp_path):
    _pp_run(tmp_path / "pp")
    s = run_events(tmp_path, tmp_path / "pp", points=10)["summary"]
    assert s["peak_mem_bytes"] == 42 * MiB  # the events' peak, not the 359 MiB resident set
    assert s["rss_bytes"] == 359 * MiB and "peak probe" in s["peak_mem_source"]
    assert [(m["rank"], m["stages"], m["peak_mem_bytes"], m["peak_step"], m["rss_bytes"]) for m in s["memory"]] == [
        (0, [0], 42 * MiB, 1, RSS[0]), (1, [1], 18 * MiB, 1, RSS[1])]
    assert [(st["stage"], st["ranks"], st["peak_mem_bytes"]) for st in s["pipeline"]["stages"]] == [
        (0, [0], 42 * MiB), (1, [1], 18 * MiB)]
    series = run_events(tmp_path, tmp_path / "pp", points=10)["series"]
    assert series["0"]["peak_mem_bytes"] == PEAKS[0]  # and per step, for the plots


def test_cuda_mem_bytes_is_the_allocator_peak_and_memory_events_win(tmp_path):
    cuda = tmp_path / "cuda"
    cuda.mkdir()
    with EventWriter(cuda, 0) as w:
        w.emit("start", pid=1, world_size=1, layout="dp=1", device="cuda:0")
        w.emit("step", step=0, loss=1.0, tokens_per_s=1.0, step_time_s=0.1, mem_bytes=3 * MiB,
               mem_reserved_bytes=4 * MiB)
    s = run_events(tmp_path, cuda)["summary"]
    assert s["peak_mem_bytes"] == 3 * MiB and "rss_bytes" not in s and "CUDA allocator" in s["peak_mem_source"]

    rec = tmp_path / "recorded"
    rec.mkdir()
    with EventWriter(rec, 0) as w:  # a --memory run on CPU: the recorder's peak, RSS beside it
        w.emit("start", pid=1, world_size=1, layout="dp=1", device="cpu")
        for step, peak in ((0, 5 * MiB), (1, 7 * MiB)):
            w.emit("step", step=step, loss=1.0, tokens_per_s=1.0, step_time_s=0.1, mem_bytes=300 * MiB)
            w.emit("memory", step=step, live_bytes=MiB, peak_bytes=peak, by_category={"parameter": MiB})
    s = run_events(tmp_path, rec)["summary"]
    assert (s["peak_mem_bytes"], s["rss_bytes"]) == (7 * MiB, 300 * MiB) and "memory recorder" in s["peak_mem_source"]
    assert s["memory"][0]["peak_step"] == 1 and "pipeline" not in s

    plain = tmp_path / "plain"
    plain.mkdir()
    with EventWriter(plain, 0) as w:  # CPU, no probe, no recorder: nothing is called a peak
        w.emit("start", pid=1, world_size=1, layout="dp=1", device="cpu")
        w.emit("step", step=0, loss=1.0, tokens_per_s=1.0, step_time_s=0.1, mem_bytes=300 * MiB)
    s = run_events(tmp_path, plain)["summary"]
    assert "peak_mem_bytes" not in s and s["rss_bytes"] == 300 * MiB and s["memory"][0]["peak_mem_bytes"] is None


def test_run_summary_gives_the_same_peak_and_rss_as_the_run_tab(tmp_path):
    """``Run.summary()`` (``workbench train --json``, and rank 0 under plain torchrun) follows the run tab's
    rule: the recorded peak as ``peak_mem_bytes``, the resident set only as ``rss_bytes``."""
    import subprocess
    import sys

    from workbench.train.launcher import Run, build_job

    d = _pp_run(tmp_path / "pp")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])  # a real, already finished process
    proc.wait(30)
    summary = Run(build_job("tiny", nproc=2, pp=2, steps=2), d, proc, d / "launcher.log").summary()
    tab = run_events(tmp_path, d, points=10)["summary"]
    assert (summary["peak_mem_bytes"], summary["rss_bytes"]) == (42 * MiB, 359 * MiB)
    assert (summary["peak_mem_bytes"], summary["rss_bytes"]) == (tab["peak_mem_bytes"], tab["rss_bytes"])
