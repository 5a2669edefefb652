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


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    # One extra cell, in memory only: proof that the kernel ran on this interpreter.
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = NotebookClient(
        nb,
        km=_this_interpreters_kernel(tmp_path),
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},  # cells run with notebooks/ as cwd
    )
    with PeakTreeRSS() as mem:
        # Raises CellExecutionError, with the cell and its traceback, on the first failure. cleanup_kc: shut
        # the kernel down afterwards (nbclient keeps a kernel it did not start alive otherwise).
        client.execute(cleanup_kc=True)
    print(f"\n{path.name}: peak memory of the kernel's process tree: RSS {mem.peak_rss_bytes / 2**20:.0f} MiB "
          f"({mem.peak_processes} processes), PSS {mem.peak_pss_bytes / 2**20:.0f} MiB")
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    assert printed.strip() == sys.executable
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
