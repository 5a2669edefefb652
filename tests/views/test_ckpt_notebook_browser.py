"""Issue 28, finding 11, in the notebook's CheckpointBrowser: the same words and digits as the Lab tab, a
log-scale count axis for the histogram, the diff's verdict about tensors, and no "unexpected"
hyper-parameters in the load dry run.
"""

from __future__ import annotations

import re

import pytest

from ckpt_views_fixtures import trained_checkpoint
from workbench.checkpoint import export, inspect, verify
from workbench.checkpoint.labels import format_number, label

pytest.importorskip("ipywidgets")

KEY = "optim.state.layers.1.attention.wo.weight.exp_avg_sq"  # values around 1e-9: raw floats are long


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from workbench.widgets import CheckpointBrowser

    root = tmp_path_factory.mktemp("nbbrowser")
    step = trained_checkpoint(root / "run" / "checkpoints")
    export(step, root / "hf", to="hf", progress=False)
    return CheckpointBrowser(step), step, root / "hf"


def _cells(html: str) -> list[tuple[str, str]]:
    return re.findall(r"<tr><td>(.*?)</td><td[^>]*>(.*?)</td></tr>", html)


def test_statistics_have_words_for_labels_and_formatted_numbers(browser):
    b, _, _ = browser
    b.select(KEY)
    stats = b.load_stats(bins=20)
    cells = dict(_cells(b.stats_html.value))
    assert "mean |x|" in cells and "non-finite" in cells and "elements" in cells, cells
    assert not any("_" in k for k in cells), cells  # no abs_mean, non_finite
    assert cells["elements"] == f"{stats['numel']:,}" == "16,384"
    assert cells["mean"] == format_number(stats["mean"])
    for k in ("min", "max", "mean", "std", "mean |x|", "L2 norm"):  # at most 4 significant digits each
        digits = re.sub(r"e[+-]\d+$", "", cells[k]).lstrip("-").replace(".", "").lstrip("0")
        assert len(digits) <= 4, (k, cells[k])
    assert label("abs_mean") == "mean |x|" and label("n_tensors") == "tensors"


def test_histogram_count_axis_toggles_to_log(browser):
    b, _, _ = browser
    b.select(KEY)
    b.load_stats(bins=20)
    assert b.histogram.layout.yaxis.type in (None, "linear")
    b.stats_log_count.value = True  # what ticking "log count" does: the same bars, a log10 count axis
    assert b.histogram.layout.yaxis.type == "log" and b.histogram.layout.yaxis.title.text == "count (log)"
    b.select("model.layers.0.attention.wq.weight")
    b.load_stats(bins=20)
    assert b.histogram.layout.yaxis.type == "log"  # the choice holds for the next tensor
    b.stats_log_count.value = False
    assert b.histogram.layout.yaxis.type == "linear"


def test_diff_panel_says_tensors_equal_for_the_checkpoints_own_export(browser):
    b, _, hf = browser
    d = b.run_diff(str(hf))
    assert d.verdict == "equal" and "tensors equal: 48 of 48 compared" in b.diff_html.value
    assert not re.search(r"\bdifferent\b", b.diff_html.value)  # (differentiable is a hyper-parameter's name)


def test_load_dry_run_and_counts(browser):
    b, step, _ = browser
    plan = b.run_plan(tp=2)
    assert plan.loadable and plan.unexpected == [] and "does not use" not in b.plan_html.value
    n = inspect(step).summary()["n_tensors"]
    assert f"{n} tensors" in b.header.value and verify(step, progress=False).checked["tensors"] == n
