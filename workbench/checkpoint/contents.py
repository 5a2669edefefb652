"""``inspect(path)``: any checkpoint -> :class:`CheckpointManifest`, from metadata and headers only.

Accepted paths, and what they resolve to::

    runs/r1                                a run directory       -> runs/r1/checkpoints/latest
    runs/r1/checkpoints                    a checkpoints dir     -> the step named in ``latest`` (else the newest)
    runs/r1/checkpoints/latest             the pointer file      -> runs/r1/checkpoints/step-000123
    runs/r1/checkpoints/step-000123        a workbench step dir  (DCP + workbench.json)
    some/dcp_dir                           plain DCP (.metadata + __<rank>_<i>.distcp)
    hf_dir/                                sharded safetensors with *.safetensors.index.json
    model.safetensors | dir of *.safetensors
    model.pt                               a torch.save zip archive (weights_only)

No tensor data is read: a 70B checkpoint inspects as fast as a tiny one.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from workbench import safeio
from workbench.checkpoint.manifest import CheckpointManifest, classify
from workbench.checkpoint.store import LATEST, CheckpointStore, resolve_checkpoint
from workbench.checkpoint.safeload import (SAFETENSORS_DTYPES, CheckpointFormatError, is_zip_archive,
                                           read_dcp_metadata, read_safetensors_header, read_torch_file)

__all__ = ["inspect", "identify", "dcp_file_rank", "read_hf_index"]

_DISTCP = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_NOT_A_CHECKPOINT = ("pass a run directory, its checkpoints/ directory, a step-NNNNNN directory, a DCP directory, "
                     "a directory with *.safetensors(.index.json), a .safetensors file or a torch.save file")


def dcp_file_rank(name: str) -> int | None:
    """The writer rank of a DCP data file: ``__<rank>_<i>.distcp`` -> rank."""
    m = _DISTCP.match(Path(name).name)
    return int(m.group(1)) if m else None


def identify(path: str | os.PathLike) -> tuple[str, Path]:
    """``(format, path)`` for any accepted path (see the module docstring); CheckpointFormatError if none."""
    p = Path(path)
    if not p.exists():
        raise CheckpointFormatError(p, "no such file or directory", "check the path", reason="missing")
    if not p.is_dir():
        safeio.regular_size(p, "checkpoint file", error=CheckpointFormatError)  # a FIFO or device: refused
    if p.is_file():
        if p.name == "latest":  # the step it names, next to it (CheckpointStore reads and checks the pointer)
            target = CheckpointStore(p.parent).newest_any()
            if target is None:
                raise CheckpointFormatError(p, "names no step directory", "pass one of the step-* directories "
                                            "next to it")
            return identify(target)
        if p.name == ".metadata":
            return identify(p.parent)
        if p.name.endswith(".safetensors.index.json"):
            return "hf", p.parent
        if p.suffix == ".safetensors":
            return "safetensors", p
        if p.name == "workbench.json":
            return identify(p.parent)
        if is_zip_archive(p):
            return "torch", p
        with safeio.open_regular(p, "checkpoint file", error=CheckpointFormatError) as f:
            head = f.read(8)
        if len(head) == 8 and int.from_bytes(head, "little") < p.stat().st_size:  # an unsuffixed safetensors?
            try:
                read_safetensors_header(p)
                return "safetensors", p
            except CheckpointFormatError:
                pass
        raise CheckpointFormatError(p, "not a checkpoint file (neither safetensors nor a torch.save zip)",
                                    _NOT_A_CHECKPOINT)
    if (p / ".metadata").exists():
        return ("workbench" if (p / "workbench.json").exists() else "dcp"), p
    if any(p.glob("*.safetensors.index.json")):
        return "hf", p
    if (p / "checkpoints").is_dir() or (p / LATEST).is_file() or CheckpointStore(p).steps():
        try:  # the one walk from a run dir to a step dir, lenient: a damaged checkpoint is still shown
            return identify(resolve_checkpoint(p, complete=False))
        except CheckpointFormatError:
            raise
        except ValueError:
            raise CheckpointFormatError(p, "no step directory there holds a .metadata",
                                        "the saves did not finish; pass a complete step-NNNNNN directory") from None
    if any(p.glob("*.safetensors")):
        return "safetensors", p
    if any(_DISTCP.match(f.name) for f in p.iterdir()):
        raise CheckpointFormatError(p / ".metadata", "no such file (the directory has .distcp shards but no "
                                    ".metadata)", "the save did not finish; use an earlier step")
    raise CheckpointFormatError(p, "not a checkpoint directory", _NOT_A_CHECKPOINT)


def _row(key: str, dtype: str, shape, nbytes: int, kind: str, shards: list[dict]) -> dict[str, Any]:
    return {"key": key, "dtype": dtype, "shape": None if shape is None else tuple(int(s) for s in shape),
            "bytes": int(nbytes), "kind": kind, "shards": shards}


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(CheckpointManifest.COLUMNS))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------
# readers per format
# --------------------------------------------------------------------------------------------------

def _read_dcp(root: Path) -> tuple[list[dict], list[str]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_dcp_metadata(root)
    storage = {}
    for idx, info in md.storage_data.items():
        storage[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] = info
    rows = []
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            shape = tuple(meta.size)
            dtype = meta.properties.dtype
            shards = []
            for chunk in meta.chunks:
                info = storage.get((fqn, tuple(chunk.offsets)))
                shards.append({"file": None if info is None else info.relative_path,
                               "rank": None if info is None else dcp_file_rank(info.relative_path),
                               "offsets": [int(o) for o in chunk.offsets], "lengths": [int(s) for s in chunk.sizes],
                               "byte_offset": None if info is None else int(info.offset),
                               "byte_length": None if info is None else int(info.length)})
            rows.append(_row(fqn, _dtype_name(dtype), shape, math.prod(shape) * dtype.itemsize,
                             classify(fqn, True), shards))
        else:  # BytesStorageMetadata: a pickled plain value (lr, step counter, ...), never unpickled here
            info = storage.get((fqn, None))
            shards = [] if info is None else [{"file": info.relative_path, "rank": dcp_file_rank(info.relative_path),
                                              "offsets": [], "lengths": [], "byte_offset": int(info.offset),
                                              "byte_length": int(info.length)}]
            rows.append(_row(fqn, "bytes", None, 0 if info is None else info.length, classify(fqn, False), shards))
    files = sorted({info.relative_path for info in md.storage_data.values()})
    return rows, files


def _safetensors_rows(file: Path, rel: str) -> tuple[list[dict], dict[str, str]]:
    """The rows of one safetensors file, and its ``__metadata__`` (one read of its header)."""
    header, start = read_safetensors_header(file)
    names = {code: _dtype_name(dtype) for code, dtype in SAFETENSORS_DTYPES.items()}
    rows = []
    for key, e in header.items():
        if key == "__metadata__":
            continue
        shape = tuple(e["shape"])  # checked by read_safetensors_header: non-negative ints
        b, end = e["data_offsets"]
        shards = [{"file": rel, "rank": None, "offsets": [0] * len(shape), "lengths": list(shape),
                   "byte_offset": start + b, "byte_length": end - b}]
        rows.append({"key": key, "dtype": names[e["dtype"]], "shape": shape, "bytes": end - b,
                     "kind": classify(key, True), "shards": shards})
    return rows, header.get("__metadata__") or {}


def read_hf_index(index: Path) -> dict[str, Any]:
    """An HF ``*.safetensors.index.json`` (inside its directory, a regular file of at most
    ``safeio.INDEX_MAX`` bytes), checked: ``weight_map`` maps key names to file names, ``metadata`` is an
    object. The file names are not yet checked against the directory (the reader confines each)."""
    fix = "re-export the checkpoint"
    doc = safeio.read_json(safeio.confine(index.parent, index.name, what="index", error=CheckpointFormatError),
                           safeio.INDEX_MAX, "safetensors index", error=CheckpointFormatError, fix=fix)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFormatError(index, "not a safetensors index (needs a JSON object with a weight_map of "
                                    "file names)", fix)
    if not isinstance(doc.get("metadata") or {}, dict):
        raise CheckpointFormatError(index, "its metadata is not a JSON object", fix)
    return doc


def _read_hf(root: Path) -> tuple[list[dict], list[str], dict]:
    rows, files, info = [], [], {}
    for index in sorted(root.glob("*.safetensors.index.json")):
        doc = read_hf_index(index)
        weight_map = doc["weight_map"]
        meta = doc.get("metadata") or {}
        for k in ("step", "layout", "world_size", "source", "names", "model"):
            want = _INFO_TYPES.get(k, str)  # another tool's index may hold other facts under these names: skipped
            if k in meta and k not in info and isinstance(meta[k], want) and not isinstance(meta[k], bool):
                info[k] = meta[k]
        listed = set()
        # every shard name checked by its text before any is opened: an index naming /etc/shadow or ../x is
        # refused whether that exists or not, and no file is read before the whole index passes
        names = sorted(set(weight_map.values()))
        for rel in names:
            safeio.check_name(rel, index, "shard", error=CheckpointFormatError)
        for rel in names:
            f = safeio.confine(root, rel, index, "shard", error=CheckpointFormatError)
            if not f.exists():
                raise CheckpointFormatError(f, f"listed in {index.name} but missing", "copy the missing shard file "
                                            "next to the index, or re-export", reason="missing")
            shard_rows, _ = _safetensors_rows(f, rel)
            for r in shard_rows:
                if weight_map.get(r["key"]) == rel:
                    rows.append(r)
                    listed.add(r["key"])
            files.append(rel)
        missing = sorted(set(weight_map) - listed)
        if missing:
            raise CheckpointFormatError(index, f"{len(missing)} key(s) of the weight_map are in no shard "
                                        f"(first: {missing[0]!r})", "re-export the checkpoint")
    return rows, files, info


def _read_torch(path: Path) -> list[dict]:
    rows = []
    for key, value in read_torch_file(path).items():
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            shards = [{"file": path.name, "rank": None, "offsets": [0] * len(shape), "lengths": list(shape),
                       "byte_offset": None, "byte_length": None}]
            rows.append(_row(key, _dtype_name(value.dtype), shape, value.numel() * value.element_size(),
                             classify(key, True), shards))
        else:
            rows.append(_row(key, type(value).__name__, None, 0, classify(key, False), []))
    return rows


def inspect(path: "str | os.PathLike | CheckpointManifest") -> CheckpointManifest:
    """What is in the checkpoint at ``path``: a :class:`CheckpointManifest` (metadata and headers only)."""
    if isinstance(path, CheckpointManifest):
        return path
    fmt, root = identify(path)
    info: dict[str, Any] = {}
    if fmt in ("workbench", "dcp"):
        rows, files = _read_dcp(root)
        if fmt == "workbench":
            manifest = safeio.confine(root, "workbench.json", what="manifest", error=CheckpointFormatError)
            info = safeio.read_json(manifest, safeio.MANIFEST_MAX, "checkpoint manifest", error=CheckpointFormatError,
                                    fix="the file is corrupted; restore it or use another step")
            if not isinstance(info, dict):
                raise CheckpointFormatError(manifest, f"holds a JSON {type(info).__name__}, not an object",
                                            "the file is corrupted; restore it or use another step")
            if info.get("format") != "workbench-checkpoint":
                raise CheckpointFormatError(root / "workbench.json", f"format={str(info.get('format'))[:40]!r} is not "
                                            "'workbench-checkpoint'", "remove the file to read the directory as "
                                            "plain DCP")
    elif fmt == "hf":
        rows, files, info = _read_hf(root)
    elif fmt == "safetensors":
        paths = [root] if root.is_file() else sorted(root.glob("*.safetensors"))
        rows, files = [], []
        for f in paths:
            rel = f.name
            if root.is_dir():  # a file of the directory, not a link out of it
                safeio.confine(root, rel, what="safetensors file", error=CheckpointFormatError)
            file_rows, meta = _safetensors_rows(f, rel)
            rows += file_rows
            files.append(rel)
            if root.is_file():
                if re.fullmatch(r"[0-9]{1,18}", meta.get("step", "")):
                    info["step"] = int(meta["step"])
                if meta.get("names") in ("workbench", "hf-llama"):
                    info["names"] = meta["names"]
                try:
                    info["model"] = json.loads(meta["model"]) if "model" in meta else None
                except (ValueError, RecursionError):  # not JSON, or a number of thousands of digits: no model
                    pass
                info = {k: v for k, v in info.items() if v is not None}
    else:
        rows, files = _read_torch(root), [root.name]
    _check_info(info, root)
    return CheckpointManifest(path=root, format=fmt, frame=_frame(rows), info=info, files=files)


# what the manifest's readers (step, layout, quant, model_config_of, verify) take for granted
_INFO_TYPES = {"step": int, "world_size": int, "layout": dict, "job": dict, "files": dict, "quant": dict,
               "model": dict, "names": str}


def _check_info(info: dict[str, Any], root: Path) -> None:
    """The facts a manifest (workbench.json, an index's or a file's metadata) gives have the types their
    readers use; a damaged one is refused in one line, not met as an AttributeError later."""
    where = root / "workbench.json" if (root / "workbench.json").is_file() else root
    fix = "the checkpoint's metadata is damaged; restore it or use another step"
    for key, want in _INFO_TYPES.items():
        v = info.get(key)
        if v is not None and (not isinstance(v, want) or isinstance(v, bool)):
            raise CheckpointFormatError(where, f"its {key} is a {type(v).__name__}, not a {want.__name__}", fix)
    quant = info.get("quant") or {}
    if not isinstance(quant.get("keys") or {}, dict) or not isinstance(quant.get("mode", "none"), str):
        raise CheckpointFormatError(where, "its quant record has no map of keys", fix)
    job = info.get("job") or {}
    for part in ("model", "train", "parallel"):
        if not isinstance(job.get(part) or {}, dict):
            raise CheckpointFormatError(where, f"its job.{part} is not an object", fix)
