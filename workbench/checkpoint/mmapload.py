"""Zero-copy loading into one process: the checkpoint's files mapped, the model's and optimizer's tensors
pointed at the mapped bytes (``load(..., mmap=True)``).

This is what ``safetensors.torch.load_file`` and ``torch.load(mmap=True)`` + ``load_state_dict(assign=True)``
do: nothing is copied when loading. Pages come in from the page cache (or the disk) as the tensors are
first read, and a page is copied only when it is first written (the mapping is private, copy-on-write):
the first optimizer step after the load pays for the pages it updates, about the copy that loading
skipped. Each parameter keeps its identity (``param.data`` is repointed), so optimizers, hooks and
references stay valid; optimizer state tensors are replaced in ``optimizer.state``.

It applies when every tensor is a plain CPU tensor in this process (no process group, no DTensor) and
the checkpoint stores it whole, contiguous, of the same dtype and shape, at an aligned offset, in DCP's
default item format; quantized moments are dequantized (a copy), and anything else falls back to
:mod:`workbench.checkpoint.directread`'s copying path. The caveat of every memory-mapped load holds: the
files must not be truncated or rewritten in place while the tensors map them (workbench never does;
saves write new files and rename them, and rotation's deletes leave mapped pages readable). A truncated
file takes the mapped pages with it, private copies included (the next read is a SIGBUS), and a file
rewritten in place changes every page not yet written; a deleted file's blocks stay allocated while it
is mapped.

What the default load (``mmap=None``) maps, and why (:func:`plan_pointing`). The first training step after
a load writes every parameter and moment. A written mapped page costs a fault and a page copy: 167 ms for
305 MiB on this 2-core VM (0.55 ms/MiB), against 25 ms to copy the same bytes into memory that is already
faulted in, and 136 ms into new memory (its faults). So a tensor that has memory of its own (a parameter,
a buffer, optimizer state that exists) takes a copy, and only what needs new memory anyway (a fresh
optimizer's state, on resume) is mapped: its pages are then allocated when the step first writes them
instead of during the load, which returns sooner. That happens only where :func:`mapping_hazard` finds
nothing: files owned by this user, writable by no one else, on a local file system, on Linux, with free
space on their disk for what they hold (a resumed run keeps the resumed step's blocks until it exits).
"""

from __future__ import annotations

import bisect
import mmap
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from workbench.checkpoint.directread import _LOCAL, SPAN_MIN, ReadStats, _Unsupported, parse_item
from workbench.checkpoint.safeload import CheckpointFormatError

__all__ = ["map_files", "mapping_hazard", "mapped_tensors", "plan_pointing", "point_at", "plan_hyper",
           "set_hyper"]

_SMALL = 1 << 12  # tensors up to this many bytes are copied out of the mapping (scalars, RNG, hyperparameters)


def _leaves(d: dict[str, Any], prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", d, k


# File systems where another machine or a user-space server can change a file under a mapping: a mapping
# of such a file is never left in place by default (explicit mmap=True still maps).
_SHARED_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "afs", "ceph", "glusterfs",
                        "lustre", "gpfs", "beegfs", "orangefs", "gfs2", "ocfs2", "virtiofs", "fuse"})


def _fs_type(st: os.stat_result) -> str | None:
    """The type of the file system holding a file (``/proc/self/mountinfo``, by device); None if unknown."""
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == dev and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return None


def mapping_hazard(path: Path, st: os.stat_result) -> str | None:
    """Why leaving tensors mapped onto this file is not safe (one line), or None: its owner is not this
    user, someone else may write it, it is on a shared or user-space file system, or this is not Linux
    (where a mapped file can be replaced, or deleted by rotation, while it is mapped)."""
    import stat

    if not sys.platform.startswith("linux"):
        return f"{path}: mapped files are left in place on Linux only (here: {sys.platform})"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"{path}: owned by another user (uid {st.st_uid}), who could rewrite it under the mapping"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path}: writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'}, who could " \
               "rewrite it under the mapping"
    fs = _fs_type(st)
    if fs is not None and (fs in _SHARED_FS or (fs.startswith("fuse.") and fs != "fuseblk")):
        return f"{path}: on a {fs} file system, where it can change under the mapping"
    return None


def map_files(ckpt: Path, manifest: dict[str, Any], hazards: list[str] | None = None) -> dict[str, mmap.mmap]:
    """Copy-on-write mappings of a checkpoint's shard files (by name), as the manifest lists them.
    ``hazards``: gets what :func:`mapping_hazard` finds about each mapped file."""
    from workbench.safeio import FileRefused, confine, open_regular

    maps = {}
    for name in (manifest.get("files") or {}):
        if isinstance(name, str) and name.endswith(".distcp"):
            try:  # a file inside the checkpoint directory, regular (never a link out, a FIFO or a device)
                path = confine(ckpt, name, ckpt / "workbench.json", "data file")
                with open_regular(path, "DCP data file") as f:
                    st = os.fstat(f.fileno())
                    if st.st_size:
                        maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                        if hazards is not None and (why := mapping_hazard(ckpt / name, st)) is not None:
                            hazards.append(why)
            except (OSError, FileRefused):
                continue  # missing, unreadable or refused: verification names it; the load reads what it can
    if hazards is not None and maps and not hazards:
        # A mapped file keeps its blocks until the process exits, even once rotation has deleted it: the next
        # save must then find room beside it.
        mapped = sum(len(m) for m in maps.values())
        try:
            free = shutil.disk_usage(ckpt).free
        except OSError:
            free = None
        if free is not None and free < mapped:
            hazards.append(f"{ckpt}: its disk has {free:,} bytes free, less than the {mapped:,} its files hold; "
                           "mapped, they would stay allocated after rotation deletes them")
    return maps


def _spans(manifest: dict[str, Any] | None) -> dict[str, tuple[list[int], list[int]]]:
    """file -> (offsets, lengths) of the large writes the saver recorded (``files.<name>.spans``), sorted;
    malformed or absent entries are left out (those items are then parsed)."""
    out = {}
    files = (manifest or {}).get("files")
    for name, info in (files.items() if isinstance(files, dict) else ()):
        flat = info.get("spans") if isinstance(info, dict) else None
        if isinstance(flat, list) and len(flat) % 2 == 0 and all(type(x) is int and x >= 0 for x in flat):
            pairs = sorted(zip(flat[0::2], flat[1::2]))
            out[name] = ([o for o, _ in pairs], [n for _, n in pairs])
    return out


def _record_start(mm: mmap.mmap, info, nbytes: int) -> int | None:
    """Where a small dense item keeps its tensor's bytes: the data record (``<archive>/data/0``) found by its
    local header, the first one after the pickle and three tiny records. Used only for files whose saver
    recorded spans (every tensor dense: the record is the tensor's bytes, row-major, little-endian); the
    name, the header's signature and the bounds are all checked, and None sends the item to the parser."""
    end = info.offset + info.length
    at = mm.find(b"/data/0", info.offset, end)
    if at < 0:
        return None
    hdr = mm.rfind(_LOCAL, info.offset, at)
    if hdr < 0 or hdr + 30 > at:
        return None
    nlen, xlen = struct.unpack_from("<HH", mm, hdr + 26)
    if hdr + 30 + nlen != at + len(b"/data/0"):
        return None
    start = hdr + 30 + nlen + xlen
    return start if start + nbytes <= end else None


def _span_start(spans, info, nbytes: int) -> int | None:
    """Where the item ``info`` keeps its tensor's ``nbytes`` bytes, from the recorded spans: the large write
    inside the item, if it has exactly that length (the saver records spans only for dense tensors)."""
    if spans is None or nbytes <= SPAN_MIN:
        return None
    offsets, lengths = spans
    i = bisect.bisect_left(offsets, info.offset)
    if i == len(offsets):
        return None
    start, n = offsets[i], lengths[i]
    end = info.offset + info.length
    if n != nbytes or start + n > end or (i + 1 < len(offsets) and offsets[i + 1] < end):
        return None  # not that length, or not the item's only large write: parse the item instead
    return start


def mapped_tensors(ckpt: Path, metadata, targets: dict[str, Any], *, manifest: dict[str, Any] | None = None,
                   maps: dict[str, mmap.mmap] | None = None, why: list[str] | None = None
                   ) -> tuple[dict[str, torch.Tensor], ReadStats] | None:
    """``key -> tensor`` for every leaf of ``targets``, backed by the mapped files (small ones copied out),
    or None when some leaf cannot be mapped (then nothing was changed, and ``why`` gets the reason).

    ``maps``: the files already mapped (:func:`map_files`); ``manifest``: its recorded spans locate each
    large tensor without parsing its item (``torch.save``'s zip directory and pickle), which is most of
    this function's time otherwise."""
    def no(reason: str) -> None:
        if why is not None:
            why.append(reason)

    md = metadata.state_dict_metadata
    whole = {idx.fqn: info for idx, info in metadata.storage_data.items()  # items that start at offset 0
             if isinstance(idx.offset, torch.Size) and not any(idx.offset)}
    wanted: dict[str, tuple[Any, torch.Tensor]] = {}
    for key, container, sub in _leaves(targets):
        dest = container[sub]
        meta = md.get(key)
        # Plain tensors and parameters only: a tensor subclass (a DTensor, which an nn.Parameter of one also
        # is) keeps its data elsewhere, and pointing it at a mapped buffer would break it.
        if type(dest) not in (torch.Tensor, torch.nn.Parameter):
            return no(f"{key} is a {type(dest).__name__} here, whose data lives elsewhere")
        if not isinstance(meta, TensorStorageMetadata):
            return no(f"{key} is not a tensor in the checkpoint")
        if not dest.is_cpu:
            return no(f"{key} is on {dest.device} here")
        chunk = meta.chunks[0] if len(meta.chunks) == 1 else None
        if chunk is None or tuple(chunk.sizes) != tuple(meta.size):
            return no(f"{key} is stored in {len(meta.chunks)} pieces")
        if tuple(meta.size) != tuple(dest.shape) or meta.properties.dtype != dest.dtype:
            return no(f"{key} is {meta.properties.dtype} {tuple(meta.size)} in the checkpoint, "
                      f"{dest.dtype} {tuple(dest.shape)} here")
        info = whole.get(key)
        if info is None or getattr(info, "transform_descriptors", None):
            return no(f"{key} is not stored as one plain item")
        wanted[key] = (info, dest)
    maps = dict(maps or {})
    spans = _spans(manifest)
    out: dict[str, torch.Tensor] = {}
    stats = ReadStats()
    # The mmaps stay open as long as the tensors made from them.
    for key, (info, dest) in wanted.items():
        mm = maps.get(info.relative_path)
        if mm is None:  # read_dcp_metadata checked the name; confine() its links, open_regular() its kind
            from workbench.safeio import confine, open_regular

            with open_regular(confine(ckpt, info.relative_path, ckpt / ".metadata", "data file",
                                      error=CheckpointFormatError), "DCP data file", error=CheckpointFormatError) as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return no(f"{ckpt / info.relative_path} is empty")
                mm = maps[info.relative_path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if info.offset + info.length > len(mm):
            raise CheckpointFormatError(ckpt / info.relative_path, f"is {len(mm)} bytes but an item ends at "
                                        f"byte {info.offset + info.length}",
                                        "the file is truncated; restore it or load another step")
        nbytes = dest.numel() * dest.element_size()
        file_spans = spans.get(info.relative_path)
        if file_spans is None:
            start = None
        elif nbytes > SPAN_MIN:
            start = _span_start(file_spans, info, nbytes)
        else:
            start = _record_start(mm, info, nbytes)
        if start is None:
            item = memoryview(mm)[info.offset:info.offset + info.length]
            try:
                st, _ = parse_item(item, item, info.length, dest.dtype)
            except _Unsupported as e:
                return no(f"{key}: {e}")
            finally:
                item.release()
            start = info.offset + st.data_offset
            if not (st.contiguous and st.storage_offset == 0 and st.size == tuple(dest.shape)) \
                    or st.data_offset + nbytes > info.length:
                return no(f"{key} is not stored dense and whole")
        if start % max(dest.element_size(), 1):
            return no(f"{key} is not aligned in its file")
        if dest.numel() == 0:
            t = torch.empty_like(dest)
        else:
            t = torch.frombuffer(mm, dtype=dest.dtype, count=dest.numel(), offset=start).view(dest.shape)
            if nbytes <= _SMALL:
                t = t.clone()
        out[key] = t
        stats.direct += 1
        stats.bytes += nbytes
    return out, stats


def plan_pointing(targets: dict[str, Any], mapped: dict[str, torch.Tensor], model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None, mode: str = "map",
                  new_state: dict[int, tuple[torch.Tensor, str]] | None = None) -> tuple[list, int, dict[str, int]]:
    """What pointing the model and optimizer at ``mapped`` takes, worked out without changing anything (a
    load decides this while the checksums are still being computed, and applies it once they match).

    ``mode="map"``: parameters and buffers are repointed where the target tensor is theirs (found by
    identity of storage), optimizer state tensors replaced in ``optimizer.state``, and anything else (a view
    the state dict made, a scheduler's or RNG's fresh tensor) copied into. ``"copy"``: every value is copied
    into its target (the tensors keep their memory). ``"auto"``: copied where the target has memory of its
    own, mapped only where it has none (``new_state``: targets made for a fresh optimizer,
    ``id(target) -> (parameter, name)``, which are installed into ``optimizer.state`` either way).

    Returns the actions for :func:`point_at`, how many optimizer state tensors are copied into a target
    that may not be the optimizer's own (then the optimizer must be given the state as usual), and counts:
    ``mapped``/``mapped_bytes`` (tensors left on the mapped files) and ``copied``/``copied_bytes``."""
    params = {p.data_ptr(): p for p in model.parameters() if p.numel()}
    buffers = {b.data_ptr(): (mod, name) for mod in model.modules() for name, b in mod._buffers.items()
               if b is not None and b.numel()}
    opt_state = {}
    if optimizer is not None:
        for st in optimizer.state.values():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    opt_state[id(v)] = (st, name)
    new_state = new_state or {}
    actions, copied_optim = [], 0
    counts = {"mapped": 0, "mapped_bytes": 0, "copied": 0, "copied_bytes": 0}
    for key, container, sub in _leaves(targets):
        dest, src = container[sub], mapped[key]
        nbytes = src.numel() * src.element_size()
        if id(dest) in new_state:  # a fresh optimizer's state: installed, mapped or as a copy
            param, name = new_state[id(dest)]
            keep = mode != "copy" or nbytes <= _SMALL  # small ones were copied out of the mapping already
            actions.append(("new", (optimizer.state, param), name, (src if keep else dest, src), container, sub))
            big = nbytes > _SMALL and keep
            counts["mapped" if big else "copied"] += 1
            counts["mapped_bytes" if big else "copied_bytes"] += nbytes
            continue
        exact = dest.numel() and dest.is_contiguous() and dest.storage_offset() == 0 \
            and dest.untyped_storage().nbytes() == dest.numel() * dest.element_size()
        if mode != "map" or nbytes <= _SMALL:
            actions.append(("copy", dest, None, src, None, None))
            copied_optim += mode == "map" and key.startswith("optim.state.") and id(dest) not in opt_state
        elif exact and dest.data_ptr() in params and params[dest.data_ptr()].shape == src.shape:
            actions.append(("param", params[dest.data_ptr()], None, src, container, sub))
        elif exact and dest.data_ptr() in buffers:
            mod, name = buffers[dest.data_ptr()]
            actions.append(("buffer", mod._buffers, name, src, container, sub))
        elif id(dest) in opt_state:
            st, name = opt_state[id(dest)]
            actions.append(("state", st, name, src, container, sub))
        else:
            actions.append(("copy", dest, None, src, None, None))
            copied_optim += key.startswith("optim.state.")
        big = actions[-1][0] != "copy"
        counts["mapped" if big else "copied"] += 1
        counts["mapped_bytes" if big else "copied_bytes"] += nbytes
    return actions, copied_optim, counts


def point_at(actions: list, copies: bool = True, pointing: bool = True) -> None:
    """Apply :func:`plan_pointing`'s actions: the ``copies`` (into existing tensors, and into a fresh
    optimizer's new ones) and the ``pointing`` (repointed parameters and buffers, installed optimizer
    state). A copying load copies while the checksums are computed and points once they match. ``targets``
    then holds the loaded values, for what is applied from it afterwards (hyperparameters, scheduler, RNG)."""
    for kind, obj, name, src, container, sub in actions:
        if kind == "copy":
            if copies:
                obj.copy_(src)
            continue
        if kind == "new":  # obj: (optimizer.state, parameter); src: (the value to install, the loaded one)
            (state, param), (src, loaded) = obj, src
            if copies and src is not loaded:
                src.copy_(loaded)
        if not pointing:
            continue
        if kind == "param":
            obj.data = src
        elif kind == "new":
            state[param][name] = src
        else:
            obj[name] = src
        container[sub] = src


def plan_hyper(optimizer: torch.optim.Optimizer, model_targets: dict[str, torch.Tensor], model: torch.nn.Module,
               hyper: dict[str, dict[str, Any]]) -> list | None:
    """Each param group's hyperparameters from the packed ``hyper`` (``fqn -> values``) of its first
    parameter, found through ``model_targets`` (fqn -> a tensor sharing the parameter's storage): a list
    for :func:`set_hyper`, or None when a group's parameter has no FQN here or no stored values (the
    caller then goes the long way)."""
    from workbench.checkpoint.state import _from_json

    fqn_of = {}
    ptr_to_fqn = {t.data_ptr(): k for k, t in model_targets.items() if t.numel()}
    for p in model.parameters():
        if p.numel() and p.data_ptr() in ptr_to_fqn:
            fqn_of[id(p)] = ptr_to_fqn[p.data_ptr()]
    updates = []
    for group in optimizer.param_groups:
        fqn = next((fqn_of.get(id(p)) for p in group["params"] if id(p) in fqn_of), None)
        if fqn is None or fqn not in hyper:
            return None
        for name, value in hyper[fqn].items():
            if name != "params" and name in group:
                updates.append((group, name, _from_json(value, group[name])))
    return updates


def set_hyper(updates: list) -> None:
    for group, name, value in updates:
        group[name] = value
