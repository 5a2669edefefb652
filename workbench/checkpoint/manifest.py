"""``CheckpointManifest``: what a checkpoint holds, as one DataFrame read from metadata and headers only.

One row per entry of the checkpoint's (flattened) state dict::

    key                                   dtype    shape        bytes    kind       shards
    model.layers.0.attention.wq.weight    float32  (128, 128)   65536    model      [{file: __0_0.distcp, rank: 0,
                                                                                      offsets: [0, 0], lengths: [64, 128]},
                                                                                     {file: __1_0.distcp, rank: 1,
                                                                                      offsets: [64, 0], lengths: [64, 128]}]
    optim.state.layers.0...exp_avg        float32  (128, 128)   65536    optimizer  [...]

``shape`` is the *global* shape and ``bytes`` the global size (numel x itemsize); each shard is one block
``[offsets, offsets + lengths)`` of that global tensor, stored in ``file`` (written by ``rank`` for DCP).
The shards of a complete checkpoint tile the global shape exactly (see :func:`workbench.checkpoint.verify`).

Kinds follow the workbench key contract (first dotted component), with heuristics for other tools' keys:

    model.*  -> model        optim.* -> optimizer     master.* -> master     rng.* -> rng
    ema.*    -> extra (a second copy of the weights, kept out of "model" so model bytes = model size)
    sched.*, extra.*, anything else non-tensor -> extra
    other tensors: "optim"/"exp_avg"/"momentum" -> optimizer, "rng"/"generator" -> rng,
                   "master" -> master, else model

Optimizer hyper-parameters (``optim.param_groups.<fqn>.lr`` ...: torch's flattened optimizer state repeats
each group's ``lr, betas, eps, ...`` under every parameter) are entries of kind ``optimizer`` too, but they
are not counted as tensors: :func:`is_hyperparameter` names them, ``summary()`` counts them apart, and
:mod:`workbench.checkpoint.param_groups` folds them into one row per param group for listings. Saves now
pack them (``optim.hyper.<digest>``: every parameter's values as JSON in one uint8 tensor): such an item is
one entry however many values it holds, so ``summary()`` counts stored entries
(``n_hyperparameters``) and packed items (``n_packed_hyperparameter_items``), never values (the metadata
does not have them; ``param_groups`` reads them).
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.display import RendersInNotebook
from workbench.kinds import CHECKPOINT_KINDS, PREFIX_KIND
from workbench.units import format_bytes

__all__ = ["CheckpointManifest", "KINDS", "classify", "is_hyperparameter"]

KINDS = CHECKPOINT_KINDS  # see workbench.kinds
_OPTIM_WORDS = re.compile(r"(^|[._])(optim|optimizer|exp_avg|exp_avg_sq|momentum_buffer|param_groups)([._]|$)")
_RNG_WORDS = re.compile(r"(^|[._])(rng|rng_state|generator|random)([._]|$)")
_MASTER_WORDS = re.compile(r"(^|[._])(master|master_weights|fp32_params)([._]|$)")
_SCHED_WORDS = re.compile(r"(^|[._])(lr_scheduler|scheduler|sched)([._]|$)")
_HYPER = re.compile(r"(^|\.)param_groups(\.|$)")


def is_hyperparameter(key: str) -> bool:
    """Whether ``key`` is an optimizer hyper-parameter (anything under a ``param_groups`` component), or a
    packed set of them (``optim.hyper.<digest>``: JSON bytes, see :mod:`workbench.checkpoint.state`)."""
    return bool(_HYPER.search(key)) or key.startswith("optim.hyper.")


def classify(key: str, is_tensor: bool = True) -> str:
    """The kind of a flattened state-dict key (see the module docstring for the rules)."""
    first = key.split(".", 1)[0]
    if first in PREFIX_KIND:
        return PREFIX_KIND[first]
    low = key.lower()
    if _OPTIM_WORDS.search(low):
        return "optimizer"
    if _RNG_WORDS.search(low):
        return "rng"
    if _MASTER_WORDS.search(low):
        return "master"
    if _SCHED_WORDS.search(low):
        return "extra"
    return "model" if is_tensor else "extra"


@dataclass
class CheckpointManifest(RendersInNotebook):
    """What a checkpoint holds. Build one with :func:`workbench.checkpoint.inspect`.

    ``frame`` has the columns ``key, dtype, shape, bytes, kind, shards`` (see the module docstring).
    ``format`` is one of ``workbench`` (a step directory with workbench.json), ``dcp``, ``hf`` (sharded
    safetensors with an index), ``safetensors`` (one file or a directory of files) and ``torch``.
    """

    path: Path
    format: str
    frame: pd.DataFrame
    info: dict[str, Any] = field(default_factory=dict)  # workbench.json (or an index's metadata)
    files: list[str] = field(default_factory=list)  # data files, relative to path (or path itself)

    COLUMNS = ("key", "dtype", "shape", "bytes", "kind", "shards")

    # ---- facts -----------------------------------------------------------------------------------
    @property
    def step(self) -> int | None:
        s = self.info.get("step")
        return None if s is None else int(s)

    @property
    def layout(self) -> dict[str, Any] | None:
        return self.info.get("layout")

    @property
    def world_size(self) -> int | None:
        ws = self.info.get("world_size")
        if ws is None and self.format in ("dcp", "workbench"):
            ranks = {s["rank"] for shards in self.frame["shards"] for s in shards if s.get("rank") is not None}
            ws = max(ranks) + 1 if ranks else None
        return ws

    @property
    def keys(self) -> list[str]:
        return list(self.frame["key"])

    def __len__(self) -> int:
        return len(self.frame)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    @property
    def _index(self) -> dict[str, int]:
        if not hasattr(self, "_key_index"):
            self._key_index = {k: i for i, k in enumerate(self.frame["key"])}
        return self._key_index

    def row(self, key: str) -> dict[str, Any]:
        """One entry as a dict; KeyError naming close matches if the key is not in the checkpoint."""
        i = self._index.get(key)
        if i is None:
            import difflib

            close = difflib.get_close_matches(key, self.keys, n=3)
            raise KeyError(f"{key!r} is not in {self.path}" + (f"; did you mean {close}?" if close else ""))
        return self.frame.iloc[i].to_dict()

    def tensors(self) -> pd.DataFrame:
        """The rows that are tensors (DCP also stores plain values: learning rates, step counters).

        Hyper-parameters saved as 0-d tensors are rows here (they are read, exported and loaded like any
        tensor); :meth:`hyperparameters` names them, and ``summary()`` does not count them as tensors."""
        return self.frame[self.frame["shape"].map(lambda s: s is not None)]

    def hyperparameters(self) -> pd.DataFrame:
        """The optimizer hyper-parameter rows (``...param_groups...``), tensors or pickled values."""
        return self.frame[self.frame["key"].map(is_hyperparameter)]

    # ---- views -----------------------------------------------------------------------------------
    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def shards(self) -> pd.DataFrame:
        """One row per stored block: ``key, kind, file, rank, offsets, lengths, bytes, byte_offset, byte_length``."""
        rows = []
        for r in self.frame.itertuples(index=False):
            itemsize = (r.bytes // max(1, _numel(r.shape))) if r.shape is not None else 1
            for s in r.shards:
                rows.append({"key": r.key, "kind": r.kind, "file": s["file"], "rank": s.get("rank"),
                             "offsets": list(s["offsets"]), "lengths": list(s["lengths"]),
                             "bytes": _numel(s["lengths"]) * itemsize if r.shape is not None else r.bytes,
                             "byte_offset": s.get("byte_offset"), "byte_length": s.get("byte_length")})
        cols = ["key", "kind", "file", "rank", "offsets", "lengths", "bytes", "byte_offset", "byte_length"]
        return pd.DataFrame(rows, columns=cols)

    @property
    def n_tensors(self) -> int:
        """Tensors proper (weights, moments, RNG states...): entries with a shape that are not optimizer
        hyper-parameters. The one count that inspect, verify and the views all show."""
        t = self.tensors()
        return int(len(t) - t["key"].map(is_hyperparameter).astype(bool).sum())

    @property
    def n_hyperparameters(self) -> int:
        """Stored optimizer hyper-parameter entries (per-key values, or packed ``optim.hyper.*`` items)."""
        return int(self.frame["key"].map(is_hyperparameter).astype(bool).sum())

    def summary(self) -> dict[str, Any]:
        """Bytes by kind, counts, step and layout: the facts a person asks first."""
        t = self.tensors()
        by_kind = {k: int(t.loc[t["kind"] == k, "bytes"].sum()) for k in KINDS if (t["kind"] == k).any()}
        layout = self.layout
        describe = None
        if layout:
            try:
                from workbench.config import ParallelConfig

                describe = ParallelConfig.from_dict(layout).describe()
            except (ValueError, TypeError):
                describe = None
        return {
            "path": str(self.path), "format": self.format, "step": self.step, "world_size": self.world_size,
            "layout": layout, "layout_description": describe,
            # tensors proper (weights, moments, RNG states...): a hyper-parameter saved as a 0-d tensor is
            # counted under n_hyperparameters, not here
            "n_tensors": self.n_tensors, "n_hyperparameters": self.n_hyperparameters,
            "n_packed_hyperparameter_items": int(sum(str(k).startswith("optim.hyper.") for k in self.frame["key"])),
            "n_entries": int(len(self.frame)), "total_bytes": int(t["bytes"].sum()),
            "bytes_by_kind": by_kind, "n_params_model": int(sum(_numel(s) for s in t.loc[t["kind"] == "model", "shape"])),
            "dtypes": sorted(set(t["dtype"])), "n_files": len(self.files),
            "quant": self.quant,
        }

    @property
    def quant(self) -> dict[str, Any] | None:
        """What of the optimizer state is stored quantized (workbench.json's ``quant``), or None."""
        q = self.info.get("quant")
        return q if isinstance(q, dict) and q.get("mode", "none") != "none" and q.get("keys") else None

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.frame.itertuples(index=False):
            rows.append({"key": r.key, "dtype": r.dtype, "shape": None if r.shape is None else list(r.shape),
                         "bytes": int(r.bytes), "kind": r.kind, "shards": r.shards})
        return {"summary": self.summary(), "tensors": rows}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    # ---- notebook --------------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        s = self.summary()
        kinds = "".join(f"<tr><td>{k}</td><td style='text-align:right'>{format_bytes(b)}</td></tr>"
                        for k, b in s["bytes_by_kind"].items())
        head = (f"<b>CheckpointManifest</b> <code>{html.escape(s['path'])}</code> ({s['format']})<br>"
                f"step {s['step']} &middot; {s['n_tensors']} tensors"
                + "".join(f" + {w}" for w in _hyper_words(s))
                + f" &middot; {format_bytes(s['total_bytes'])}"
                + (f" &middot; layout {html.escape(s['layout_description'])}" if s["layout_description"] else "")
                + (f" &middot; {s['world_size']} ranks" if s["world_size"] else ""))
        if s["quant"]:
            from workbench.checkpoint.quant import describe

            head += f"<br>{html.escape(describe(s['quant']))}"
        table = self.frame[["key", "dtype", "shape", "bytes", "kind"]].head(40).to_html(index=False)
        more = f"<i>... {len(self.frame) - 40} more rows (to_frame())</i>" if len(self.frame) > 40 else ""
        return f"<div>{head}<table>{kinds}</table>{table}{more}</div>"

    # In a notebook a manifest shows as its registered view (workbench.widgets' CheckpointBrowser), or
    # as _repr_html_ where ipywidgets are missing: RendersInNotebook._ipython_display_, workbench.display.

    def __repr__(self) -> str:
        s = self.summary()
        return (f"CheckpointManifest({str(self.path)!r}, format={self.format!r}, step={s['step']}, "
                f"tensors={s['n_tensors']}, hyperparameter_entries={s['n_hyperparameters']}, "
                f"bytes={format_bytes(s['total_bytes'])}, by_kind="
                + "{" + ", ".join(f"{k}: {format_bytes(b)}" for k, b in s["bytes_by_kind"].items()) + "})")


def _hyper_words(s: dict[str, Any]) -> list[str]:
    """The hyper-parameter entries of a summary in words true for both storage formats: per-key entries
    (one value each) and packed items (JSON, any number of values) counted apart."""
    packed = s.get("n_packed_hyperparameter_items", 0)
    entries = s["n_hyperparameters"] - packed
    out = []
    if entries:
        out.append(f"{entries} optimizer hyper-parameter entr{'ies' if entries != 1 else 'y'}")
    if packed:
        out.append(f"optimizer hyper-parameters packed in {packed} JSON item{'s' if packed != 1 else ''}")
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape or ():
        n *= int(d)
    return n
