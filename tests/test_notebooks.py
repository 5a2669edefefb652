"""Every tutorial notebook runs top to bottom, headless, in a kernel on this interpreter.

Notebooks are found by glob, so a new ``notebooks/NN_*.ipynb`` is tested without touching this file.
They are committed without outputs, so diffs stay readable and nothing stale is shown.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))

# Binder's guaranteed memory (mybinder.org gives every user at least 1 GB): a notebook that peaks above
# it may be killed there, mid-tutorial. Binder's limit is a container cgroup, which charges each page
# once, so the figure held against it is the PSS summed over the kernel's process tree (the VmRSS sum
# counts torch's shared pages, and the pages the ranks share with the agent that forked them, once per
# process). Peaks measured on 2026-11-23 (PSS / RSS sum, MiB): 01 876/1566, 02 882/1575, 03 476/520,
# 04 882/1567, 05 775/1460, 06 452/496; each of 01-05 is the kernel (250-400 MiB) plus one 2-rank launch
# (an agent and 2 ranks forked from it, about 490 MiB together).
BINDER_GUARANTEED_BYTES = 1 << 30


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}"


def _this_interpreters_kernel(tmp_path: Path) -> KernelManager:
    """A 'python3' kernel that is certainly this interpreter (the venv's), whatever else is installed.

    The usual lookup would take the first 'python3' kernelspec on the Jupyter path, and a user-level one
    may point at another Python that lacks workbench.
    """
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (workbench test)",
        "language": "python",
    }))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ksm)
    assert km.kernel_spec.argv[0] == sys.executable
    return km


class PeakTreeRSS:
    """Peak memory of the processes this one starts while measuring, sampled every `interval_s` in a thread.

    Those are the kernel and whatever it starts (the launcher's agent and the ranks it forks: they sit in
    their own session, but their parent links still lead back to the kernel); children that were already
    there are left out. `peak_pss_bytes` sums PSS, which splits each shared page between the processes
    that map it, so the tree's sum counts each page about once: the figure held against the limit.
    `peak_rss_bytes` sums VmRSS, where a shared page (torch's libraries, the pages the ranks share with
    the agent copy-on-write) counts once per process, so it errs high; it is reported alongside.
    """

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peak_rss_bytes = self.peak_pss_bytes = self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="peak-tree-rss", daemon=True)

    def __enter__(self) -> "PeakTreeRSS":
        self._earlier = set(_children_by_parent().get(os.getpid(), []))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while True:
            pids = _descendants(os.getpid(), skip=self._earlier)
            rss, pss = (sum(sizes) for sizes in zip(*(_rss_pss_bytes(pid) for pid in pids))) if pids else (0, 0)
            if rss > self.peak_rss_bytes:
                self.peak_rss_bytes, self.peak_processes = rss, len(pids)
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            if self._stop.wait(self.interval_s):
                return


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # it ended between the listing and the read
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # after "pid (comm) state": comm may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _descendants(root: int, skip: set[int]) -> list[int]:
    children = _children_by_parent()
    found, todo = [], [pid for pid in children.get(root, []) if pid not in skip]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _rss_pss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, Pss) in bytes; zeros for a process that ended or is a zombie (no VmRSS line)."""
    def kb(path: str, field: str) -> int:
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0
    return kb(f"/proc/{pid}/status", "VmRSS:"), kb(f"/proc/{pid}/smaps_rollup", "Pss:")


# The first tutorials are the ones a newcomer re-runs: each must survive Run All twice in one kernel (its
# run directories, checkpoints and widgets made afresh or reused), and its widgets must still respond after.
RUN_TWICE = ("01_", "02_", "03_", "04_")

# After the last Run All, every view the notebook left in its namespace is poked the way a user's click would.
WIDGET_PROBE = """
from workbench.widgets import CheckpointBrowser, RunDashboard, ShardingPlanView
_probed = []
for _name, _view in list(globals().items()):
    if _name.startswith("_"):  # IPython's output history (_, _10, ...) holds views of earlier runs
        continue
    if isinstance(_view, RunDashboard):
        assert _view.run is not None and _view.run.done, (_name, _view.run)
        assert _view.loss_fig.data, (_name, _view.status.value, _view.run.status)
        assert not _view.launch_button.disabled and _view.stop_button.disabled, _name
        assert _view.error_panel.layout.display == "none", (_name, _view.error_panel.value)
        _view.clear()
        assert not _view.loss_fig.data and _view.run is not None
    elif isinstance(_view, CheckpointBrowser):
        _key = next(k for k in _view.visible_keys() if k.startswith("model."))
        _view.select(_key)
        assert _view.load_stats()["numel"] > 0 and _view.histogram.data, _name
        assert _view.run_verify().ok, _name
    elif isinstance(_view, ShardingPlanView):
        _other = (_view.rank + 1) % _view.world_size
        _view.select_rank(_other)
        assert _view.rank == _other and f"rank {_other}" in _view.rank_info.value, _name
    else:
        continue
    _probed.append(f"{type(_view).__name__} {_name}")
print("probed:", ", ".join(_probed) or "none")
"""

# The widgets alive in the kernel at the end: each widget an output names must be one of them, or the saved
# notebook shows "Error displaying widget: model not found" when reopened (a progress bar that closed its
# widget did; issue 28).
LIVE_WIDGETS = "import ipywidgets as _w, json as _j\nprint('LIVE_WIDGETS', _j.dumps(sorted(_w.Widget.widgets)))"

# Text a notebook must never show its reader: a kernel message that could not be sent (NaN in a widget's
# state), a torch warning meant for gloo, a rank's log line.
LEAKS = ("Message serialization failed", "does not support alltoall", "[rank", "USDT:", "returned a view tensor")


@pytest.mark.notebook
@pytest.mark.timeout(420)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    passes = 2 if path.name.startswith(RUN_TWICE) else 1
    client = NotebookClient(
        nb,
        km=_this_interpreters_kernel(tmp_path),
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},  # cells run with notebooks/ as cwd
    )
    # Extra cells, in memory only: proof that the kernel ran on this interpreter, and the widget probe.
    probe = nbformat.v4.new_code_cell(WIDGET_PROBE)
    live = nbformat.v4.new_code_cell(LIVE_WIDGETS)
    where = nbformat.v4.new_code_cell("import sys; print(sys.executable)")
    with PeakTreeRSS() as mem:
        # Raises CellExecutionError, with the cell and its traceback, on the first failure. cleanup_kc: shut
        # the kernel down afterwards (nbclient keeps a kernel it did not start alive otherwise).
        with client.setup_kernel(cleanup_kc=True):
            for n in range(passes):  # Run All, in the same kernel: nothing from the first run may break the second
                for index, cell in enumerate(nb.cells):
                    client.execute_cell(cell, index)
                leaks = [f"cell {i}: {o.get('text', '')[:300]}" for i, cell in enumerate(nb.cells)
                         for o in cell.get("outputs", []) if o.get("name") == "stderr"
                         and any(leak in o.get("text", "") for leak in LEAKS)]
                assert not leaks, f"{path.name}, Run All #{n + 1}, shows its reader:\n" + "\n".join(leaks)
            shown = {(i, o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"])
                     for i, cell in enumerate(nb.cells) for o in cell.get("outputs", [])
                     if "application/vnd.jupyter.widget-view+json" in o.get("data", {})}
            for extra in (live, probe, where):  # nbclient writes each cell back into nb.cells at its index
                nb.cells.append(extra)
                client.execute_cell(extra, len(nb.cells) - 1)
    print(f"\n{path.name}: {passes} x Run All; peak memory of the kernel's process tree: RSS "
          f"{mem.peak_rss_bytes / 2**20:.0f} MiB ({mem.peak_processes} processes), PSS {mem.peak_pss_bytes / 2**20:.0f} MiB")
    alive = {m for line in "".join(o.get("text", "") for o in live.outputs if o.get("output_type") == "stream").splitlines()
             if line.startswith("LIVE_WIDGETS ") for m in json.loads(line.split(" ", 1)[1])}
    gone = sorted(f"cell {i}" for i, model in shown if model not in alive)
    assert not gone, (f"{path.name}: {', '.join(gone)} show a widget the kernel has closed; reopened, the notebook "
                      "would say 'Error displaying widget: model not found' there")
    printed = "".join(o.get("text", "") for o in where.outputs if o.get("output_type") == "stream")
    assert printed.strip() == sys.executable
    probed = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream")
    print(probed.strip())
    assert mem.peak_pss_bytes < BINDER_GUARANTEED_BYTES, (
        f"{path.name} peaked at {mem.peak_pss_bytes / 2**20:.0f} MiB of PSS (RSS {mem.peak_rss_bytes / 2**20:.0f} "
        f"MiB) summed over the kernel and the processes it started, over Binder's guaranteed "
        f"{BINDER_GUARANTEED_BYTES / 2**20:.0f} MiB; a launch costs about 490 MiB (an agent and 2 forked ranks), "
        "so run one launch at a time")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs; clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} stores widget state; save it without"
