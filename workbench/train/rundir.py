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

A checkpoint directory belongs to one run, for the same reasons: two runs saving into one ``--ckpt-dir``
replaced each other's ``step-N`` directories (both exited 0; run B's events pointed at run A's weights).
Each run has an id (``run.json`` in its run directory: kept by ``--resume``, new otherwise), and the
first run that will save into a checkpoint directory claims it (``owner.json`` there names the id and the
run directory). :func:`check_outputs` runs before anything is written or started and refuses, in one
line each:

* a ``--out`` or ``--ckpt-dir`` that is a file or lies under one, is on a read-only file system, is not
  writable, or has less room than one checkpoint;
* a checkpoint directory another run owns (unless ``--adopt-ckpt-dir``); one holding checkpoints that
  no run owns (written before owners were recorded, or by ``workbench.checkpoint.save``), unless this
  job resumes from them; and, for ``--overwrite``, the replaced run's checkpoints in a ``--ckpt-dir``
  outside the run directory, which it does not delete.

Resuming from another run's checkpoint stays open: ``--resume runs/a --out runs/b`` reads run A's newest
checkpoint and saves into run B's own directory. ``--adopt-ckpt-dir`` makes this run the owner of a
directory another run owned, to continue saving there (its earlier checkpoints stay and rotate with
this run's). Several nodes: node 0 claims; the others, whose run directories differ, do not.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RUN_MARKERS", "RUN_RECORDS", "RUN_ID", "RunDirInUse", "CheckpointDirInUse", "RunOutputs",
           "run_markers", "check_reusable", "clear_run", "check_outputs", "run_id_of", "checkpoint_bytes"]

RUN_MARKERS = ("config.json", "events.jsonl")  # what makes a directory hold a run
RUN_ID = "run.json"  # {"run_id", "created"}: which run this is (kept when it resumes)
RUN_RECORDS = ("config.json", "events.jsonl", "launcher.log", "memory", "profile", RUN_ID)  # the run's records
CHECKPOINTS = "checkpoints"
RUN_DIR_ROOM = 1 << 20  # at least this much free for the events and logs


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


# -- one run per checkpoint directory, and room to write -----------------------------------------


class CheckpointDirInUse(ValueError):
    """The checkpoint directory a job would save into holds another run's checkpoints."""


def run_id_of(run_dir: str | Path) -> str | None:
    """The id ``run_dir``'s ``run.json`` records (None: none, or unreadable)."""
    p = Path(run_dir) / RUN_ID
    try:
        if not p.is_file() or p.stat().st_size > 4096:
            return None
        doc = json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None
    rid = doc.get("run_id") if isinstance(doc, dict) else None
    return rid if isinstance(rid, str) and rid else None


def checkpoint_bytes(job) -> int:
    """About the bytes of one checkpoint of ``job`` (all ranks): weights, AdamW's two moments (quantized:
    1 byte each plus a 4-byte scale per block of 128) and the EMA. What must be free before the first save."""
    t, n = job.train, job.model.n_params
    weight = 2 if t.dtype == "bfloat16" else 4  # mixed bf16 keeps fp32 master weights
    moments = 2 * n * (1 + 4 / 128) if t.ckpt_quant in ("int8", "fp8") else 2 * n * weight
    return int(n * weight + moments + (4 * n if t.ema else 0))


@dataclass
class RunOutputs:
    """What :func:`check_outputs` found: the run's id, and the checkpoint directory it claims (None: it
    saves none, or another node claims it). :meth:`claim` writes both markers, after the checks."""

    run_dir: Path
    run_id: str
    ckpt_dir: Path | None = None
    owner: dict[str, Any] | None = None  # the marker there now (None: no marker)
    adopted_from: str | None = None  # --adopt-ckpt-dir: the run directory that owned it

    def claim(self) -> None:
        """Write ``run.json`` (the run directory exists by now) and claim the checkpoint directory. Raises
        :class:`CheckpointDirInUse` if another launch claimed it since the check."""
        from workbench.checkpoint.store import CheckpointStore, write_durable

        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        if run_id_of(self.run_dir) != self.run_id:
            write_durable(self.run_dir / RUN_ID, json.dumps({"run_id": self.run_id, "created": now}).encode())
        if self.ckpt_dir is None:
            return
        store = CheckpointStore(self.ckpt_dir)
        doc = {"run_id": self.run_id, "run_dir": str(self.run_dir.resolve()), "claimed": now,
               **({"adopted_from": self.adopted_from} if self.adopted_from else {})}
        if self.owner is not None and self.owner.get("run_id") == self.run_id and \
                self.owner.get("run_dir") == doc["run_dir"]:
            return  # ours already, and where it says
        other = store.claim(doc, exclusive=self.owner is None)
        if other is not None and other.get("run_id") != self.run_id:
            raise CheckpointDirInUse(f"--ckpt-dir {self.ckpt_dir} was claimed by the run in "
                                     f"{other.get('run_dir', '?')} a moment ago; choose another --ckpt-dir")


def check_outputs(run_dir: str | Path, job, *, overwrite: bool = False, adopt: bool = False,
                  resume_target: Path | None = None, claims: bool = True) -> RunOutputs:
    """Before anything is deleted, written or started: the run directory and the checkpoint directory the
    job saves into can be written and have room, and the checkpoint directory is this run's to write
    (module docstring). ``job.train.ckpt_dir`` is absolute by now (None: ``run_dir/checkpoints``);
    ``resume_target``: the checkpoint the job resumes from; ``claims``: False on the nodes of a
    multi-node job other than node 0. Raises ValueError (:class:`CheckpointDirInUse` for ownership),
    one line naming the directory and the ways on."""
    from workbench.disk import check_writable

    run_dir = Path(run_dir)
    t = job.train
    resume = t.resume is not None
    check_writable(run_dir, f"--out {run_dir}", needed=RUN_DIR_ROOM, fix="choose another --out")
    default = t.ckpt_dir is None
    ckpt = run_dir / CHECKPOINTS if default else Path(t.ckpt_dir)
    name = f"the run's checkpoint directory {ckpt}" if default else f"--ckpt-dir {ckpt}"
    prior = run_id_of(run_dir)
    if not t.ckpt_every:  # it saves nothing: no directory to check or claim
        return RunOutputs(run_dir, prior if resume and prior else uuid.uuid4().hex)
    from workbench.checkpoint.store import OWNER, CheckpointStore, step_name

    check_writable(ckpt, name, needed=checkpoint_bytes(job),
                   fix="choose another --ckpt-dir" if not default else "choose another --out or a --ckpt-dir")
    store = CheckpointStore(ckpt)
    owner = store.owner()
    here = str(run_dir.resolve())
    if resume and prior:
        run_id = prior  # the same run, going on
    elif resume and owner is not None and owner.get("run_dir") == here:
        run_id = owner["run_id"]  # the run directory lost its run.json; its checkpoints say whose they are
    else:
        run_id = uuid.uuid4().hex
    out = RunOutputs(run_dir, run_id, ckpt if claims else None, owner)
    if not claims or (owner is not None and owner.get("run_id") == run_id):
        return out
    if default and overwrite and not resume:
        return out  # clear_run deletes the replaced run's checkpoints/ first
    held = [step_name(s) for s in store.steps()]
    listed = (held[0] if len(held) == 1 else f"{held[0]} .. {held[-1]}") if held else "a latest pointer"
    if adopt:
        out.adopted_from = (owner or {}).get("run_dir") or (f"checkpoints without an owner ({listed})"
                                                            if held else None)
        return out
    if owner is None:
        if not held and store.latest_pointer() is None:
            return out  # empty, or only stale temporaries
        if resume and resume_target is not None and _inside(resume_target, ckpt):
            return out  # a run from before owners were recorded, continuing
        raise CheckpointDirInUse(
            f"{name} already holds checkpoints ({listed}) that no run owns (saved before runs recorded their "
            "owner, or by workbench.checkpoint.save); this run's would mix with them and rotation would delete "
            f"one or the other: resume from them (--resume {ckpt}), choose another --ckpt-dir, or pass "
            "--adopt-ckpt-dir to make this run their owner")
    theirs = owner.get("run_dir") or f"unknown ({owner.get('unreadable', 'no run_dir')})"
    if overwrite and not resume and owner.get("run_dir") == here:
        if not held and store.latest_pointer() is None:
            return out  # the replaced run saved nothing there
        raise CheckpointDirInUse(
            f"--overwrite replaces the run in {run_dir}, but its checkpoints in {ckpt} ({listed}) stay: "
            "--overwrite never deletes a --ckpt-dir outside the run directory, and this run's checkpoints "
            f"would mix with them; delete {ckpt} yourself, choose another --ckpt-dir, or add --resume to "
            "continue from them")
    raise CheckpointDirInUse(
        f"{name} belongs to the run in {theirs} ({ckpt / OWNER}): a second run saving there would "
        f"overwrite its checkpoints; choose another --ckpt-dir (--resume {ckpt} starts from its newest "
        f"checkpoint), continue that run with --out {theirs} --resume, or pass --adopt-ckpt-dir to make this "
        "run the directory's owner")


def _inside(path: Path, root: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(Path(root).resolve())
    except (OSError, RuntimeError):
        return False
