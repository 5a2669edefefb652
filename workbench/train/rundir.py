"""One run per run directory: launching into a directory that already holds a run must say how.

A run directory (``--out``) holds the run's records, ``config.json``, ``events.jsonl`` (the launcher and
every rank append to it), ``launcher.log`` and ``memory/`` (timelines of ``memory=True`` runs), and
usually its ``checkpoints/``. Launching a new job there used to replace the earlier run's events
silently. Now a directory with a ``config.json`` or an ``events.jsonl`` is refused, in one line naming
it and the two ways on:

* **resume** (``--resume`` / ``resume="latest"`` or a path): continue the run from a checkpoint; its
  event stream starts afresh at the resumed step.
* **overwrite** (``--overwrite`` / ``overwrite=True``): start a new run there. The earlier run is
  deleted first: its records and its ``checkpoints/``, unless the new job resumes (``--overwrite
  --resume``: the checkpoints are what it resumes from). Kept checkpoints of another run would pass for
  this run's (``ckpt inspect RUN``, the checkpoint browser), and rotation, which orders by step number,
  would keep the earlier run's higher steps and delete this run's. A ``--ckpt-dir`` outside the run
  directory is never touched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["RUN_MARKERS", "RUN_RECORDS", "RunDirInUse", "run_markers", "check_reusable", "clear_run"]

RUN_MARKERS = ("config.json", "events.jsonl")  # what makes a directory hold a run
RUN_RECORDS = ("config.json", "events.jsonl", "launcher.log", "memory")  # the run's records
CHECKPOINTS = "checkpoints"


class RunDirInUse(ValueError):
    """``run_dir`` already holds a run, and neither resume nor overwrite was asked for."""

    def __init__(self, run_dir: Path, found: list[str]):
        self.run_dir, self.found = Path(run_dir), found
        super().__init__(self.describe(resume='resume="latest"', overwrite="overwrite=True"))

    def describe(self, resume: str, overwrite: str) -> str:
        """The one line, with the two fixes spelled as the caller spells them (``--resume`` in the CLI)."""
        return (f"{self.run_dir} already holds a run ({', '.join(self.found)}); pass {resume} to continue it from "
                f"its newest checkpoint, or {overwrite} to replace it (deleting its events, config, logs and "
                "checkpoints), or choose another directory")

    def for_cli(self) -> str:
        return self.describe(resume="--resume", overwrite="--overwrite")


def run_markers(run_dir: str | Path) -> list[str]:
    """The files in ``run_dir`` that say it holds a run (empty: a fresh, empty or checkpoints-only directory)."""
    run_dir = Path(run_dir)
    return [name for name in RUN_MARKERS if (run_dir / name).exists()]


def check_reusable(run_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Raise :class:`RunDirInUse` (a ValueError) if ``run_dir`` holds a run and neither flag is set."""
    found = run_markers(run_dir)
    if found and not resume and not overwrite:
        raise RunDirInUse(Path(run_dir), found)


def clear_run(run_dir: str | Path, keep_checkpoints: bool = False) -> list[str]:
    """Delete the earlier run in ``run_dir``: its records (:data:`RUN_RECORDS`) and, unless
    ``keep_checkpoints``, its ``checkpoints/``. Returns the names deleted."""
    run_dir = Path(run_dir)
    removed = []
    for name in RUN_RECORDS + (() if keep_checkpoints else (CHECKPOINTS,)):
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed
