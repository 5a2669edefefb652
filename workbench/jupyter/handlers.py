"""The JupyterLab views' HTTP API: ``GET /workbench/api/...``, JSON in, JSON out, never a whole file.

Every ``path``/``other`` is relative to the server's root directory (what JupyterLab's file browser
calls a path: ``runs/r1/checkpoints/step-000002``; a leading ``/`` means the root). One that escapes the
root (``..``, a symlink that points outside) is answered as a path that does not exist (the same 404: the
client learns nothing about what is outside), and so is a file that an index, a ``.metadata``, a manifest,
``latest`` or a run directory names outside its directory or the root: every answer opens files through
``workbench.safeio`` confined to the root, so such a name is refused before anything is opened. A hidden
path (as given or as it resolves) is refused unless the server allows hidden files
(``ContentsManager.allow_hidden``); a FIFO or device is never opened. Requests need
the server's token or cookie, like the contents API. Numbers are plain JSON: NaN and inf become null.
Absolute paths under the root inside answers (an event's checkpoint path, a verify problem's file) are
sent relative to the root, so the client can pass them back as ``path``.

Errors: HTTP 400 (a bad query argument), 403 (a hidden path), 404 (no such file, key or rank; or outside), 422
(a file that is not what it claims, damaged, or hostile: nothing is ever unpickled), 500 (a bug), each
with the body ``{"error": "<one line: the problem; the fix>"}``.

``GET open?path=P`` -> which view opens P::

    {"path", "name", "is_dir", "view": "checkpoint" | "snapshot" | "run" | "plan" | "time", "format", ...}
    checkpoint: format "workbench" | "dcp" | "hf" | "safetensors" | "torch"; "checkpoint" (the resolved
                checkpoint path: a run dir's latest step), "step", "n_tensors", "total_bytes"
    snapshot:   format "snapshot" (a .pickle) | "profiler" | "timeline"; "bytes"
    run:        "run" (the run directory, also for its events.jsonl), "checkpoints" (if any)
    plan:       "model", "layout", "world_size"
    time:       format "trace" (a *.pt.trace.json[.gz]) | "profile" (a folder of them, or a run's profile/) |
                "step_timeline" (StepTimeline.save); "bytes" for a file
    (a run directory opens as "run"; pass its checkpoints/ to open the checkpoint view)

``GET checkpoint/manifest?path=&offset=0&limit=200&filter=&kind=`` (``filter``: case-insensitive
substring of the key; ``kind``: comma-separated of model, optimizer, master, rng, extra)::

    {"path", "summary": {path, format, step, world_size, layout, layout_description, n_tensors, n_entries,
                         total_bytes, bytes_by_kind: {kind: bytes}, n_params_model, dtypes, n_files},
     "kinds": [...], "shard_map": [{"file", "rank" (null unless DCP), "chunks", "bytes", "bytes_by_kind"}],
     "offset", "limit", "total" (rows after filtering),
     "rows": [{"key", "dtype", "shape" (null for a pickled plain value), "kind", "bytes", "n_shards",
               "ranks": [writer ranks], "shards": [{"file", "rank", "offsets", "lengths"}] (first 64)}],
     "labels": {field: what the views call it} (workbench.checkpoint.labels)}

``GET checkpoint/tensor?path=&key=&bins=64&log=false`` (0 <= bins <= 1000; ``workbench.checkpoint.tensor_stats``,
only that tensor is read, statistics over the finite values; ``log``: the histogram over log10 |x|)::

    {"path", "key", "dtype", "shape", "kind", "bytes", "numel", "min", "max", "mean", "std", "abs_mean", "norm",
     "zeros", "non_finite", "histogram": {"centers": [...], "counts": [...], "width", "scale", "excluded"},
     "labels": {field: label}}

``GET checkpoint/verify?path=&deep=false`` -> ``VerifyReport.to_dict()``::

    {"path", "format", "ok", "problems": [{"file", "problem", "fix", "message"}], "warnings", "checked"}

``GET checkpoint/diff?path=&other=&values=true&top=20`` -> ``CheckpointDiff.to_dict()``, lists capped at 500::

    {"a", "b", "verdict" ("different" | "equal" | "identical" | "not compared"), "banner" (one line: the kinds
     that differ, or what is equal and the kinds only one side holds), "differ_kinds", "only_in_a", "only_in_b"
     ({tensor kind: count}), "identical", "added", "removed" (keys of kinds both hold, on one side only),
     "changed": [{key, kind, a_dtype, a_shape, b_dtype, b_shape}], "n_added", "n_removed", "n_changed",
     "n_compared", "n_equal",
     "top_changes": [{"key", "kind", "max_abs", "rel_norm", "equal"}]}

``GET checkpoint/plan-load?path=&to=dp_shard=2,tp=2&like=&model=&nproc=&full_state=&dtype=&<field>=<value>...``
(any other argument is a layout setting: ``tp=2``, ``pp=2``, ``dp_shard=4`` ...; ``model``: a preset or a
config.json under the root; default the checkpoint's own; ``like``, instead of ``to``: a run directory,
its config.json or a plan JSON under the root, whose layout, and model if recorded, is the target)
-> ``LoadPlan.to_dict()``::

    {"src", "like" (if given), "model", "target", "target_description", "world_size", "source_layout",
     "source_world_size", "loadable", "reasons": [one line each], "layout_error", "missing" (first 200), "n_missing",
     "unexpected" (first 200), "n_unexpected", "reshaped": [{key, checkpoint_shape, target_shape}],
     "dtype_changes", "notes", "checked", "bytes_to_read"}

``GET memory/timeline?path=&t0=&t1=&points=2000&rank=&step=&overlay=&wait=10000`` (``t0``/``t1``: the
window on the x axis, default the whole trace; at most ``points`` points per rank, <= 20000: the min and max
of equal-count bins, plus one point before t0 so the line starts at the right level; ``rank``:
comma-separated, or ``peak`` (the rank with the largest peak), default all; ``step``: that step's events
only; ``overlay``: another memory file under the root, e.g. a saved prediction, drawn dashed). Parsed once
per (path, mtime, size), in a background thread that ``open`` starts, and cached on disk
(``timelines.cache_dir()``). While it is still being read after ``wait`` milliseconds (0..60000), the
answer is at once::

    {"path", "complete": false,
     "progress": {"stage": "reading" | "labelling" | "summarizing", "bytes_read", "bytes_total", "fraction",
                  "elapsed_s",
                  "per_rank": [{"rank", "events_read", "several_devices" (then no line is drawn),
                                "t": [...], "delta_bytes": [...] (allocated minus freed bytes since the trace's
                                first event, of the part read: no base, no categories yet),
                                "max_delta_bytes"}],
                  "palette" (workbench.palette.palette(): a one-rank line is drawn in its total colour)}}

and once read, what ``MemoryTimelineView`` draws of the same timeline (``workbench.jupyter.timelines``)::

    {"path", "complete": true, "parse": {"seconds", "cached"}, "source", "device", "ranks",
     "categories": [8 names], "t_range": [t_min, t_max], "window": [t0, t1], "points", "step", "steps",
     "x": "time" | "step" (the step clock when the overlay's source differs), "x_range",
     "x_axis": {"range", "step", "ticks", "labels", "window_label", "title"} (1-2-5 steps),
     "palette": workbench.palette.palette(), "overlay": {"path", "complete", "source", ...} | null,
     "peaks": [{"rank", "bytes", "t", "step", "phase"}] (every rank),
     "per_rank": [{"rank", "base_bytes", "events", "events_in_window", "title",
                   "t": [...], "x": [...], "total_bytes": [...], "stack": [categories, bottom first],
                   "categories": {category: [...]} (those non-zero),
                   "peak": {"bytes", "t", "step", "phase", "microbatch", "by_category": {...},
                            "alive": [{"id", "bytes", "category", "module", "op", "phase", "t"}] (top 10),
                            "modules": [{"module", "bytes", "count"}] (top 10)},
                   "window_peak": {"bytes", "t", "phase", "step"} | null,
                   "marker": {"kind": "peak" | "step" | "window", "bytes", "t", "x", "phase", "step",
                              "microbatch", "label": [2 lines]} | null,
                   "phases": [{"phase", "step", "microbatch", "t0", "t1", "x0", "x1", "color", "opacity"}],
                   "overlay": {"rank", "source", "step", "x": [...], "total_bytes": [...]} | null,
                   "y_axis": {"unit", "scale", "range", "step", "ticks" (bytes), "labels" (in unit)}}]}

``GET time/timeline?path=&step=&bars=1500`` (``step``: default the last, the steady state; -1 every step;
``bars``: per rank and lane, about, <= 20000; ``workbench.jupyter.steptimes``) -> what ``StepTimelineView``
draws of the same timeline::

    {"path", "source", "device", "ranks", "ranks_shown" (the first 64), "steps", "step", "spans", "spans_shown",
     "categories", "colors" (workbench.palette.TIME_COLORS), "unit": "ms", "step_time_ms",
     "rows": [{"rank", "lane": "compute" | "comm", "label"}],
     "bars": [{"row", "category", "start_ms", "end_ms" (from the shown part's first span), "name", "spans",
               "busy_ms"}] (StepTimeline.bars),
     "totals": [{"rank", "step_ms", <category>: ms per step, "exposed_comm_ms" (with the analysis)}],
     "stragglers": [{"rank", "excess", "straggler"}] | null (without workbench.time.analysis), "meta"}

``GET plan?path=&offset=0&limit=256`` (a plan JSON: ``workbench plan --json`` or ``ShardingPlan.to_json()``)::

    {"path", "summary" (ShardingPlan.summary()), "layout", "parallel", "mesh": {dim: size}, "world_size",
     "categories": ["parameter", "gradient", "optimizer", "master", "total"],
     "offset", "limit", "rows": [{"rank", "coords": {pp, dp_replicate, dp_shard, tp}, <category>: bytes...}],
     "distinct": [{"ranks": "0-3, 8", "count", <category>: bytes...}] (up to 100, largest total first),
     "n_distinct", "comm": [{collective, mesh_dim, phase, bytes_per_rank, calls_per_step, tensor_bytes,
     group_size, stage, what}], "notes", "predicted_peak_bytes" (if the JSON has it)}

``GET run/events?path=&since=0&types=step,checkpoint&limit=5000&points=0`` (``path``: a run directory or
its events.jsonl; ``since``: how many events the client has, in file order; ``types`` filters what is
returned, not what is counted; ``points`` > 0 adds per-rank step series downsampled to that many points)::

    {"path", "total", "since", "next" (pass as since next time; == total when caught up),
     "events": [event objects: type, rank, time, ...], "status": "running" | "succeeded" | "failed" | "stopped",
     "summary": {"status", "model", "layout", "steps_planned", "steps_logged", "first_loss", "final_loss",
                 "last_step", "peak_mem_bytes" (the recorded peak of tensor bytes, largest rank; absent when
                 nothing recorded one), "peak_mem_source", "rss_bytes" (CPU: the process's resident set at
                 step ends, largest; never called a peak), "memory": [{"rank", "stages", "device",
                 "peak_mem_bytes", "peak_step", "peak_source", "rss_bytes"}], "ranks", "checkpoints": [steps],
                 "error": {rank, message}, "skipped_lines" (damaged lines of events.jsonl, skipped),
                 "first_skipped": "line N: why"},
     "series": {rank: {"step": [...], "loss", "tokens_per_s", "step_time_s", "mem_bytes", "peak_mem_bytes",
                       "grad_norm", "lr"}},
     "checkpoints": [{"step", "path", "latest"}] (the step-* directories of RUN_DIR/checkpoints and those its
                    checkpoint events name, under the root: the way in, since JupyterLab's file browser
                    cannot enter a folder named "checkpoints")}
    (a pipeline run's summary also has "pipeline": {"schedule", "microbatches", "stages": [{"stage", "ranks",
    "peak_mem_bytes" (the largest of its ranks'), "rss_bytes"}]}; 422 for an events.jsonl
    none of whose lines is an event)

``GET run/pipeline?path=&step=`` (default: the last step every pipeline rank reported, not the warm-up
step 0 unless it is the only one; 404 for a run with no ``schedule`` events, i.e. pp = 1) -> one step's
measured schedule, from ``workbench.parallel.pipeline_bubble``::

    {"path", "step", "steps": [complete steps], "schedule", "pp", "microbatches", "stages_per_rank",
     "bubble_measured", "bubble_theory", "rows": [{"stage", "rank"}], "span_ms",
     "bars": [{"stage", "rank", "microbatch", "phase": "F" | "B", "start_ms", "end_ms"}] (ms from the
             step's first forward)}
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Callable

from jupyter_server.base.handlers import APIHandler, AuthenticatedFileHandler
from jupyter_server.utils import url_path_join
from tornado import web

from workbench.jupyter import files
from workbench.jupyter.files import Refused
from workbench.safeio import FileRefused, confined_to

try:  # jupyter_server >= 2: the same permission the contents API asks for reading files
    from jupyter_server.auth.decorator import authorized
except ImportError:  # pragma: no cover - older servers: authentication only
    def authorized(method):
        return method

__all__ = ["setup_handlers", "API_PREFIX"]

API_PREFIX = "workbench/api"


class _WorkbenchHandler(APIHandler):
    """Runs ``answer()`` in a thread (parsing a snapshot takes seconds; the server keeps serving) and
    turns every refusal into ``{"error": one line}``."""

    auth_resource = "contents"

    def initialize(self, root: Path) -> None:
        self.root = Path(root).resolve()
        cm = self.settings.get("contents_manager")
        self.allow_hidden = bool(getattr(cm, "allow_hidden", True))

    def answer(self) -> dict[str, Any]:  # pragma: no cover - each route defines it
        raise NotImplementedError

    # -- query arguments --------------------------------------------------------------------------
    def path(self, name: str = "path") -> Path:
        return files.resolve(self.root, self.get_argument(name, None), name, self.allow_hidden)

    def int_arg(self, name: str, default: int, lo: int = 0, hi: int | None = None) -> int:
        v = self.get_argument(name, None)
        return default if v in (None, "") else files.parse_int(v, name, lo, hi)

    def float_arg(self, name: str) -> float | None:
        v = self.get_argument(name, None)
        return None if v in (None, "") else files.parse_float(v, name)

    def bool_arg(self, name: str, default: bool) -> bool:
        v = self.get_argument(name, None)
        return default if v in (None, "") else files.parse_bool(v, name)

    def list_arg(self, name: str) -> list[str] | None:
        v = self.get_argument(name, None)
        return None if not v else [x.strip() for x in v.split(",") if x.strip()]

    # -- the one GET ------------------------------------------------------------------------------
    def confined_answer(self) -> dict[str, Any]:
        """``answer()`` with every file open confined to the root (workbench.safeio): whatever a checkpoint,
        an index, a manifest or a run names, nothing outside the root is opened."""
        with confined_to(self.root):
            try:
                return self.answer()
            except FileRefused as e:  # CheckpointFormatError too, where an answer did not map it itself
                raise files.refusal(e, self.root) from None

    @web.authenticated
    @authorized
    async def get(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            body = await loop.run_in_executor(None, self.confined_answer)
            status = 200
        except Refused as e:
            status, body = e.status, {"error": str(e)}
        except Exception as e:
            user = _user_error(e, self.root)
            if user is not None:  # bad input the answer did not map itself: still a 4xx, never a 500
                status, body = user.status, {"error": str(user)}
            else:  # a bug: still one line, and the traceback goes to the server log
                self.log.exception("workbench: %s failed", self.request.uri)
                status, body = 500, {"error": f"internal error in the workbench server extension: "
                                               f"{type(e).__name__}: {files.first_line(e)}; see the jupyter server log"}
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(files.json_safe(body, self.root), allow_nan=False))


def _user_error(e: Exception, root: Path) -> Refused | None:
    """The 4xx answer for an error that bad input causes (a query that is not UTF-8, a directory where a
    file belongs, a file that cannot be read or parsed), or None for a bug. Paths are sent relative to the
    root; no bytes of any file are echoed."""
    if isinstance(e, web.HTTPError):  # tornado's own refusal, e.g. a query argument that is not UTF-8 (400)
        if e.status_code == 400 and "unicode" in (e.log_message or "").lower():
            return Refused(400, "a query argument is not UTF-8 text; send the query percent-encoded as UTF-8")
        if 400 <= e.status_code < 500:
            return Refused(e.status_code, f"{e.reason or 'bad request'} ({e.status_code}); check the query")
        return None
    if isinstance(e, OSError) and e.errno is not None:
        named = isinstance(e.filename, (str, bytes, os.PathLike)) and files.inside(root, Path(os.fsdecode(e.filename)))
        rel = files.relative(root, Path(os.fsdecode(e.filename))) if named else "a file"  # never one outside
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            return files.not_found(rel)
        if isinstance(e, IsADirectoryError):
            return Refused(400, f"{rel}: is a directory, not a file; pass a file of the kind this view opens")
        if isinstance(e, PermissionError):
            return Refused(403, f"{rel}: the server may not read it (permission denied); check its permissions")
        return Refused(422, f"{rel}: cannot be read ({e.strerror or type(e).__name__}); check the file")
    if isinstance(e, UnicodeDecodeError):
        return Refused(422, "a file is not UTF-8 text where text was expected; the file is damaged or not "
                       "what its name says")
    if isinstance(e, RecursionError):
        return Refused(422, "a file nests too deeply to read; the file is damaged or hostile")
    if isinstance(e, MemoryError):
        return Refused(422, "a file claims sizes too large to read; the file is damaged or hostile")
    return None


def _route(fn: Callable[[_WorkbenchHandler], dict[str, Any]]) -> type[_WorkbenchHandler]:
    """A handler class whose answer is ``fn(handler)``."""
    return type(f"Workbench_{fn.__name__}", (_WorkbenchHandler,), {"answer": fn})


def _open(h: _WorkbenchHandler) -> dict[str, Any]:
    from workbench.jupyter.opening import open_info

    return open_info(h.root, h.path())


def _manifest(h: _WorkbenchHandler) -> dict[str, Any]:
    from workbench.jupyter import checkpoints

    return checkpoints.manifest_page(h.root, h.path(), offset=h.int_arg("offset", 0),
                                     limit=h.int_arg("limit", 200, 1, files.MAX_LIMIT),
                                     filter=h.get_argument("filter", ""), kind=h.get_argument("kind", ""))


def _tensor(h: _WorkbenchHandler) -> dict[str, Any]:
    key = h.get_argument("key", None)
    if not key:
        raise Refused(400, "missing ?key=; pick a key from checkpoint/manifest")
    from workbench.jupyter import checkpoints

    return checkpoints.tensor_answer(h.root, h.path(), key, bins=h.int_arg("bins", 64, 0, files.MAX_BINS),
                                     log=h.bool_arg("log", False))


def _verify(h: _WorkbenchHandler) -> dict[str, Any]:
    from workbench.jupyter import checkpoints

    return checkpoints.verify_answer(h.root, h.path(), deep=h.bool_arg("deep", False))


def _diff(h: _WorkbenchHandler) -> dict[str, Any]:
    from workbench.jupyter import checkpoints

    return checkpoints.diff_answer(h.root, h.path(), h.path("other"), values=h.bool_arg("values", True),
                                   top=h.int_arg("top", 20, 1, 500))


def _plan_load(h: _WorkbenchHandler) -> dict[str, Any]:
    from workbench.jupyter import checkpoints

    args = {k: h.get_argument(k) for k in h.request.arguments}
    return checkpoints.plan_load_answer(h.root, h.path(), args)


def _timeline(h: _WorkbenchHandler) -> dict[str, Any]:
    ranks = h.list_arg("rank")
    step = h.get_argument("step", None)
    overlay = h.get_argument("overlay", None)
    from workbench.jupyter import timelines

    return timelines.timeline_window(h.root, h.path(), h.float_arg("t0"), h.float_arg("t1"),
                                     points=h.int_arg("points", 2000, 4, files.MAX_POINTS),
                                     ranks="peak" if ranks == ["peak"] else None if ranks is None else
                                     [files.parse_int(r, "rank", 0) for r in ranks],
                                     wait=h.int_arg("wait", 10_000, 0, 60_000) / 1000,
                                     step=None if step in (None, "") else files.parse_int(step, "step", -1),
                                     overlay=None if not overlay else h.path("overlay"))


def _time(h: _WorkbenchHandler) -> dict[str, Any]:
    step = h.get_argument("step", None)
    from workbench.jupyter import steptimes

    return steptimes.time_answer(h.root, h.path(), None if step in (None, "") else files.parse_int(step, "step", -1),
                                 bars=h.int_arg("bars", 1500, 10, files.MAX_POINTS))


def _plan(h: _WorkbenchHandler) -> dict[str, Any]:
    from workbench.jupyter import plans

    return plans.plan_table(h.root, h.path(), offset=h.int_arg("offset", 0),
                            limit=h.int_arg("limit", 256, 1, files.MAX_LIMIT))


def _events(h: _WorkbenchHandler) -> dict[str, Any]:
    from workbench.jupyter import runs

    return runs.run_events(h.root, h.path(), since=h.int_arg("since", 0), types=h.list_arg("types"),
                           limit=h.int_arg("limit", 5000, 1, 100_000),
                           points=h.int_arg("points", 0, 0, files.MAX_POINTS))


def _pipeline(h: _WorkbenchHandler) -> dict[str, Any]:
    step = h.get_argument("step", None)
    from workbench.jupyter import runs

    return runs.run_pipeline(h.root, h.path(), None if step in (None, "") else files.parse_int(step, "step", 0))


# Each answer imports its module on the first request (they import numpy, and the checkpoint, plan and run
# readers import torch and pandas), so registering the routes at server start loads none of them.
ROUTES = {
    "open": _open,
    "checkpoint/manifest": _manifest,
    "checkpoint/tensor": _tensor,
    "checkpoint/verify": _verify,
    "checkpoint/diff": _diff,
    "checkpoint/plan-load": _plan_load,
    "memory/timeline": _timeline,
    "time/timeline": _time,
    "plan": _plan,
    "run/events": _events,
    "run/pipeline": _pipeline,
}


class _NotFound(_WorkbenchHandler):
    def answer(self) -> dict[str, Any]:
        raise Refused(404, f"{self.request.path} is no workbench endpoint; use one of "
                      + ", ".join(f"{API_PREFIX}/{r}" for r in ROUTES))


def setup_handlers(web_app: Any, root_dir: str | Path) -> None:
    """Add the routes above to a jupyter_server web application serving ``root_dir``."""
    base = web_app.settings.get("base_url", "/")
    kw = {"root": Path(root_dir).expanduser()}
    handlers = [(url_path_join(base, API_PREFIX, route) + "/?", _route(fn), kw) for route, fn in ROUTES.items()]
    handlers.append((url_path_join(base, API_PREFIX, ".*"), _NotFound, kw))
    # The plotly.js the plotly package ships, for the notebooks' plots (workbench/widgets/plotly_view.js loads
    # it once per page). Only that file; jupyter_server's handler for files behind the login, which caches a
    # versioned URL (PlotView asks for ?v=<plotly.js version>) for good, so a page downloads it once.
    from importlib.util import find_spec

    plotly = Path(find_spec("plotly").origin).parent  # found, not imported: the server starts without it
    handlers.append((url_path_join(base, r"workbench/static/(plotly\.min\.js)"), AuthenticatedFileHandler,
                     {"path": str(plotly / "package_data")}))
    web_app.add_handlers(".*$", handlers)
