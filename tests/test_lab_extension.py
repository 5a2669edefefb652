"""The JupyterLab extension in a real browser: double-click a file in the file browser, see its view.

A real ``jupyter lab`` (with the workbench server extension and the prebuilt labextension from
``workbench/labextension``, which ``make extension`` links into the venv) serves a directory of files
written by our own code: a safetensors checkpoint, a synthetic torch memory snapshot, a run's events and
two DCP checkpoints of it, a sharding plan, plus a hostile pickle and a corrupt safetensors file. Playwright drives Debian's Chromium
(the fixtures come from tests/test_browser.py) and, for each file, double-clicks it and asserts what the
tab shows: key names, peak bytes, loss values, the plan's layout; the hostile and corrupt files give a
one-line error and nothing runs.

Skipped, with the reason, where Chromium or Playwright is missing, or where the labextension is not
installed (run ``make extension``).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_checkpoint_tools import write_checkpoint
from test_browser import LAB_OVERRIDES, PAGE_CONFIG, browser, start_lab  # noqa: F401 (browser: a fixture)

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
    info = _write_files(root)
    settings = base / "app-settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(json.dumps(LAB_OVERRIDES))
    (settings / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
    for d in ("config", "data", "runtime", "user-settings", "workspaces"):
        (base / d).mkdir()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_DATA_DIR=str(base / "data"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"), JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1")
    with start_lab(root, base, settings, env, ("--ServerApp.jpserver_extensions={'workbench.jupyter': True}",)) as server:
        yield server, info


@pytest.fixture(scope="module")
def page(lab_files, browser):
    server, _ = lab_files
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    pg.goto(f"{server.url}/lab?token={server.token}", timeout=60_000)
    pg.wait_for_selector(".jp-DirListing-item", timeout=60_000)
    yield pg
    context.close()


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
    assert "numel" in detail and "1024" in detail  # 64 x 16
    _shot(page, tmp_path, "checkpoint")


def test_snapshot_shows_peak_bytes(page, lab_files, tmp_path):
    _, info = lab_files
    t0 = time.monotonic()
    tab = _open(page, "snapshot_rank0.pickle")
    tab.locator("polyline.pw-line").first.wait_for(timeout=30_000)
    assert time.monotonic() - t0 < FIRST_PAINT_S  # the server sends a downsampled window, never the file
    peak = tab.locator("table.pw-table").filter(has_text="peak_bytes").first.inner_text()
    mib = info["snapshot"]["peak_bytes"] / 2**20
    assert f"{mib:.2f} MiB" in peak, (peak, info["snapshot"]["peak_bytes"])
    _shot(page, tmp_path, "snapshot")


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
    tab.locator("button.pw-action", has_text="Compare with").click()
    _dialog(page, "run1/checkpoints/step-000002")
    verdict = _current_tab(page).locator(".pw-verdict")
    verdict.wait_for(timeout=30_000)
    assert verdict.inner_text() == "different"  # a training step apart
    page.get_by_role("tab", name="step-000001", exact=True).click()
    _current_tab(page).locator("button.pw-action", has_text="Will it load into").click()
    _dialog(page, "dp_shard=2")
    verdict = _current_tab(page).locator(".pw-verdict")
    verdict.wait_for(timeout=30_000)
    assert verdict.inner_text() == "loads into the target layout"
