"""Every public reader of a file workbench did not write itself (or may find damaged), as the hostile
harness calls it, with the errors it documents.

* memory: ``import_snapshots``, ``from_snapshot``, ``import_profiler_trace``, ``MemoryTimeline.load`` raise
  ``ValueError`` (or ``FileNotFoundError``); ``identify_memory_file`` answers a kind or None, never raises.
* checkpoints: ``inspect``, ``tensor_stats``, ``read_tensor``, ``diff``, ``plan_load``, ``export`` raise
  ``CheckpointFormatError`` (a ``ValueError``) or ``ValueError`` (``KeyError`` naming the key, for a key
  the checkpoint lacks); ``verify`` reports and never raises.
* runs: ``read_events`` skips (and counts) the lines it cannot read, and raises ``ValueError`` for a file
  that is no event log or not a regular file in the run; ``JobConfig.load``, ``ModelConfig.from_hf_config``,
  ``ShardingPlan.from_json``/``load`` and ``workbench.plan`` raise ``ValueError``.
* the JupyterLab server's answers (``workbench.jupyter``): a ``Refused`` with a 4xx status; anything else
  would be a 500.
* the command line: one ``error:`` line (or one ``{"status": "error"}`` document under ``--json``) and
  exit 1 or 2. The commands run in-process with ``WORKBENCH_DEBUG=1``, so an unforeseen exception escapes
  instead of hiding behind the generic one-line wrapper.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hostile_bases import KEY
from hostile_harness import CliResult, Ctx, Reader


def _micro():
    from hostile_bases import micro_config

    return micro_config()


def _value_errors() -> tuple[type, ...]:
    return (ValueError, FileNotFoundError)


def _key_errors() -> tuple[type, ...]:
    return (ValueError, FileNotFoundError, KeyError)


# -- memory -------------------------------------------------------------------------------------------

def _import_snapshots(ctx: Ctx, p: Path) -> Any:
    from workbench.memory.snapshot import import_snapshots

    return import_snapshots(p, progress=False)


def _from_snapshot(ctx: Ctx, p: Path) -> Any:
    from workbench.memory.snapshot import from_snapshot

    return from_snapshot(p)


def _identify(ctx: Ctx, p: Path) -> Any:
    from workbench.memory.snapshot import identify_memory_file

    return identify_memory_file(p)


def _profiler(ctx: Ctx, p: Path) -> Any:
    from workbench.memory.snapshot import import_profiler_trace

    return import_profiler_trace(p)


def _timeline_load(ctx: Ctx, p: Path) -> Any:
    from workbench.memory.timeline import MemoryTimeline

    tl = MemoryTimeline.load(p)
    tl.peak()
    return tl


# -- checkpoints ---------------------------------------------------------------------------------------

def _inspect(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import inspect

    m = inspect(p)
    m.summary()
    return m


def _verify(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import verify

    return verify(p, progress=False)


def _verify_deep(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import verify

    return verify(p, deep=True, progress=False)


def _stats(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import tensor_stats

    return tensor_stats(p, KEY, bins=16, log=True)


def _read_tensor(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import read_tensor

    return read_tensor(p, KEY)


def _diff(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import diff

    return diff(p, p, progress=False)


def _is_workbench(p: Path) -> bool:
    return p.is_dir() and ((p / "workbench.json").exists() or (p / "checkpoints").exists())


def _plan_load(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import plan_load

    return plan_load(p, "dp_shard=1", model=None if _is_workbench(p) else _micro())


def _export(ctx: Ctx, p: Path) -> Any:
    from workbench.checkpoint import export

    return export(p, ctx.out / "export.safetensors", to="safetensors", progress=False)


def _server_manifest(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.checkpoints import manifest_page

    return manifest_page(ctx.root, p)


def _server_open(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.opening import open_info

    return open_info(ctx.root, p)


def _server_tensor(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.checkpoints import tensor_answer

    return tensor_answer(ctx.root, p, KEY, bins=16)


def _server_verify(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.checkpoints import verify_answer

    return verify_answer(ctx.root, p)


def _server_plan_load(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.checkpoints import plan_load_answer

    return plan_load_answer(ctx.root, p, {"dp_shard": "1", **({} if _is_workbench(p) else {"model": "tiny"})})


# -- runs, plans, model configs ------------------------------------------------------------------------

def _read_events(ctx: Ctx, p: Path) -> Any:
    from workbench.train.events import read_events

    return read_events(p)


def _run_events(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.runs import run_events

    return run_events(ctx.root, p, points=16)


def _run_pipeline(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.runs import run_pipeline

    return run_pipeline(ctx.root, p)


def _job_config(ctx: Ctx, p: Path) -> Any:
    from workbench.config import JobConfig

    return JobConfig.load(p / "config.json")


def _plan_table(ctx: Ctx, p: Path) -> Any:
    from workbench.jupyter.plans import plan_table

    return plan_table(ctx.root, p)


def _plan_from_json(ctx: Ctx, p: Path) -> Any:
    """``from_json`` takes text: what a careful caller read from a regular file inside the root."""
    from workbench.plan.types import ShardingPlan

    if not p.is_file() or p.is_symlink():
        return None  # nothing a caller would pass: the file readers (server.plan) answer for these
    with open(p, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    plan = ShardingPlan.from_json(text, source=p.name)  # (the text's name, for the message)
    plan.summary()
    return plan


def _plan_file_load(ctx: Ctx, p: Path) -> Any:
    from workbench.plan.types import ShardingPlan

    plan = ShardingPlan.load(p)
    plan.rank_bytes()
    return plan


def _hf_config(ctx: Ctx, p: Path) -> Any:
    from workbench.config import ModelConfig

    return ModelConfig.from_hf_config(p)


def _plan_model(ctx: Ctx, p: Path) -> Any:
    import workbench
    from workbench.config import ParallelConfig

    return workbench.plan(str(p), ParallelConfig(dp_shard=1), seq_len=16)


# -- the command line ----------------------------------------------------------------------------------

def run_cli(ctx: Ctx, argv: list[str], as_json: bool) -> CliResult:
    """``workbench ARGV`` in this process, its stdout and stderr caught at the file descriptors."""
    from workbench.cli import main

    os.environ["WORKBENCH_DEBUG"] = "1"
    argv = [str(a) for a in argv] + (["--json"] if as_json else [])
    out_p, err_p = ctx.out / "cli.stdout", ctx.out / "cli.stderr"
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # the file descriptors 1 and 2, whatever the driver set
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    code: Any = None
    try:
        with open(out_p, "wb") as fo, open(err_p, "wb") as fe:
            os.dup2(fo.fileno(), 1)
            os.dup2(fe.fileno(), 2)
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        sys.stdout, sys.stderr = streams
    if not isinstance(code, int):
        code = 0 if code is None else 1
    return CliResult(code, out_p.read_bytes().decode(errors="replace"), err_p.read_bytes().decode(errors="replace"),
                     as_json)


def _cli(name: str, args: Any, as_json: bool = False) -> Reader:
    def call(ctx: Ctx, p: Path) -> CliResult:
        return run_cli(ctx, args(ctx, p), as_json)

    return Reader(name + ("--json" if as_json else ""), call, kind="cli")


def _not_ok(report: Any) -> bool:
    return not report.ok


READERS: dict[str, Reader] = {r.name: r for r in [
    Reader("memory.import_snapshots", _import_snapshots, _value_errors),
    Reader("memory.from_snapshot", _from_snapshot, _value_errors),
    Reader("memory.identify_memory_file", _identify, never_raises=True, may_accept=True),
    Reader("memory.import_profiler_trace", _profiler, _value_errors),
    Reader("memory.MemoryTimeline.load", _timeline_load, _value_errors),
    Reader("ckpt.inspect", _inspect, _value_errors),
    Reader("ckpt.verify", _verify, never_raises=True, refused=_not_ok),
    Reader("ckpt.verify_deep", _verify_deep, never_raises=True, refused=_not_ok),
    Reader("ckpt.tensor_stats", _stats, _key_errors),
    Reader("ckpt.read_tensor", _read_tensor, _key_errors),
    Reader("ckpt.diff", _diff, _value_errors),
    Reader("ckpt.plan_load", _plan_load, _value_errors),
    Reader("ckpt.export", _export, _value_errors),
    Reader("server.open", _server_open, kind="server"),
    Reader("server.manifest", _server_manifest, kind="server"),
    Reader("server.tensor", _server_tensor, kind="server"),
    Reader("server.verify", _server_verify, kind="server", refused=lambda d: not d.get("ok", True)),
    Reader("server.plan_load", _server_plan_load, kind="server"),
    Reader("run.read_events", _read_events, _value_errors, may_accept=True),
    Reader("server.run_events", _run_events, kind="server", may_accept=True),
    Reader("server.run_pipeline", _run_pipeline, kind="server", may_accept=True),
    Reader("run.JobConfig.load", _job_config, _value_errors),
    Reader("server.plan", _plan_table, kind="server"),
    Reader("plan.ShardingPlan.from_json", _plan_from_json, _value_errors),
    Reader("plan.ShardingPlan.load", _plan_file_load, _value_errors),
    Reader("config.ModelConfig.from_hf_config", _hf_config, _value_errors),
    Reader("config.workbench.plan", _plan_model, _value_errors),
    _cli("cli.memory_import", lambda c, p: ["memory", "import", p, "--out", c.out / "imported"]),
    _cli("cli.memory_import", lambda c, p: ["memory", "import", p], as_json=True),
    _cli("cli.memory_show", lambda c, p: ["memory", "show", p]),
    _cli("cli.memory_show", lambda c, p: ["memory", "show", p], as_json=True),
    _cli("cli.ckpt_inspect", lambda c, p: ["ckpt", "inspect", p]),
    _cli("cli.ckpt_inspect", lambda c, p: ["ckpt", "inspect", p], as_json=True),
    _cli("cli.ckpt_verify", lambda c, p: ["ckpt", "verify", p]),
    _cli("cli.ckpt_verify", lambda c, p: ["ckpt", "verify", p], as_json=True),
    _cli("cli.ckpt_stats", lambda c, p: ["ckpt", "stats", p, KEY, "--bins", "8"]),
    _cli("cli.ckpt_diff", lambda c, p: ["ckpt", "diff", p, p]),
    _cli("cli.ckpt_plan_load", lambda c, p: ["ckpt", "plan-load", p, "--dp-shard", "1"]
         + ([] if _is_workbench(p) else ["--model", "tiny"])),
    _cli("cli.ckpt_convert", lambda c, p: ["ckpt", "convert", p, c.out / "converted", "--to", "hf"]),
    _cli("cli.ckpt_convert", lambda c, p: ["ckpt", "convert", p, c.out / "converted.safetensors", "--to",
                                           "safetensors"], as_json=True),
    _cli("cli.plan", lambda c, p: ["plan", p, "--dp-shard", "1", "--seq-len", "16"]),
    _cli("cli.plan", lambda c, p: ["plan", p, "--dp-shard", "1", "--seq-len", "16"], as_json=True),
]}

# What the corpus calls for each family of inputs (every reader that takes such a file).
FAMILY_READERS: dict[str, list[str]] = {
    "snapshot": ["memory.import_snapshots", "memory.identify_memory_file",
                 "cli.memory_import", "cli.memory_import--json"],
    "profiler": ["memory.import_profiler_trace", "memory.identify_memory_file", "cli.memory_import",
                 "cli.memory_import--json"],
    "timeline": ["memory.MemoryTimeline.load", "memory.identify_memory_file", "cli.memory_show",
                 "cli.memory_show--json"],
    # (the server's checkpoint answers read these same cases over HTTP in test_hostile_server.py;
    # verify_deep runs every check verify does, then reads every tensor)
    "checkpoint": ["ckpt.inspect", "ckpt.verify_deep", "ckpt.tensor_stats", "ckpt.read_tensor",
                   "ckpt.diff", "ckpt.plan_load", "ckpt.export",
                   "cli.ckpt_inspect", "cli.ckpt_inspect--json", "cli.ckpt_verify", "cli.ckpt_verify--json",
                   "cli.ckpt_stats", "cli.ckpt_diff", "cli.ckpt_plan_load", "cli.ckpt_convert",
                   "cli.ckpt_convert--json"],
    "run": ["run.read_events", "server.run_events", "server.run_pipeline", "run.JobConfig.load", "ckpt.inspect",
            "server.open", "cli.ckpt_inspect"],
    "plan": ["server.plan", "plan.ShardingPlan.from_json", "plan.ShardingPlan.load", "server.open"],
    "config": ["config.ModelConfig.from_hf_config", "config.workbench.plan", "cli.plan", "cli.plan--json"],
}

