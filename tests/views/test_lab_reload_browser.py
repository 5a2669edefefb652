"""Issue 28, finding 12: a JupyterLab page with notebooks of plots and Workbench tabs comes back whole after
a reload. Runs ``benchmarks/bench_lab_reload.py --quick`` for our transport: 2 notebooks of 7 ``PlotView``
plots each, run in live kernels and saved, and a memory, a checkpoint and a run tab; the page is reloaded
and every tab is visited. Every tab must come back, every plot must hold its traces, and the benchmark
must print its one JSON document. (How fast, against plotly's FigureWidget, is the benchmark's business:
docs/benchmarks.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_browser import CHROMIUM

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]


def test_reload_brings_back_every_tab_and_every_plot_drawn():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (`make browser`)")
    if not (Path(sys.prefix) / "share/jupyter/labextensions/parallel-workbench-lab/package.json").exists():
        pytest.skip("the labextension is not installed in this environment: run `make extension`")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_lab_reload.py"), "--quick",
                           "--transports", "PlotView"], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["benchmark"] == "bench_lab_reload" and doc["baseline"] == "FigureWidget"
    r = doc["results"]["PlotView"]
    assert (r["tabs"], r["notebooks"], r["plots"]) == (5, 2, 14)
    assert r["plots_with_data"] == r["plots"], r
    assert 0 < r["tabs_back_s"] <= r["restored_s"] <= r["all_tabs_s"], r
    assert r["tabs_not_drawn"] == [], r
    assert r["js_heap_mb"] > 0 and r["renderer_rss_mb"] > 0, r
