"""Start training from Hugging Face weights: ``workbench train CONFIG --init-from HF_DIR``.

``HF_DIR`` is what ``save_pretrained`` writes for a Llama-architecture model: ``config.json`` and the
weights in safetensors, one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Only safetensors are read (a ``pytorch_model.bin`` is a pickle, and unpickling runs code). Optimizer,
scheduler and step start fresh: this is an initialisation, not a resume.

Two halves, one rule each:

* :func:`check_init_from`, in the launcher before any process starts: the directory holds safetensors
  (headers and index read through :func:`workbench.checkpoint.contents.inspect`, which confines every
  file the index names to the directory and opens only regular files), its ``config.json`` describes the
  model being trained (every field that changes the math, named with both values when one differs), and
  every weight the model has is there with its shape.
* :func:`load_hf_weights`, on every rank after the model is built and parallelized: for each tensor of
  this rank's state dict (a tp shard, an FSDP shard, a pipeline stage's layers, or the whole tensor) it
  reads from the file only the rows that shard covers (``pread`` at the header's offsets), undoes the
  q/k rotary permutation (HF rotates the halves of each head, this model the pairs; whole heads are read
  for q/k so a shard boundary inside a head still permutes right), and copies the slice into place.
  A rank reads at most ``_CHUNK_BYTES`` of rows (or one q/k head) at a time (q/k: plus one permuted copy),
  never a whole checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from workbench.checkpoint.contents import inspect
from workbench.checkpoint.formats import _heads_for, _pread_exact, _rope_permute, to_hf_llama_name
from workbench.checkpoint.safeload import CheckpointFormatError
from workbench.safeio import CONFIG_MAX, confine, open_regular, regular_size

__all__ = ["check_init_from", "load_hf_weights", "hf_model_config", "math_fields"]

# ModelConfig fields that do not change the weights' meaning: the name, the RoPE table's length (a
# training setting here: seq_len must fit it), and training-only regularisation.
_NOT_COMPARED = frozenset({"name", "max_seq_len", "dropout", "router_aux_coef"})
_FIX_CONFIG = "pass HF_DIR/config.json as the model (e.g. `workbench train HF_DIR/config.json --init-from HF_DIR`)"


def math_fields() -> list[str]:
    """The ModelConfig fields an HF config.json must agree on with the model being trained."""
    from workbench.config import ModelConfig

    return [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _NOT_COMPARED]


def _root(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointFormatError(p, "no such directory", "pass the directory save_pretrained wrote "
                                    "(config.json and *.safetensors)", reason="missing")
    if not p.is_dir():
        raise CheckpointFormatError(p, "is not a directory", "--init-from takes the directory save_pretrained "
                                    "wrote (config.json and *.safetensors), not one of its files")
    return p


def hf_model_config(path: str | os.PathLike):
    """The ModelConfig that ``HF_DIR/config.json`` describes (a regular file of the directory, read by
    :func:`workbench.config.model_config_from_hf`, the one HF config reader: transformers 4.x and 5.x
    layouts, a key whose math this model does not compute refused)."""
    from workbench.config import model_config_from_hf

    root = _root(path)
    cfg = confine(root, "config.json", root, "model config", error=CheckpointFormatError)
    if not cfg.exists():
        raise CheckpointFormatError(cfg, "no such file", "--init-from needs the config.json save_pretrained "
                                    "writes beside the weights (its shapes are checked against the model)",
                                    reason="missing")
    regular_size(cfg, "model config", limit=CONFIG_MAX, error=CheckpointFormatError)
    try:
        return model_config_from_hf(cfg)
    except ValueError as e:
        raise ValueError(" ".join(str(e).split())) from None


def _compare(hf_cfg, model_cfg, where: Path) -> None:
    from workbench.hf_config import HF_KEYS  # config.json's key for a ModelConfig field: the message names it

    for name in math_fields():
        a, b = getattr(hf_cfg, name), getattr(model_cfg, name)
        if a != b:
            key = HF_KEYS.get(name, name)
            there = f"{key}={a!r}" + (f" (the model's {name})" if key != name else "")
            raise ValueError(f"{where}: {there} there, but the model being trained has {name}={b!r}; "
                             f"{_FIX_CONFIG}, or use HF weights of this model's shape")


def _source(root: Path):
    """The manifest of the directory's safetensors (index or files), refusing what is not that."""
    has_st = any(root.glob("*.safetensors")) or any(root.glob("*.safetensors.index.json"))
    if not has_st:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))[:1]
        why = f" ({pickles[0]} is a pickle, which is never loaded: unpickling runs code)" if pickles else ""
        raise CheckpointFormatError(root, f"holds no safetensors weights{why}", "save the model with "
                                    "save_pretrained(dir) (safetensors is its default), or convert the pickle "
                                    "where you trust it")
    m = inspect(root)
    if m.format not in ("hf", "safetensors"):
        raise CheckpointFormatError(root, f"is a {m.format} checkpoint, not a Hugging Face directory",
                                    "--init-from reads save_pretrained output; resume a workbench checkpoint with "
                                    "--resume")
    return m


def _layout(model_cfg) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Workbench FQN -> (its HF name, shape), for every weight of the model (built on meta: no memory)."""
    from workbench.models import build_model

    out = {}
    for fqn, t in build_model(model_cfg, seed=None, device="meta").state_dict().items():
        try:
            out[fqn] = (to_hf_llama_name(fqn), tuple(t.shape))
        except ValueError:
            raise ValueError(f"{fqn} has no Hugging Face Llama name; --init-from loads dense Llama models "
                             "(mixture-of-experts weights have none)") from None
    return out


def _rows(m, model_cfg) -> dict[str, dict]:
    """HF name -> the manifest row of each weight the model needs (tied embeddings: lm_head may be
    absent, read from embed_tokens), every one present and of the model's shape."""
    rows = {r["key"]: r for r in m.tensors().to_dict("records")}
    need = {}
    for fqn, (hf, shape) in _layout(model_cfg).items():
        row = rows.get(hf)
        if row is None and hf == "lm_head.weight" and model_cfg.tie_embeddings:
            row = rows.get("model.embed_tokens.weight")
        if row is None:
            raise CheckpointFormatError(m.path, f"has no tensor {hf!r} (the model's {fqn})", "pass the complete "
                                        "save_pretrained output (every shard its index lists)", reason="missing")
        if tuple(row["shape"] or ()) != shape:
            raise CheckpointFormatError(m.path, f"{hf} is {list(row['shape'] or [])} there but the model's {fqn} "
                                        f"is {list(shape)}", _FIX_CONFIG)
        if not getattr(torch, row["dtype"]).is_floating_point:  # a safetensors dtype: checked by its reader
            raise CheckpointFormatError(m.path, f"{hf} has dtype {row['dtype']}, not a floating-point weight",
                                        "re-save the model with save_pretrained")
        need[fqn] = row
    return need


def check_init_from(path: str | os.PathLike, model_cfg) -> dict[str, Any]:
    """Before anything starts: ``path`` is an HF directory whose config and weights fit ``model_cfg``.

    Raises a ValueError of one line (a :class:`CheckpointFormatError` naming the file where one is at
    fault). Returns what the run records about its weights' origin."""
    root = _root(path)
    hf_cfg = hf_model_config(root)
    _compare(hf_cfg, model_cfg, root / "config.json")
    m = _source(root)
    need = _rows(m, model_cfg)
    return {"path": str(root.resolve()), "format": "hf-safetensors", "files": len(m.files),
            "tensors": len(need), "bytes": int(sum(int(r["bytes"]) for r in need.values()))}


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's model state under full-model FQNs (whole tensors, or DTensors of this rank's shard)."""
    from workbench.checkpoint.state import TrainState

    return TrainState(model, None).model_state()


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the tensor this rank writes, its shape, its offsets in the global tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from workbench.compat import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(shape), tuple(offsets)
    return t, tuple(t.shape), (0,) * t.dim()


class _Reader:
    """Row ranges of the directory's tensors, read with ``pread`` from regular files opened once."""

    def __init__(self, root: Path):
        self.root, self.handles, self.bytes_read = root, {}, 0

    def rows(self, row: dict, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of the tensor of manifest row ``row``, as stored (the header's dtype)."""
        shard = row["shards"][0]
        name = shard["file"]
        if name not in self.handles:  # inside the directory (no link out), a regular file: checked at open
            f = confine(self.root, name, self.root, "safetensors file", error=CheckpointFormatError)
            self.handles[name] = (f, open_regular(f, "safetensors file", error=CheckpointFormatError))
        f, fh = self.handles[name]
        shape, dtype = tuple(row["shape"]), getattr(torch, row["dtype"])
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        n = (r1 - r0) * row_bytes
        data = _pread_exact(fh, shard["byte_offset"] + r0 * row_bytes, n, f) if n else \
            torch.empty(0, dtype=torch.uint8)
        self.bytes_read += n
        return data.view(dtype).reshape((r1 - r0, *shape[1:]))

    def close(self) -> None:
        for _, fh in self.handles.values():
            fh.close()


_CHUNK_BYTES = 64 << 20  # rows read at once, whatever the tensor (q/k: plus one permuted copy of them)


def _copy_box(reader: _Reader, fqn: str, row: dict, local: torch.Tensor, shape: tuple[int, ...],
              offsets: tuple[int, ...], model_cfg) -> None:
    """Write the global tensor's box ``offsets + shape`` (workbench's layout) into ``local``, reading only the
    rows it covers, at most ``_CHUNK_BYTES`` of them at a time (a column shard, as tp's row-parallel wo/w2,
    still reads whole rows: the file stores rows contiguously)."""
    if not shape:  # a 0-d tensor (none in a Llama today): its one value
        local.copy_(reader.rows(row, 0, 1).reshape(()))
        return
    r0, r1 = offsets[0], offsets[0] + shape[0]
    heads = _heads_for(fqn, model_cfg)
    # q/k: workbench row h*d + 2k + s is HF row h*d + s*d/2 + k, so rows are read in whole heads (a shard
    # boundary inside a head still permutes right); other tensors row by row
    unit = row["shape"][0] // heads if heads else 1
    row_bytes = max(1, math.prod(row["shape"][1:]) * getattr(torch, row["dtype"]).itemsize)
    per = max(1, _CHUNK_BYTES // (row_bytes * unit)) * unit
    a, end = r0 // unit * unit, -(-r1 // unit) * unit
    while a < end:
        b = min(a + per, end)
        block = reader.rows(row, a, b)
        if heads:
            block = _rope_permute(block.reshape(b - a, -1), (b - a) // unit, to_hf=False).view(block.shape)
        lo, hi = max(a, r0), min(b, r1)
        piece = block[lo - a:hi - a]
        for dim in range(1, len(shape)):
            piece = piece.narrow(dim, offsets[dim], shape[dim])
        local[lo - r0:hi - r0].copy_(piece)
        a = b


def load_hf_weights(model: torch.nn.Module, path: str | os.PathLike, model_cfg) -> dict[str, Any]:
    """Copy the HF directory's weights into ``model`` as this rank holds it (any layout), reading only
    this rank's rows. ``model``: a whole or parallelized model, or a pipeline rank's stage list. The
    directory is checked again here (it may have changed since launch). Returns what was read."""
    t0 = time.perf_counter()
    root = _root(path)
    _compare(hf_model_config(root), model_cfg, root / "config.json")
    m = _source(root)
    need = _rows(m, model_cfg)
    targets = _targets(model)
    reader = _Reader(root)
    try:
        with torch.no_grad():
            for fqn, t in targets.items():
                if fqn not in need:  # a buffer the model saves that HF has no name for (none in a Llama)
                    raise CheckpointFormatError(root, f"has no weight for the model's {fqn}", _FIX_CONFIG)
                local, shape, offsets = _local_box(t)
                if local.numel():  # the state dict's tensors share the parameters' storage: this writes them
                    _copy_box(reader, fqn, need[fqn], local, shape, offsets, model_cfg)
    finally:
        reader.close()
    return {"path": str(root.resolve()), "format": "hf-safetensors", "files": len(m.files),
            "tensors": len(targets), "bytes_read": reader.bytes_read, "load_s": time.perf_counter() - t0}
