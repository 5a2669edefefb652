"""Quantized optimizer state in checkpoints: Adam's moments in int8 or fp8 with block-wise scales.

Optimizer state is two thirds of a fp32 checkpoint. ``quant="int8"`` (``--ckpt-quant int8``) stores each
eligible moment as 1 byte per element plus one fp32 scale per block of ``B`` elements along the last
dimension (``B`` = 128, or 64 / 32 where the last dimension's shards need it)::

    optim.state.<fqn>.exp_avg         ->  optim.state.<fqn>.exp_avg.q      int8, the moment's shape
                                          optim.state.<fqn>.exp_avg.qscale fp32, shape[:-1] + (n / B,)
    optim.state.<fqn>.exp_avg_sq      ->  ...exp_avg_sq.q  (uint8: sqrt(v) >= 0) + ...exp_avg_sq.qscale

* ``exp_avg`` (m): symmetric, ``q = round(m / s)`` with ``s = max|m| / 127`` per block (fp8: ``s = max|m| /
  448`` and ``q = float8_e4m3fn(m / s)``).
* ``exp_avg_sq`` (v) is quantized on its square root, ``q = round(sqrt(v) / s)`` with ``s = max sqrt(v) /
  255`` (uint8), and restored as ``(q s)^2``. Adam divides by ``sqrt(v) + eps``, so what matters is the
  error of ``sqrt(v)``: at most ``s / 2`` = 1/510 of the block's largest ``sqrt(v)``, whereas quantizing v
  itself would flush every entry below 1/510 of the block's largest v (that is, most of them) to zero.
* fp8 (e4m3) keeps 3 mantissa bits: a relative error of at most 1/16 per element, for every magnitude
  within the block's 2^17 range.

The quantized tensors are ordinary tensors with the moments' placements (a DTensor's shards stay
where they are; the scales are sharded the same way), so a quantized checkpoint loads into another
layout like any other. A tensor is quantized only where every shard boundary on its last dimension
falls on a block boundary, and never 1-D tensors (norm weights: small); the others stay fp32. The
manifest's ``quant`` entry lists what is quantized, with the bytes saved.

Loading dequantizes into the optimizer's fp32 state. Each resume then trains on the dequantized moments
and the next save quantizes them again; the error does not compound, because quantizing a value that
is already on the grid (the same block maximum, the same scale) returns it exactly, and moments that
training moved are quantized afresh. ``tests/test_checkpoint_quant.py`` measures 10 save/load cycles
against an uninterrupted run. Nothing caps the number of resumes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["MODES", "BLOCKS", "quantize", "dequantize", "quantize_state", "plan", "dequantize_loaded",
           "load_targets", "describe"]

MODES = ("none", "int8", "fp8")
BLOCKS = (128, 64, 32)  # the block chosen is the largest that every shard boundary respects
_MOMENTS = {"exp_avg": False, "exp_avg_sq": True}  # name -> quantized on its square root
Q, SCALE = ".q", ".qscale"


def _fp8() -> torch.dtype:
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise ValueError("ckpt_quant='fp8' needs torch.float8_e4m3fn, which this torch lacks; use int8")
    return dtype


def check_mode(mode: str | None) -> str:
    mode = mode or "none"
    if mode not in MODES:
        raise ValueError(f"ckpt_quant={mode!r} is unknown; choose none, int8 or fp8")
    if mode == "fp8":
        _fp8()
    return mode


def quantize(x: torch.Tensor, mode: str, block: int, sqrt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise quantization of ``x`` (a plain tensor; last dim a multiple of ``block``): ``(q, scale)``."""
    x = x.detach().to(torch.float32)
    if sqrt:
        x = x.clamp_min(0).sqrt()
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = blocks.abs().amax(dim=-1)
    if mode == "int8":
        top = 255.0 if sqrt else 127.0
        scale = amax / top
        q = torch.round(blocks / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
        q = q.clamp(0 if sqrt else -127, top).to(torch.uint8 if sqrt else torch.int8)
    elif mode == "fp8":
        scale = amax / 448.0
        q = (blocks / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).to(_fp8())
    else:
        raise ValueError(f"quantize mode={mode!r}; choose int8 or fp8")
    return q.reshape(x.shape), scale


def code_dtype(mode: str, sqrt: bool) -> torch.dtype:
    """The dtype :func:`quantize` stores codes in."""
    if mode == "fp8":
        return _fp8()
    return torch.uint8 if sqrt else torch.int8


def stored_locals(key: str, local: torch.Tensor, info: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{suffix: (local shape, dtype)}`` that :func:`quantize_state` stores for moment ``key`` (``optim.*``)."""
    block = info["keys"][key]
    sqrt = is_sqrt(key)
    return {Q: (tuple(local.shape), code_dtype(info["mode"], sqrt)),
            SCALE: ((*local.shape[:-1], local.shape[-1] // block), torch.float32)}


def dequantize(q: torch.Tensor, scale: torch.Tensor, sqrt: bool) -> torch.Tensor:
    """The fp32 moment back from ``(q, scale)``; the block size is ``q.shape[-1] / scale.shape[-1]``."""
    nblocks = scale.shape[-1] if scale.dim() else 1
    block = q.shape[-1] // max(nblocks, 1)
    x = q.to(torch.float32).reshape(*q.shape[:-1], nblocks, block) * scale.to(torch.float32).unsqueeze(-1)
    x = x.reshape(q.shape)
    return x.square() if sqrt else x


# -- which tensors, with which block ----------------------------------------------------------------

def _block_for(t: torch.Tensor) -> int | None:
    """The block size for ``t`` (a moment, plain or DTensor), or None: stays fp32."""
    if t.dim() < 2 or t.dtype != torch.float32:
        return None
    n = t.shape[-1]
    parts = 1  # shards of the last dimension
    if isinstance(t, DTensor):
        for mesh_dim, p in enumerate(t.placements):
            if isinstance(p, Shard) and p.dim % t.dim() == t.dim() - 1:
                parts *= t.device_mesh.size(mesh_dim)
    for block in BLOCKS:
        if n % (parts * block) == 0:  # even shards, each a whole number of blocks
            return block
    return None


def _moment(key: str) -> tuple[str, bool] | None:
    for name, sqrt in _MOMENTS.items():
        if key.startswith("state.") and key.endswith("." + name):
            return name, sqrt
    return None


def is_sqrt(key: str) -> bool:
    """Whether the moment ``key`` (``optim.state.<fqn>.exp_avg_sq``) is stored on its square root."""
    m = _moment(key.removeprefix("optim."))
    return bool(m and m[1])


def plan(sd: dict[str, Any], mode: str) -> dict[str, Any]:
    """The manifest's ``quant`` entry for saving ``sd`` (the nested train state) in ``mode``.

    Decided from global shapes and placements only, so every rank of a job agrees without talking."""
    mode = check_mode(mode)
    if mode == "none":
        return {"mode": "none", "keys": {}}
    optim = sd.get("optim", {})
    keys: dict[str, int] = {}
    fp32_bytes = stored = 0
    for k, t in optim.items():
        if not isinstance(t, torch.Tensor) or _moment(k) is None:
            continue
        nbytes = t.numel() * 4
        fp32_bytes += nbytes
        block = _block_for(t) if mode != "none" else None
        if block is None:
            stored += nbytes
            continue
        keys[f"optim.{k}"] = block
        stored += t.numel() + t.numel() // block * 4
    return {"mode": mode, "keys": keys, "moment_bytes_fp32": fp32_bytes, "moment_bytes_stored": stored,
            "sqrt": [name for name, s in _MOMENTS.items() if s]}


def _wrap(local: torch.Tensor, like: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(like, DTensor):
        return local
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=torch.Size(global_shape),
                              stride=stride)


def quantize_state(sd: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with the moments ``info`` names replaced by ``.q`` + ``.qscale`` tensors (new tensors: the
    live state is only read). Everything else is the same object."""
    if not info.get("keys"):
        return sd
    optim = dict(sd["optim"])
    for key, block in info["keys"].items():
        k = key[len("optim."):]
        t = optim.pop(k)
        sqrt = _moment(k)[1]
        local = t.to_local() if isinstance(t, DTensor) else t
        q, scale = quantize(local, info["mode"], block, sqrt)
        optim[k + Q] = _wrap(q, t, tuple(t.shape))
        optim[k + SCALE] = _wrap(scale, t, (*t.shape[:-1], t.shape[-1] // block))
    return {**sd, "optim": optim}


# -- loading ---------------------------------------------------------------------------------------

def load_targets(targets: dict[str, Any], shapes: dict[str, tuple]) -> list[tuple[str, torch.Tensor, bool]]:
    """Swap each fp32 moment target whose checkpoint holds ``.q``/``.qscale`` instead for targets of those.

    Returns ``[(key, fp32 target, sqrt)]`` for :func:`dequantize_loaded` after the read."""
    optim = targets.get("optim")
    if not optim:
        return []
    swapped = []
    for k in list(optim):
        m = _moment(k)
        full = f"optim.{k}"
        if m is None or full in shapes or full + Q not in shapes:
            continue
        t = optim.pop(k)
        (qshape, qdtype), (sshape, sdtype) = shapes[full + Q], shapes[full + SCALE]
        local = t.to_local() if isinstance(t, DTensor) else t
        block = qshape[-1] // sshape[-1]
        q = torch.empty(local.shape, dtype=qdtype, device=local.device)
        scale = torch.empty((*local.shape[:-1], local.shape[-1] // block), dtype=sdtype, device=local.device)
        optim[k + Q] = _wrap(q, t, tuple(qshape))
        optim[k + SCALE] = _wrap(scale, t, tuple(sshape))
        swapped.append((k, t, m[1]))
    return swapped


def dequantize_loaded(targets: dict[str, Any], swapped: list[tuple[str, torch.Tensor, bool]]) -> None:
    """Write the dequantized moments into their fp32 targets and put those back in ``targets``."""
    if not swapped:
        return
    optim = targets["optim"]
    for k, t, sqrt in swapped:
        q, scale = optim.pop(k + Q), optim.pop(k + SCALE)
        q = q.to_local() if isinstance(q, DTensor) else q
        scale = scale.to_local() if isinstance(scale, DTensor) else scale
        local = t.to_local() if isinstance(t, DTensor) else t
        local.copy_(dequantize(q, scale, sqrt))
        optim[k] = t


def describe(info: dict[str, Any] | None) -> str:
    """One line for inspect/verify: what is quantized and the bytes it saves."""
    if not info or info.get("mode", "none") == "none" or not info.get("keys"):
        return "optimizer state: not quantized"
    fp32, stored = info.get("moment_bytes_fp32", 0), info.get("moment_bytes_stored", 0)
    blocks = sorted(set(info["keys"].values()), reverse=True)
    from workbench.units import format_bytes

    return (f"optimizer state: {info['mode']} with block-wise fp32 scales (block {'/'.join(map(str, blocks))}), "
            f"{len(info['keys'])} moments quantized (exp_avg_sq on its square root); moments "
            f"{format_bytes(stored)} instead of {format_bytes(fp32)} ({stored / max(fp32, 1):.3f}x)")
