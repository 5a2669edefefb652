"""Every tutorial notebook runs top to bottom, headless, in a kernel on this interpreter.

Notebooks are found by glob, so a new ``notebooks/NN_*.ipynb`` is tested without touching this file.
They are committed without outputs, so diffs stay readable and nothing stale is shown.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


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
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first failure
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    assert printed.strip() == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs; clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} stores widget state; save it without"
