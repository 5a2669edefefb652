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
saves write new files and rename them, and rotation's deletes leave mapped pages readable).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from workbench.checkpoint.directread import ReadStats, _Unsupported, parse_item
from workbench.checkpoint.safeload import CheckpointFormatError

__all__ = ["mapped_tensors", "point_at", "apply_hyper"]

_SMALL = 1 << 12  # tensors up to this many bytes are copied out of the mapping (scalars, RNG, hyperparameters)


def _leaves(d: dict[str, Any], prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", d, k


def mapped_tensors(ckpt: Path, metadata, targets: dict[str, Any]) -> tuple[dict[str, torch.Tensor], ReadStats] | None:
    """``key -> tensor`` for every leaf of ``targets``, backed by the mapped files (small ones copied out),
    or None when some leaf cannot be mapped (then nothing was changed)."""
    md = metadata.state_dict_metadata
    wanted: dict[str, tuple[Any, torch.Tensor]] = {}
    for key, container, sub in _leaves(targets):
        dest = container[sub]
        meta = md.get(key)
        # Plain tensors and parameters only: a tensor subclass (a DTensor, which an nn.Parameter of one also
        # is) keeps its data elsewhere, and pointing it at a mapped buffer would break it.
        if type(dest) not in (torch.Tensor, torch.nn.Parameter):
            return None
        if not isinstance(meta, TensorStorageMetadata) or len(meta.chunks) != 1 or not dest.is_cpu:
            return None
        chunk = meta.chunks[0]
        if tuple(chunk.sizes) != tuple(meta.size) or tuple(meta.size) != tuple(dest.shape) \
                or meta.properties.dtype != dest.dtype:
            return None
        info = metadata.storage_data.get(MetadataIndex(key, torch.Size([0] * len(meta.size))))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        wanted[key] = (info, dest)
    maps: dict[str, mmap.mmap] = {}
    out: dict[str, torch.Tensor] = {}
    stats = ReadStats()
    # The mmaps stay open as long as the tensors made from them.
    for key, (info, dest) in wanted.items():
        path = ckpt / info.relative_path
        mm = maps.get(info.relative_path)
        if mm is None:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return None
                mm = maps[info.relative_path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if info.offset + info.length > len(mm):
            raise CheckpointFormatError(path, f"is {len(mm)} bytes but an item ends at byte "
                                        f"{info.offset + info.length}",
                                        "the file is truncated; restore it or load another step")
        item = memoryview(mm)[info.offset:info.offset + info.length]
        try:
            st, _ = parse_item(item, item, info.length, dest.dtype)
        except _Unsupported:
            return None
        finally:
            item.release()
        start = info.offset + st.data_offset
        nbytes = dest.numel() * dest.element_size()
        if not (st.contiguous and st.storage_offset == 0 and st.size == tuple(dest.shape)) \
                or st.data_offset + nbytes > info.length or start % max(dest.element_size(), 1):
            return None
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


def point_at(targets: dict[str, Any], mapped: dict[str, torch.Tensor], model: torch.nn.Module,
             optimizer: torch.optim.Optimizer | None) -> int:
    """Point the model's parameters and buffers and the optimizer's state at ``mapped`` where the target
    tensor is theirs (found by identity of storage); copy into the target where it is not (a view the
    state dict made, a scheduler's or RNG's fresh tensor). ``targets`` then holds the loaded values, for
    what is applied from it afterwards (hyperparameters, scheduler, RNG, step). Returns how many optimizer
    state tensors were copied into a target that may not be the optimizer's own (then the optimizer must
    be given the state as usual)."""
    params = {p.data_ptr(): p for p in model.parameters() if p.numel()}
    buffers = {b.data_ptr(): (mod, name) for mod in model.modules() for name, b in mod._buffers.items()
               if b is not None and b.numel()}
    opt_state = {}
    if optimizer is not None:
        for st in optimizer.state.values():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    opt_state[id(v)] = (st, name)
    copied_optim = 0
    for key, container, sub in _leaves(targets):
        dest, src = container[sub], mapped[key]
        exact = dest.numel() and dest.is_contiguous() and dest.storage_offset() == 0 \
            and dest.untyped_storage().nbytes() == dest.numel() * dest.element_size()
        if exact and dest.data_ptr() in params and params[dest.data_ptr()].shape == src.shape:
            params[dest.data_ptr()].data = src
        elif exact and dest.data_ptr() in buffers:
            mod, name = buffers[dest.data_ptr()]
            mod._buffers[name] = src
        elif id(dest) in opt_state:
            st, name = opt_state[id(dest)]
            st[name] = src
        else:
            dest.copy_(src)
            copied_optim += key.startswith("optim.state.")
            continue
        container[sub] = src
    return copied_optim


def apply_hyper(optimizer: torch.optim.Optimizer, model_targets: dict[str, torch.Tensor], model: torch.nn.Module,
                hyper: dict[str, dict[str, Any]]) -> bool:
    """Set each param group's hyperparameters from the packed ``hyper`` (``fqn -> values``) of its first
    parameter, found through ``model_targets`` (fqn -> the parameter's tensor, now mapped). False (nothing
    set) when a group's parameter has no FQN here or no stored values: the caller then goes the long way."""
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
            return False
        updates.append((group, hyper[fqn]))
    for group, stored in updates:
        for name, value in stored.items():
            if name != "params" and name in group:
                group[name] = _from_json(value, group[name])
    return True
