"""CheckpointBrowser driven programmatically: listing, filter, shard map, stats, diff, dry-run load, verify."""

from __future__ import annotations

import re

import pytest

from test_checkpoint_tools import write_checkpoint  # tests/: checkpoints written per the key contract
from workbench.checkpoint import inspect, read_tensor
from workbench.units import format_bytes

pytest.importorskip("ipywidgets")

KEY = "model.layers.1.attention.wo.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("browse")
    write_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def browser(run):
    from workbench.widgets import CheckpointBrowser

    return CheckpointBrowser(run)


def test_listing_is_grouped_by_module_and_filters(browser):
    labels = [label for label, _ in browser.listing.options]
    values = [v for _, v in browser.listing.options]
    assert values[0] == "group:model" and values[1] == "model.tok_embeddings.weight"
    assert "group:model.layers.0" in values and labels[values.index("group:model.layers.0")].endswith("(9)")
    model_bytes = format_bytes(browser.manifest.summary()["bytes_by_kind"]["model"])
    assert "step 1" in browser.header.value and f"model {model_bytes}" in browser.header.value
    assert model_bytes.endswith(" MiB")
    browser.filter.value = "wo."
    keys = browser.visible_keys()
    assert keys and all("wo." in k for k in keys)
    assert {k for k in keys if k.startswith("model.")} == {f"model.layers.{i}.attention.wo.weight" for i in range(5)}
    browser.kind.value = "model"
    assert len(browser.visible_keys()) == 5 and "5 of" in browser.count.value
    browser.filter.value = ""
    assert len(browser.visible_keys()) == 48
    browser.kind.value = "all"


def test_selecting_a_key_draws_its_shard_map_and_group_summaries(browser):
    browser.listing.value = KEY  # what a click does
    assert browser.selected == KEY and "global shape [128, 128]" in browser.info.value
    (trace,) = browser.shard_figure.data  # one process wrote it: one block, rank 0, the whole tensor
    assert trace.name == "rank 0" and tuple(trace.x) == (0, 128, 128, 0, 0) and tuple(trace.y) == (0, 0, 128, 128, 0)
    browser.listing.value = "group:model.layers.1"
    assert browser.info.value.startswith("<b>model.layers.1</b>: 9 entries")
    with pytest.raises(KeyError, match="did you mean"):
        browser.select("model.layers.1.attention.wo.weigth")


def test_statistics_load_only_the_selected_tensor(browser, run):
    browser.select(KEY)
    stats = browser.load_stats(bins=40)
    t = read_tensor(run, KEY).double()
    assert stats["numel"] == 128 * 128 and stats["non_finite"] == 0
    assert stats["mean"] == pytest.approx(float(t.mean())) and stats["std"] == pytest.approx(float(t.std()))
    assert stats["min"] == float(t.min()) and stats["max"] == float(t.max())
    (bars,) = browser.histogram.data
    assert len(bars.x) == 40 and sum(bars.y) == t.numel()


def test_diff_panel_names_the_changed_tensor(browser, run, tmp_path):
    fqn = KEY.removeprefix("model.")

    def mutate(sd):
        sd["model"][fqn] = sd["model"][fqn] * 2

    other = write_checkpoint(tmp_path / "other", mutate=mutate)
    d = browser.run_diff(str(other))
    assert d is not None and d.top(1).loc[0, "key"] == KEY and d.top(1).loc[0, "rel_norm"] == pytest.approx(1.0)
    assert int((~d.values["equal"]).sum()) == 1 and "1 of" in browser.diff_html.value
    assert browser.diff_figure.data[0].y[-1] == KEY  # the largest change is the top bar
    assert browser.run_diff(str(tmp_path / "missing")) is None and "no such file" in browser.diff_html.value


def test_load_into_layout_panel(browser):
    plan = browser.run_plan(dp_shard=2, tp=2)
    assert plan.loadable and plan.world_size == 4 and "loadable" in browser.plan_html.value
    assert re.search(r"keys checked, \d+\.\d\d MiB to read", browser.plan_html.value)  # binary units
    plan = browser.run_plan(dp_shard=1, tp=3)
    assert not plan.loadable and "tp=3 does not divide n_heads=8" in browser.plan_html.value
    assert not browser.run_plan(tp=1, dp_shard=1, pp=8).loadable
    assert "pp=8 exceeds n_layers=5" in browser.plan_html.value
    # A value outside a field's range is refused in its one line, not clamped by the bounded control.
    assert browser.run_plan(tp=0) is None and "tp=0 must be" in browser.plan_html.value
    assert browser.layout_controls["tp"].value == 1
    assert browser.run_plan(pp_schedule="gpipe", pp=2, dp_shard=1) is not None  # choices: any case
    assert browser.layout_controls["pp_schedule"].value == "GPipe"


def test_verify_panel_and_manifest_displays_as_the_browser(browser, run, monkeypatch):
    assert browser.run_verify().ok and "verify: OK" in browser.verify_html.value
    from workbench.widgets import CheckpointBrowser

    shown = []
    monkeypatch.setattr("IPython.display.display", shown.append)  # what the notebook front end receives
    inspect(run)._ipython_display_()
    assert isinstance(shown[0], CheckpointBrowser) and shown[0].manifest.step == 1


def test_fp8_tensor_statistics_and_histogram(tmp_path):
    from test_checkpoint_fp8 import FP8Weights
    from workbench.checkpoint import TrainState, save
    from workbench.widgets import CheckpointBrowser

    model = FP8Weights(0)
    save(tmp_path / "checkpoints", TrainState(model=model, step=1))
    browser = CheckpointBrowser(tmp_path / "checkpoints" / "step-000001")
    browser.select("model.w")
    stats = browser.load_stats(bins=20)
    x = model.w.float()
    assert stats["dtype"] == "float8_e4m3fn" and stats["non_finite"] == 1  # e4m3fn's NaN
    assert stats["max"] == float(x[x.isfinite()].max())
    (bars,) = browser.histogram.data
    assert len(bars.x) == 20 and sum(bars.y) == x.numel() - 1


# --------------------------------------------------------------------------------------------------
# a checkpoint of the workbench saver: two param groups, two steps; hyper-parameters packed (one JSON item,
# what saves write now) or per key (one 0-d/1-d tensor each, what they wrote before the packing)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from test_checkpoint_listing import save_small_run
    from workbench.widgets import CheckpointBrowser

    steps = save_small_run(tmp_path_factory.mktemp("small"))
    return steps, CheckpointBrowser(steps[0])


@pytest.fixture(scope="module")
def small_per_key(tmp_path_factory):
    from test_checkpoint_listing import save_small_run_per_key
    from workbench.widgets import CheckpointBrowser

    steps = save_small_run_per_key(tmp_path_factory.mktemp("small_per_key"))
    return steps, CheckpointBrowser(steps[0])


@pytest.fixture(params=["packed", "per-key"])
def either(request):
    """``(format, (steps, browser))``: each test that takes it runs on both storage formats."""
    return request.param, request.getfixturevalue("small" if request.param == "packed" else "small_per_key")


def test_param_groups_are_one_entry_each(either):
    fmt, (_, b) = either
    values = [v for _, v in b.listing.options]
    labels = dict((v, label) for label, v in b.listing.options)
    assert not [v for v in values if ".param_groups." in v and not v.startswith(("param_group:", "group:"))]
    groups = [v for v in values if v.startswith("param_group:")]
    assert groups == ["param_group:optim.param_groups.0", "param_group:optim.param_groups.1"]
    assert labels["group:optim.param_groups"].endswith("(2)")
    assert not [v for v in values if v.startswith("optim.hyper.")]  # the packed item is folded too
    decay = next(labels[v] for v in groups if "weight_decay=0.1" in labels[v])
    assert "lr=0.005, betas=(0.9, 0.95)" in decay and decay.endswith("(2 params)")
    n = b.manifest.summary()["n_tensors"]
    # values (a parameter's one hyper-parameter): the same count whatever the storage
    assert f"{n} of {n} tensors, 2 param groups (50 hyper-parameter values)" in b.count.value
    assert f"{n} tensors + 50 optimizer hyper-parameter values in 2 param groups" in b.header.value
    b.listing.value = groups[0]  # what a click does
    assert "optimizer param group" in b.info.value and "<td>betas</td>" in b.info.value
    assert "<td>lr</td><td style='text-align:right'>0.005</td>" in b.info.value
    first = b.param_groups[0]
    if fmt == "packed":
        (item,) = [k for k in b.manifest.keys if k.startswith("optim.hyper.")]
        assert f"{first.n_values} hyper-parameter values packed in {item} (JSON)" in b.info.value
    else:
        assert f"{first.n_values} stored hyper-parameter entries" in b.info.value
    assert b.selected is None and not b.shard_figure.data
    b.filter.value = "norm.bias"  # the group that holds norm.bias stays listed, the other goes
    assert [v for _, v in b.listing.options if v.startswith("param_group:")] == [
        "param_group:" + next(g.name for g in b.param_groups if "norm.bias" in g.params)]
    b.filter.value = ""
    with pytest.raises(KeyError, match="not a param group"):
        b.select_param_group("optim.param_groups.7")


def test_histogram_log_scale_checkbox(small):
    _, b = small
    b.select("model.spread")
    b.load_stats(bins=11)
    (bars,) = b.histogram.data
    assert bars.y[0] == 10 and b.histogram.layout.xaxis.title.text == "x"
    b.stats_log.value = True  # what ticking the box does: the same tensor again, same bins, log10 |x|
    (bars,) = b.histogram.data
    assert list(bars.y) == [1] * 11 and b.histogram.layout.xaxis.title.text == "log10 |x|"
    assert "1 zeros left out" in b.histogram.layout.title.text
    stats = b.load_stats(log=False)
    assert not b.stats_log.value and stats["zeros"] == 1 and b.histogram.data[0].y[0] == 10


def test_packed_hyperparameters_have_no_statistics(small):
    """The optim.hyper.* item (JSON bytes in a uint8 tensor) can be selected, but it is no numbers: the
    statistics say so in the panel instead of summarising bytes."""
    _, b = small
    (item,) = [k for k in b.manifest.keys if k.startswith("optim.hyper.")]
    b.select(item)
    assert "packed optimizer hyper-parameters: UTF-8 JSON, not numbers" in b.info.value
    with pytest.raises(ValueError, match="packed optimizer hyper-parameters"):
        b.load_stats(bins=10)
    assert "ckpt inspect" in b.stats_html.value and b.stats is None and not b.histogram.data


def test_diff_panel_kind_filter_and_changes_per_kind(either):
    fmt, (steps, b) = either
    d = b.run_diff(str(steps[1]), kinds="model")
    assert d.kinds == ["model"] and b.diff_kind.value == "model" and "(kinds: model)" in b.diff_html.value
    assert [t.name for t in b.diff_figure.data] == ["model"]
    b.diff_kind.value = "all"
    b.diff_path.value = str(steps[1])
    b.diff_button.click()
    names = [t.name for t in b.diff_figure.data]
    assert b.diff_result.kinds is None and "model" in names and "optimizer exp_avg_sq" in names
    assert "optimizer hyper-parameter" not in names  # hyper-parameters are no tensor change, in either format
    assert not any(k.startswith("optim.hyper.") for t in b.diff_figure.data for k in t.y)
    assert "optimizer hyper-parameters changed" in b.diff_html.value
    assert "lr: 0.005 &rarr; 0.00333333 (5 params)" in b.diff_html.value
    assert "5 of 50 hyper-parameter values differ" in b.diff_html.value
    b.diff_kind.value = "optimizer"
    b.diff_button.click()
    assert set(b.diff_result.values["kind"]) == {"optimizer"} and "model" not in [t.name for t in b.diff_figure.data]


def test_key_tree_takes_the_width_it_is_given(small):
    _, b = small
    assert b.listing.layout.width == "100%"
    tree, tabs = b.children[1].children
    assert b.listing in tree.children and tree.layout.flex.startswith("1 1") and tabs.layout.flex.startswith("1 1")
    assert b.children[1].layout.width == "100%"


def test_a_deleted_checkpoint_is_named_as_deleted_and_its_histogram_cleared(tmp_path):
    """Notebook 04 used to delete its runs at the end: the browser then called them corrupted and kept the
    earlier histogram under the error."""
    import shutil

    from workbench.checkpoint import CheckpointFormatError
    from workbench.widgets import CheckpointBrowser

    write_checkpoint(tmp_path / "ck")
    b = CheckpointBrowser(tmp_path / "ck")
    b.select(KEY)
    assert b.load_stats()["numel"] == 128 * 128 and b.histogram.data
    shutil.rmtree(tmp_path / "ck")
    with pytest.raises(CheckpointFormatError, match="deleted or moved after it was opened; open it again") as e:
        b.load_stats()
    assert "\n" not in str(e.value) and "corrupted" not in str(e.value)
    assert not b.histogram.data and b.stats is None and "deleted or moved" in b.stats_html.value
