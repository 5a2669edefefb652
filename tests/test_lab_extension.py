"""The JupyterLab extension in a real browser: double-click a file in the file browser, see its view.

A real ``jupyter lab`` (with the workbench server extension and the prebuilt labextension from
``workbench/labextension``, which ``make extension`` links into the venv) serves a directory of files
written by our own code: a safetensors checkpoint, a synthetic torch memory snapshot, a run's events and
two DCP checkpoints of it, a real pipeline run (``workbench.launch``: pp=2, 1F1B, 4 microbatches, two
checkpoints), a sharding plan, plus a hostile pickle and a corrupt safetensors file. Playwright drives
Debian's Chromium (the fixtures come from tests/test_browser.py) and, for each file, double-clicks it and
asserts what the tab shows: key names, peak bytes, loss values, the plan's layout, the pipeline's stage
rows and microbatch bars; the hostile and corrupt files give a one-line error and nothing runs. The
run's checkpoints open from its view (the file browser cannot enter a folder named ``checkpoints``),
Compare with… and Will it load into… take a picked path, and open tabs come back after a reload.

Skipped, with the reason, where Chromium or Playwright is missing, or where the labextension is not
installed (run ``make extension``).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_checkpoint_tools import write_checkpoint
from test_browser import browser, lab_page, start_files_lab  # noqa: F401 (browser: a fixture)

REPO = Path(__file__).resolve().parents[1]
STEPS = [(1, 4.25), (2, 3.5), (3, 2.75)]
FIRST_PAINT_S = 5
# Where the README's screenshots go when asked for (WORKBENCH_SCREENSHOTS=docs/images); else tmp_path.
SHOTS = os.environ.get("WORKBENCH_SCREENSHOTS")

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


class _Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _write_files(root: Path) -> dict:
    import torch
    from safetensors.torch import save_file

    from workbench.memory.snapshot import write_synthetic_snapshot
    from workbench.train.events import EventWriter

    save_file({"model.embed.weight": torch.randn(64, 16), "model.norm.weight": torch.ones(16)},
              str(root / "weights.safetensors"))
    snap = write_synthetic_snapshot(root / "snapshot_rank0.pickle", 200_000, seed=0, n_frames=10)
    run = root / "run1"
    run.mkdir()
    steps = []
    for step in (1, 2):  # two DCP checkpoints of the tiny preset, as our saver lays them out
        steps.append((step, write_checkpoint(run, step=step)))
    with EventWriter(run, 0) as w:
        for step, loss in STEPS:
            w.emit("step", step=step, loss=loss, tokens_per_s=1000.0 * step, step_time_s=0.1, mem_bytes=1 << 20)
        for step, path in steps:
            w.emit("checkpoint", step=step, path=str(path), status="published")
    plan = subprocess.run([sys.executable, "-m", "workbench.cli", "plan", "tiny", "--dp-shard", "2", "--tp", "2",
                           "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert plan.returncode == 0, plan.stderr
    (root / "tiny.plan.json").write_text(plan.stdout)
    marker = root.parent / "PWNED"
    _Hostile.marker = marker
    (root / "hostile.pickle").write_bytes(pickle.dumps(_Hostile()))
    (root / "corrupt.safetensors").write_bytes(b"\xff" * 64)
    return {"snapshot": snap, "marker": marker}


@pytest.fixture(scope="module")
def lab_files(tmp_path_factory):
    if not (Path(sys.prefix) / "share/jupyter/labextensions/parallel-workbench-lab/package.json").exists():
        pytest.skip("the labextension is not installed in this environment: run `make extension`")
    base = tmp_path_factory.mktemp("labext")
    root = base / "files"
    root.mkdir()
    import workbench

    # A real pp=2 run (about 5 s), trained while the files are written and the lab starts.
    pp_run = workbench.launch("tiny", out=root / "pp2", nproc=2, pp=2, pp_schedule="1F1B", microbatches=4,
                              steps=2, ckpt_every=1, seed=0)
    info = _write_files(root)
    with start_files_lab(root, base) as server:  # its parsed-snapshot cache under base, not the user's
        pp_run.wait(120)
        yield server, {**info, "pp_run": pp_run}


@pytest.fixture(scope="module")
def page(lab_files, browser):
    with lab_page(browser, lab_files[0]) as pg:
        yield pg


def _open(page, name: str):
    """Double-click ``name`` in the file browser; the Workbench tab's content node."""
    page.locator(f".jp-DirListing-item[title^='Name: {name}']").dblclick()
    tab = page.locator(".jp-MainAreaWidget.pw-document:not(.lm-mod-hidden)").last
    tab.wait_for(timeout=20_000)
    return tab


def _shot(page, tmp_path: Path, name: str) -> None:
    out = Path(SHOTS) if SHOTS else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out / f"lab-{name}.png"))


def test_checkpoint_opens_with_keys_and_histogram(page, tmp_path):
    tab = _open(page, "weights.safetensors")
    row = tab.locator("tr.pw-clickable", has_text="model.embed.weight")
    row.wait_for(timeout=20_000)
    assert "model.norm.weight" in tab.inner_text()
    row.click()
    tab.locator(".pw-detail rect.pw-bar").first.wait_for(timeout=20_000)
    detail = tab.locator(".pw-detail").inner_text()
    assert "elements" in detail and "1,024" in detail  # 64 x 16
    _shot(page, tmp_path, "checkpoint")


def test_snapshot_shows_peak_bytes(page, lab_files, tmp_path):
    _, info = lab_files
    t0 = time.monotonic()
    tab = _open(page, "snapshot_rank0.pickle")
    tab.locator(".pw-memory-chart path.pw-area").first.wait_for(timeout=30_000)  # the stacked categories
    assert time.monotonic() - t0 < FIRST_PAINT_S  # the server sends a downsampled window, never the file
    assert tab.locator(".pw-memory-chart g.pw-peak").count() == 1
    peak = tab.locator("table.pw-table").filter(has_text="peak_bytes").first.inner_text()
    mib = info["snapshot"]["peak_bytes"] / 2**20
    assert f"{mib:.2f} MiB" in peak, (peak, info["snapshot"]["peak_bytes"])
    _shot(page, tmp_path, "snapshot")


def _responsive(page) -> float:
    """Seconds the page takes to run a trivial script: a frozen page cannot answer."""
    t = time.monotonic()
    assert page.evaluate("1 + 1") == 2
    return time.monotonic() - t


def _server_lag(server) -> float:
    """Seconds the Jupyter server takes to answer a small request (the read runs beside it)."""
    t = time.monotonic()
    assert server.api("/api/status")[0] == 200
    return time.monotonic() - t


def test_1gb_snapshot_paints_while_read_and_stays_responsive(page, lab_files, tmp_path):
    """A 1 GB snapshot: the part read is drawn within FIRST_PAINT_S of the double-click (the server reads
    in the background and answers with progress), the page answers scripts within 200 ms throughout,
    and the full timeline replaces it with the generator's exact peak."""
    from workbench.memory.snapshot import write_synthetic_snapshot

    server, _ = lab_files
    big = Path(server.root) / "big_rank0.pickle"
    try:
        truth = write_synthetic_snapshot(big, 1 << 30, seed=1)  # 24-frame stacks: ~110 bytes an entry
        page.locator(".jp-BreadCrumbs-home").click()  # list the new file
        page.locator(".jp-DirListing-item[title^='Name: big_rank0.pickle']").wait_for(timeout=10_000)
        t0 = time.monotonic()
        tab = _open(page, "big_rank0.pickle")
        tab.locator(".pw-partial polyline.pw-line").first.wait_for(timeout=FIRST_PAINT_S * 1000)
        first_paint = time.monotonic() - t0
        label = tab.locator(".pw-progress-label").inner_text()
        assert "% read" in label, label
        # the part read is one rank's total: the palette's total colour (#333333), which no category has
        stroke = tab.locator(".pw-partial polyline.pw-line").first.evaluate("n => n.style.stroke")
        assert stroke == "rgb(51, 51, 51)", stroke
        _shot(page, tmp_path, "snapshot-1gb-partial")
        lags, server_lags = [_responsive(page)], [_server_lag(server)]
        final = tab.locator("table.pw-table").filter(has_text="peak_bytes").first
        while not final.count():
            assert time.monotonic() - t0 < 150, "the 1 GB snapshot was not read in 150 s"
            page.wait_for_timeout(1500)
            lags.append(_responsive(page))
            server_lags.append(_server_lag(server))
        full = time.monotonic() - t0
        assert max(lags) < 0.2, lags  # the final view too: its thousands of steps are a number field, not a menu
        assert tab.locator("input.pw-step-input").count() == 1 and not tab.locator("select.pw-step").count()
        assert max(server_lags) < 1.0, server_lags  # tornado keeps serving while the snapshot is read
        mib = truth["peak_bytes"] / 2**20
        assert f"{mib:.2f} MiB" in final.inner_text(), (final.inner_text(), truth["peak_bytes"])
        assert not tab.locator(".pw-partial").count()
        # Opening never copies the file (JupyterLab's document context checkpoints files it may save).
        assert not list((big.parent / ".ipynb_checkpoints").glob("big_rank0*"))
        _shot(page, tmp_path, "snapshot-1gb")
        print(f"1 GB snapshot: first paint {first_paint:.2f} s, full timeline {full:.1f} s, slowest answer "
              f"of the page {max(lags) * 1000:.0f} ms, of the server {max(server_lags) * 1000:.0f} ms")
    finally:
        big.unlink(missing_ok=True)


def test_run_shows_losses(page, tmp_path):
    _cd(page, "run1")
    tab = _open(page, "events.jsonl")
    tab.locator("polyline.pw-line").first.wait_for(timeout=20_000)
    text = tab.inner_text()
    for _, loss in STEPS:
        assert str(loss) in text
    _shot(page, tmp_path, "run")
    page.locator(".jp-BreadCrumbs-home").click()


def test_plan_shows_layout(page, tmp_path):
    tab = _open(page, "tiny.plan.json")
    tab.locator("h4", has_text="bytes per rank").wait_for(timeout=20_000)
    assert "dp_shard=2 x tp=2" in tab.inner_text()
    _shot(page, tmp_path, "plan")


@pytest.mark.parametrize("name, says", [("hostile.pickle", "not a torch memory snapshot"),
                                        ("corrupt.safetensors", "safetensors")])
def test_bad_file_is_one_line_and_runs_nothing(page, lab_files, name, says, tmp_path):
    _, info = lab_files
    tab = _open(page, name)
    err = tab.locator(".pw-error").first
    err.wait_for(timeout=20_000)
    text = err.inner_text()
    assert says in text and "\n" not in text.strip() and "Traceback" not in text
    assert not info["marker"].exists()
    _shot(page, tmp_path, name.replace(".", "-"))


def _context_menu(page, name: str, item: str):
    page.locator(f".jp-DirListing-item[title^='Name: {name}']").click(button="right")
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()
    tab = page.locator(".jp-MainAreaWidget.pw-document:not(.lm-mod-hidden)").last
    tab.wait_for(timeout=20_000)
    return tab


def test_context_menu_verify_and_open_directory(page):
    tab = _context_menu(page, "weights.safetensors", "Verify checkpoint")
    verdict = tab.locator(".pw-verdict")
    verdict.wait_for(timeout=20_000)
    assert verdict.inner_text() == "checkpoint verified: no problems"
    tab = _context_menu(page, "run1", "Open in Workbench")
    tab.locator("polyline.pw-line").first.wait_for(timeout=20_000)
    assert str(STEPS[-1][1]) in tab.inner_text()


def _cd(page, name: str):
    """Double-click a directory until the file browser shows it (a double-click landing while the listing
    re-renders is dropped)."""
    crumbs = page.locator(".jp-BreadCrumbs-item", has_text=name)
    for _ in range(5):
        page.locator(f".jp-DirListing-item[title^='Name: {name}']").dblclick()
        try:
            crumbs.wait_for(timeout=2_000)
            break
        except Exception:
            continue
    crumbs.wait_for(timeout=5_000)
    page.locator(".jp-DirListing-item").first.wait_for(timeout=5_000)


def _dialog(page, text: str):
    box = page.locator(".jp-Dialog input")
    box.wait_for(timeout=10_000)
    box.fill(text)
    page.locator(".jp-Dialog .jp-mod-accept").click()


def _current_tab(page):
    tab = page.locator(".jp-MainAreaWidget.pw-document:not(.lm-mod-hidden)").last
    tab.wait_for(timeout=20_000)
    return tab


def test_dcp_checkpoint_from_the_run_compare_and_load_dry_run(page):
    # A run directory's view lists its checkpoints (the file browser cannot enter a folder named
    # "checkpoints": jupyter_server routes /api/contents/<path>/checkpoints to its own API).
    tab = _context_menu(page, "run1", "Open in Workbench")
    tab.locator(".pw-checkpoints button", has_text="step 1").click()
    tab = _current_tab(page)
    tab.locator("tr.pw-clickable", has_text="model.tok_embeddings.weight").wait_for(timeout=20_000)
    assert "workbench" in tab.locator(".pw-summary").first.inner_text()  # the format
    # Compare with… -> Browse…: the picker starts in the run directory (it cannot enter checkpoints/
    # either); the checkpoints folder itself stands for its latest step, step 2.
    tab.locator("button.pw-action", has_text="Compare with").click()
    page.locator(".jp-Dialog button", has_text="Browse").click()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    picker = page.locator(".jp-Dialog")
    folder = picker.locator(".jp-DirListing-item[title^='Name: checkpoints']")
    try:
        folder.wait_for(timeout=5_000)
    except PlaywrightTimeout:  # JupyterLab 4.0's picker ignores defaultPath and starts at the root
        picker.locator(".jp-DirListing-item[title^='Name: run1']").dblclick()
    folder.click()
    page.locator(".jp-Dialog .jp-mod-accept", has_text="Select").click()
    verdict = _current_tab(page).locator(".pw-verdict")
    verdict.wait_for(timeout=30_000)
    assert verdict.inner_text().startswith("different: model (")  # a training step apart
    page.get_by_role("tab", name="step-000001", exact=True).click()
    _current_tab(page).locator("button.pw-action", has_text="Will it load into").click()
    _dialog(page, "dp_shard=2")  # a typed answer is still accepted
    verdict = _current_tab(page).locator(".pw-verdict")
    verdict.wait_for(timeout=30_000)
    assert verdict.inner_text() == "loads into the target layout"
    # ... or the layout of a picked plan (or run): the plan of dp_shard=2 x tp=2, 4 ranks
    page.get_by_role("tab", name="step-000001", exact=True).click()
    _current_tab(page).locator("button.pw-action", has_text="Will it load into").click()
    page.locator(".jp-Dialog button", has_text="Browse").click()
    picker = page.locator(".jp-Dialog")
    picker.locator(".jp-BreadCrumbs-home").click()
    picker.locator(".jp-DirListing-item[title^='Name: tiny.plan.json']").click()
    page.locator(".jp-Dialog .jp-mod-accept", has_text="Select").click()
    tab = _current_tab(page)
    tab.locator(".pw-verdict").wait_for(timeout=30_000)
    assert tab.locator(".pw-verdict").inner_text() == "loads into the target layout"
    assert "dp_shard=2 x tp=2" in tab.inner_text() and "tiny.plan.json" in tab.inner_text()


def test_checkpoints_folder_is_closed_to_the_file_browser_and_opens_in_workbench(page, lab_files):
    """JupyterLab's file browser does not enter RUN_DIR/checkpoints (jupyter_server routes
    /api/contents/<path>/checkpoints to its file-checkpoints API); the directory's Open in Workbench does."""
    _cd(page, "run1")
    page.locator(".jp-DirListing-item[title^='Name: checkpoints']").dblclick()
    page.wait_for_timeout(1_000)
    assert not page.locator(".jp-BreadCrumbs-item", has_text="checkpoints").count()
    # what the browser got instead of the listing: run1's (empty) list of file checkpoints
    assert lab_files[0].api("/api/contents/run1/checkpoints") == (200, [])
    tab = _context_menu(page, "checkpoints", "Open in Workbench")
    tab.locator("tr.pw-clickable", has_text="model.tok_embeddings.weight").wait_for(timeout=20_000)
    assert tab.locator(".pw-summary td[data-key='step']").first.inner_text() == "2"  # the latest step
    page.locator(".jp-BreadCrumbs-home").click()


def test_pipeline_run_shows_its_timeline_and_checkpoints(page, lab_files, tmp_path):
    from workbench.parallel.pipeline_bubble import bubble_fraction
    from workbench.train.events import read_events

    server, info = lab_files
    tab = _context_menu(page, "pp2", "Open in Workbench")
    bars = tab.locator(".pw-gantt g.pw-gantt-bar")
    bars.first.wait_for(timeout=20_000)
    rows = tab.locator(".pw-gantt .pw-gantt-row").evaluate_all("ts => ts.map(t => t.textContent)")
    assert rows == ["stage 0 · rank 0", "stage 1 · rank 1"]
    assert bars.count() == 2 * 4 * 2  # pp stages x microbatches x (F, B)
    for row in (0, 1):  # each stage ran F and B of every microbatch once
        labels = tab.locator(f".pw-gantt g.pw-gantt-bar[data-row='{row}']").evaluate_all(
            "gs => gs.map(g => g.dataset.label)")
        assert sorted(labels) == sorted(f"{ph}{mb}" for ph in "FB" for mb in range(4)), labels
    # the step shown is the last one (1), not the warm-up step 0; its bubble from the run's own events
    events = read_events(info["pp_run"].run_dir)
    measured = bubble_fraction([e for e in events if e.get("type") == "schedule" and e["step"] == 1], skip_first=False)
    note = tab.locator(".pw-bubble").inner_text()
    assert f"1F1B, p=2, m=4: bubble measured {round(measured * 100)}% vs theory 20%" in note, note
    assert "pipeline timeline, step 1" in tab.inner_text()
    tab.locator(".pw-pipeline").scroll_into_view_if_needed()
    _shot(page, tmp_path, "pipeline")
    # memory: the recorded peak per stage (the probe's peak_mem_bytes in the step events), RSS labelled so
    peaks = {}
    for e in events:
        if e.get("type") == "step":
            peaks[e["rank"]] = max(peaks.get(e["rank"], 0), e["peak_mem_bytes"])
    stages = tab.locator(".pw-run-memory table").nth(1)
    rows = stages.locator("tbody tr").evaluate_all("rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert [(r[0], r[2]) for r in rows] == [(str(s), _bytes(peaks[s])) for s in (0, 1)], rows  # stage s = rank s
    summary = tab.locator(".pw-summary").first
    assert summary.locator("td[data-key='peak_mem_bytes']").inner_text() == _bytes(max(peaks.values()))
    assert "RSS" in summary.locator("tr", has=page.locator("td[data-key='rss_bytes']")).inner_text()
    # its checkpoints, listed by the server from the directory: each opens the checkpoint browser
    buttons = tab.locator(".pw-checkpoints button").all_inner_texts()
    assert buttons == ["step 1", "step 2 (latest)"], buttons
    tab.locator(".pw-checkpoints button", has_text="step 1").click()
    ck = _current_tab(page)
    ck.locator("tr.pw-clickable", has_text="tok_embeddings").first.wait_for(timeout=20_000)
    assert "pp2/checkpoints/step-000001" in ck.inner_text()
    status, body = server.api("/workbench/api/run/pipeline?path=pp2&step=0")
    assert status == 200 and body["step"] == 0 and len(body["bars"]) == 16
    assert server.api("/workbench/api/run/pipeline?path=run1")[0] == 404  # pp = 1: no timeline


def _bytes(n: int) -> str:
    from workbench.units import format_bytes

    return format_bytes(n)


def _tab_titles(page) -> list[str]:
    return sorted(t for t in page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab").all_inner_texts() if t != "Launcher")


def test_tabs_come_back_after_a_reload(page, lab_files):
    """ILayoutRestorer: the Workbench tabs open before a reload (documents and panels) are back, with content."""
    server, _ = lab_files
    page.locator(".lm-MenuBar-itemLabel", has_text="File").click()  # the earlier tests' tabs
    page.locator(".lm-Menu-itemLabel", has_text="Close All Tabs").click()
    page.locator(".jp-BreadCrumbs-home").click()
    _open(page, "weights.safetensors").locator("tr.pw-clickable").first.wait_for(timeout=20_000)
    _context_menu(page, "pp2", "Open in Workbench").locator(".pw-gantt").wait_for(timeout=20_000)
    before = _tab_titles(page)
    assert before == ["pp2", "weights.safetensors"], before
    for _ in range(100):  # JupyterLab saves the workspace a moment after a change: wait for these two tabs only
        ours = [k for k in server.api("/lab/api/workspaces/default")[1]["data"] if k.startswith("parallel-workbench")]
        if len(ours) == 2 and any('{"path":"pp2"}' in k for k in ours) and any("weights.safetensors" in k for k in ours):
            break
        page.wait_for_timeout(100)
    t0 = time.monotonic()
    page.reload()
    page.get_by_role("tab", name="weights.safetensors", exact=True).click(timeout=30_000)
    _current_tab(page).locator("tr.pw-clickable", has_text="model.embed.weight").wait_for(timeout=20_000)
    page.get_by_role("tab", name="pp2", exact=True).click(timeout=10_000)
    _current_tab(page).locator(".pw-gantt g.pw-gantt-bar").first.wait_for(timeout=20_000)
    print(f"reload: the tabs back with content in {time.monotonic() - t0:.1f} s")
    assert _tab_titles(page) == before
