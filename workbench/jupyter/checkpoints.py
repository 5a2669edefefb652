"""Checkpoint answers: a page of the key table, one tensor's statistics, verify, diff, the load dry run.

A checkpoint is inspected once per (path, stamp) and kept with its tensor source, so paging, filtering
and reading tensor after tensor reuse the metadata. Only files under the root are read: a ``.metadata``,
an index or a ``latest`` pointer that names a file outside is refused.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from workbench.checkpoint.labels import LABELS, labels_for
from workbench.jupyter.files import (FileCache, Refused, first_line, inside, json_safe, not_found, parse_bool,
                                     parse_int, parse_scalar, read_json, refusal, relative, resolve, stamp)
from workbench.safeio import FileRefused, confine

__all__ = ["manifest_of", "manifest_page", "tensor_answer", "verify_answer", "diff_answer", "plan_load_answer"]

MAX_SHARDS_PER_ROW = 64

_CHECKPOINTS = FileCache(8)


class _Opened:
    def __init__(self, manifest: Any):
        self.manifest = manifest
        self.source = None
        self.lock = threading.RLock()
        self.shard_map: list[dict] | None = None

    def tensor_source(self):
        from workbench.checkpoint.formats import open_source

        with self.lock:
            if self.source is None:
                self.source = open_source(self.manifest)
            return self.source


def _checkpoint_error(e: Exception, root: Path) -> Refused:
    return refusal(e, root)  # 404 for a file missing or outside (the same answer), else 422


def _opened(root: Path, p: Path) -> _Opened:
    from workbench.checkpoint.contents import identify, inspect

    try:
        fmt, where = identify(p)
    except FileRefused as e:  # CheckpointFormatError too
        raise _checkpoint_error(e, root) from None
    except OSError as e:  # a directory that cannot be listed
        raise Refused(422, f"{relative(root, p)}: cannot be read ({e.strerror or type(e).__name__}); check its "
                      "permissions") from None
    if not inside(root, where):  # (the reads were confined to the root: this is a second look at the result)
        raise not_found(relative(root, p))

    def make() -> _Opened:
        try:
            m = inspect(where)
        except FileRefused as e:  # CheckpointFormatError too
            raise _checkpoint_error(e, root) from None
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:  # torch.load's own refusals
            raise Refused(422, f"{relative(root, where)}: cannot be read as a {fmt} checkpoint "
                          f"({first_line(e)}); check that the save finished") from None
        base = m.path if m.path.is_dir() else m.path.parent
        for f in m.files:  # the readers confined every name to the checkpoint's directory; a second look
            if not inside(root, base / f):
                raise Refused(404, f"{relative(root, m.path)}: names data file {f!r} outside the server's root; "
                              "refusing to read it")
        return _Opened(m)

    return _CHECKPOINTS.get((str(where), stamp(where)), make)


def manifest_of(root: Path, p: Path):
    return _opened(root, p).manifest


def _shard_map(m) -> list[dict]:
    """Bytes and chunks per (rank, file): the checkpoint's shard map."""
    sh = m.shards()
    if sh.empty:
        return []
    sh = sh.assign(rank=sh["rank"].astype("object").where(sh["rank"].notna(), None))
    g = sh.groupby(["file"], dropna=False)
    out = []
    for file, part in g:
        file = file[0] if isinstance(file, tuple) else file
        ranks = sorted({int(r) for r in part["rank"] if r is not None})
        out.append({"file": file, "rank": ranks[0] if len(ranks) == 1 else None, "chunks": int(len(part)),
                    "bytes": int(part["bytes"].sum()),
                    "bytes_by_kind": {k: int(v) for k, v in part.groupby("kind")["bytes"].sum().items()}})
    return sorted(out, key=lambda r: (r["rank"] is None, r["rank"] or 0, str(r["file"])))


def manifest_page(root: Path, p: Path, offset: int = 0, limit: int = 200, filter: str = "",
                  kind: str = "") -> dict[str, Any]:
    o = _opened(root, p)
    m = o.manifest
    with o.lock:
        if o.shard_map is None:
            o.shard_map = _shard_map(m)
    frame = m.frame
    if kind:
        kinds = {k.strip() for k in kind.split(",") if k.strip()}
        frame = frame[frame["kind"].isin(kinds)]
    if filter:
        frame = frame[frame["key"].str.contains(filter, case=False, regex=False)]
    total = len(frame)
    page = frame.iloc[offset: offset + limit]
    rows = []
    for r in page.itertuples(index=False):
        shards = list(r.shards)
        rows.append({"key": r.key, "dtype": r.dtype, "shape": None if r.shape is None else list(r.shape),
                     "kind": r.kind, "bytes": int(r.bytes), "n_shards": len(shards),
                     "ranks": sorted({s["rank"] for s in shards if s.get("rank") is not None}),
                     "shards": [{"file": s["file"], "rank": s.get("rank"), "offsets": list(s["offsets"]),
                                 "lengths": list(s["lengths"])} for s in shards[:MAX_SHARDS_PER_ROW]]})
    summary = m.summary()
    summary["path"] = relative(root, m.path)
    columns = ("key", "dtype", "shape", "kind", "bytes", "n_shards", "file", "rank", "chunks", "offsets", "lengths")
    return {"path": relative(root, m.path), "summary": summary, "kinds": sorted(set(m.frame["kind"])),
            "shard_map": o.shard_map, "offset": offset, "limit": limit, "total": total, "rows": rows,
            "labels": labels_for([*summary, *columns])}


def tensor_answer(root: Path, p: Path, key: str, bins: int = 64, log: bool = False) -> dict[str, Any]:
    """One tensor's statistics and histogram (``log``: over log10 |x|), with the labels of its fields."""
    from workbench.checkpoint.stats import tensor_stats

    o = _opened(root, p)
    m = o.manifest
    stored = key
    if key not in m:  # a canonical name (model.layers.0...) of a tensor stored under another (an export's)
        try:
            stored = o.tensor_source().keys.get(key, key)
        except FileRefused as e:  # CheckpointFormatError too
            raise _checkpoint_error(e, root) from None
    try:
        row = m.row(stored)
    except KeyError as e:
        raise Refused(404, f"{e.args[0]}; pick a key from checkpoint/manifest") from None
    if row["shape"] is None:
        raise Refused(422, f"{key!r} is a {row['dtype']} value, not a tensor: it is stored pickled and is not "
                      "read; pick a tensor key")
    try:
        with o.lock:  # one reader per checkpoint at a time: sources keep open file handles
            stats = tensor_stats(o.tensor_source(), key, bins=bins, log=log)
    except FileRefused as e:  # CheckpointFormatError too
        raise _checkpoint_error(e, root) from None
    except KeyError as e:
        raise Refused(404, f"{e.args[0] if e.args else key}; pick a key from checkpoint/manifest") from None
    except (OSError, RuntimeError, ValueError) as e:
        raise Refused(422, f"{key}: cannot be read ({first_line(e)}); run checkpoint/verify") from None
    stats["shape"] = list(row["shape"])
    stats["kind"] = row["kind"]
    stats["bytes"] = int(row["bytes"])
    stats["path"] = relative(root, m.path)
    stats["labels"] = labels_for(stats)
    return stats


def verify_answer(root: Path, p: Path, deep: bool = False) -> dict[str, Any]:
    from workbench.checkpoint.verify import verify

    m = manifest_of(root, p)
    listed = m.info.get("files") if m.format == "workbench" else None
    for f in listed if isinstance(listed, dict) else ():  # verify confines them too; refused here as a whole
        if not inside(root, m.path / str(f)):
            raise Refused(404, f"{relative(root, m.path)}/workbench.json lists {str(f)[:200]!r}, outside the "
                          "server's root; refusing to read it")
    return {**verify(m.path, deep=deep, progress=False).to_dict(), "labels": LABELS}


def diff_answer(root: Path, a: Path, b: Path, values: bool = True, top: int = 20) -> dict[str, Any]:
    from workbench.checkpoint.diff import diff

    ma, mb = manifest_of(root, a), manifest_of(root, b)
    d = diff(ma, mb, values=values, progress=False).to_dict(top)
    cap = 500
    for k in ("added", "removed", "changed"):
        d[f"n_{k}"] = len(d[k])
        d[k] = d[k][:cap]
    d["a"], d["b"] = relative(root, ma.path), relative(root, mb.path)
    d["labels"] = LABELS
    return d


_PLAN_LOAD_KEYS = ("to", "model", "nproc", "full_state", "dtype", "like")


def _target_of(root: Path, like: str) -> tuple[dict, dict | None]:
    """``(parallel, model)`` of what ``like`` names: a run directory or the config.json workbench.launch
    writes (its layout and model), or a plan JSON (``workbench plan --json``: its layout, and its model if
    recorded)."""
    p = resolve(root, like, "like")
    rel = relative(root, p)
    try:  # a run directory's config.json is its own file, not a link out of the run (or the root)
        f = confine(p, "config.json", p, "run config") if p.is_dir() else p
    except FileRefused:
        raise not_found(f"{rel}/config.json") from None
    if not f.is_file() or f.suffix != ".json":
        raise Refused(422, f"{rel}: not a run directory, config.json or plan JSON; pick a run directory "
                      "(workbench.launch / workbench train) or a plan written by `workbench plan --json`")
    doc = read_json(f)
    parallel = doc.get("parallel") if isinstance(doc, dict) else None
    if not isinstance(parallel, dict):
        raise Refused(422, f"{relative(root, f)}: has no 'parallel' layout; pick a run directory, its config.json "
                      "or a plan written by `workbench plan --json`")
    model = doc.get("model")
    return parallel, model if isinstance(model, dict) else None


def plan_load_answer(root: Path, p: Path, args: dict[str, str]) -> dict[str, Any]:
    from workbench.checkpoint.plan_load import plan_load
    from workbench.config import PRESETS

    m = manifest_of(root, p)
    kw: dict[str, Any] = {}
    model = args.get("model") or None
    if model is not None and model not in PRESETS:
        model = str(resolve(root, model, "model"))  # a config.json under the root
    if args.get("nproc"):
        kw["nproc"] = parse_int(args["nproc"], "nproc")
    if args.get("full_state"):
        kw["full_state"] = parse_bool(args["full_state"], "full_state")
    if args.get("dtype"):
        kw["dtype"] = args["dtype"]
    # A bare number as a name is a browser's cache-buster (JupyterLab's requests add one), not a setting.
    layout = {k: parse_scalar(v) for k, v in args.items()
              if k not in _PLAN_LOAD_KEYS and k != "path" and not k.isdigit()}
    to: Any = args.get("to") or None
    if args.get("like"):  # the layout (and model) of a run or a plan the user picked
        if to is not None:
            raise Refused(400, "both ?to= and ?like= given; pass one: a layout, or a run directory or plan JSON")
        to, like_model = _target_of(root, args["like"])
        if model is None and like_model is not None:
            model = like_model
    try:
        plan = plan_load(m, to=to, model=model, **kw, **layout)
    except (ValueError, TypeError, KeyError) as e:
        raise Refused(400, json_safe(first_line(e), root)) from None
    d = plan.to_dict()
    d["src"] = relative(root, m.path)
    if args.get("like"):
        d["like"] = args["like"]
    d["n_unexpected"] = len(d["unexpected"])
    d["unexpected"] = d["unexpected"][:200]
    d["n_missing"] = len(d["missing"])
    d["missing"] = d["missing"][:200]
    d["labels"] = LABELS
    return d
