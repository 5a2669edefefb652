"""Formats: read any checkpoint one tensor at a time, and convert between DCP, safetensors and torch.save.

Every source is seen through *canonical keys*, the workbench DCP names (``model.<fqn>``, ``optim.state...``,
``master.<fqn>``), whatever its file format, so that diff, export and import agree on names::

    DCP / workbench step dir     model.layers.0.attention.wq.weight      (as stored)
    HF export (names="hf-llama")  model.layers.0.self_attn.q_proj.weight (Hugging Face Llama names: the
                                  default of to="hf"; config.json is one transformers loads)
    HF export (names="workbench") layers.0.attention.wq.weight           ("model." stripped from weights;
                                  config.json names a model_type transformers refuses)
    optimizer / master shard sets optim.state.<fqn>.exp_avg, master.<fqn> (kept whole: they need a prefix)

Conversions stream: tensors are read and written one at a time, so peak memory is one tensor (plus one
shard for torch.save output, which needs the whole dict). DCP reads go through
``dcp.load({key: tensor}, storage_reader=SafeFileSystemReader(...))``, single process, no process group.
safetensors files are written by a streaming writer: the header is known up front from the manifest::

    [8-byte N][N bytes JSON header, space-padded to 8][tensor 0 bytes][tensor 1 bytes]...

Hugging Face Llama weights rotate the halves ``(x[:d/2], x[d/2:])`` of each head; this model rotates the
pairs ``(x[2i], x[2i+1])``. With ``names="hf-llama"`` the rows of wq and wk are permuted per head so that
both conventions compute the same attention scores (the permutation Meta's conversion script uses). Reading
HF-named weights without a config serves every tensor but wq/wk, whose permutation needs the head counts.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from workbench.progress import tqdm

from workbench.checkpoint.contents import inspect
from workbench.checkpoint.destination import ExportDestination
from workbench.checkpoint.manifest import CheckpointManifest
from workbench.checkpoint.safeload import SAFETENSORS_DTYPES, CheckpointFormatError, read_torch_file
from workbench.checkpoint.state import hyper_groups, is_packed_hyper
from workbench.disk import storage_error
from workbench.kinds import KEY_PREFIXES, checkpoint_kind
from workbench.safeio import CONFIG_MAX, confine, open_regular, regular_size
from workbench.units import format_bytes

__all__ = ["TensorSource", "open_source", "read_tensor", "iter_tensors", "export", "ExportResult",
           "load_into", "parse_size", "model_config_of", "FORMATS"]

FORMATS = ("hf", "safetensors", "torch", "dcp")
_PREFIXES = (*KEY_PREFIXES, "master")  # workbench key prefixes, plus master.* from other tools (workbench.kinds)
_ST_CODE = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def parse_size(size: int | str) -> int:
    """``2GiB`` -> 2_147_483_648, ``512MiB`` -> 536_870_912, ints as bytes; ``2GB`` -> 2_000_000_000 (decimal,
    as Hugging Face writes sizes). Every size the tools print is binary (KiB, MiB, GiB: workbench.units)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(size), re.I)
    if not m:
        raise ValueError(f"max shard size {size!r} is not a size; write e.g. 2GiB, 500MiB or 1048576")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


# --------------------------------------------------------------------------------------------------
# Hugging Face Llama names
# --------------------------------------------------------------------------------------------------

_LLAMA_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
                "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_LLAMA_ROOT = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
_HF_LLAMA_HINT = re.compile(r"(^|\.)(self_attn|embed_tokens|lm_head|input_layernorm)(\.|$)")


def to_hf_llama_name(fqn: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if fqn in _LLAMA_ROOT:
        return _LLAMA_ROOT[fqn]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", fqn)
    if not m or m.group(2) not in _LLAMA_LAYER:
        raise ValueError(f"{fqn!r} has no Hugging Face Llama name (mixture-of-experts weights have none); "
                         "export with names='workbench'")
    return f"model.layers.{m.group(1)}.{_LLAMA_LAYER[m.group(2)]}.{m.group(3)}"


def from_hf_llama_name(name: str) -> str:
    inv_root = {v: k for k, v in _LLAMA_ROOT.items()}
    if name in inv_root:
        return inv_root[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    inv = {v: k for k, v in _LLAMA_LAYER.items()}
    if not m or m.group(2) not in inv:
        raise ValueError(f"{name!r} is not a Hugging Face Llama weight name this model has")
    return f"layers.{m.group(1)}.{inv[m.group(2)]}.{m.group(3)}"


def _rope_permute(w: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Rows of a q/k projection, per head: pairs (2i, 2i+1) <-> halves (i, i + d/2)."""
    out, inp = w.shape
    d = out // heads
    if to_hf:
        return w.view(heads, d // 2, 2, inp).transpose(1, 2).reshape(out, inp)
    return w.view(heads, 2, d // 2, inp).transpose(1, 2).reshape(out, inp)


def _needs_heads(key: str) -> bool:
    """Whether the tensor under canonical ``key`` is a q/k projection (permuted per head in HF names)."""
    return key.startswith("model.") and key.endswith(("attention.wq.weight", "attention.wk.weight"))


def _heads_for(fqn: str, model_cfg) -> int | None:
    if model_cfg is None:
        return None
    if fqn.endswith("attention.wq.weight"):
        return model_cfg.n_heads
    if fqn.endswith("attention.wk.weight"):
        return model_cfg.n_kv_heads
    return None


# --------------------------------------------------------------------------------------------------
# Reading: one tensor at a time, under canonical keys
# --------------------------------------------------------------------------------------------------

@dataclass
class TensorSource:
    """A checkpoint opened for reading tensors one at a time under canonical (workbench DCP) keys.

    ``keys`` maps canonical key -> stored key; ``manifest`` is the source's own manifest.
    """

    manifest: CheckpointManifest
    names: str = "workbench"  # how the source names weights: "workbench" or "hf-llama"
    model_cfg: Any = None  # ModelConfig, needed to undo the hf-llama q/k permutation
    cfg_problem: str | None = None  # why the config.json beside the weights did not read, if it did not
    keys: dict[str, str] = field(default_factory=dict)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)
    _reader: Any = field(default=None, repr=False)
    _torch: dict[str, Any] | None = field(default=None, repr=False)
    _sizes: dict[str, int] = field(default_factory=dict, repr=False)  # DCP data file -> bytes (claims checked)

    def canonical_rows(self) -> list[dict]:
        """Manifest rows (tensors only) renamed to canonical keys, in the source's order."""
        rows = []
        stored_to_canon = {v: k for k, v in self.keys.items()}
        for r in self.manifest.tensors().to_dict("records"):
            if r["key"] in stored_to_canon:
                rows.append({**r, "key": stored_to_canon[r["key"]], "stored_key": r["key"]})
        return rows

    def get(self, key: str) -> torch.Tensor:
        """The tensor stored under canonical ``key``, read on its own (CPU, its stored dtype)."""
        if key not in self.keys:
            import difflib

            close = difflib.get_close_matches(key, list(self.keys), n=3)
            raise KeyError(f"{key!r} is not a tensor of {self.manifest.path}" + (f"; did you mean {close}?" if close else ""))
        stored = self.keys[key]
        if self.names == "hf-llama" and self.model_cfg is None and _needs_heads(key):
            why = f" (its config.json does not read: {self.cfg_problem})" if self.cfg_problem else ""
            raise CheckpointFormatError(self.manifest.path, f"{stored!r} is stored with Hugging Face's q/k rotary "
                                        "permutation, and undoing it needs the model's num_attention_heads and "
                                        f"num_key_value_heads{why}", "put the model's config.json next to the "
                                        "weights (or pass model_cfg=ModelConfig(...)); every other tensor reads "
                                        "without it")
        t = self._read_stored(stored)
        if self.names == "hf-llama":
            heads = _heads_for(key.removeprefix("model."), self.model_cfg)
            if heads:
                t = _rope_permute(t, heads, to_hf=False)
        return t

    def _read_stored(self, stored: str) -> torch.Tensor:
        m = self.manifest
        row = m.row(stored)
        self._check_present(row)
        if row["shape"] is None:
            raise CheckpointFormatError(m.path, f"{stored!r} is a pickled value, not a tensor; it is not loaded",
                                        "only tensors are read (unpickling checkpoint values runs code)")
        if m.format in ("dcp", "workbench"):
            return self._read_dcp(stored, row)
        if m.format in ("hf", "safetensors"):
            shard = row["shards"][0]
            f = self._shard_path(shard["file"])
            if shard["file"] not in self._handles:
                self._handles[shard["file"]] = open_regular(f, "safetensors file", error=CheckpointFormatError)
            data = _pread_exact(self._handles[shard["file"]], shard["byte_offset"], shard["byte_length"], f)
            return data.view(getattr(torch, row["dtype"])).reshape(row["shape"])
        if self._torch is None:
            self._torch = read_torch_file(m.path)
        return self._torch[stored]

    def _shard_path(self, name: str) -> Path:
        """The data file ``name`` of this checkpoint: the file itself, or a file inside its directory (a name
        or link leading out of it is refused before anything is opened)."""
        m = self.manifest
        if not m.path.is_dir():
            return m.path
        return confine(m.path, name, m.path, "data file", error=CheckpointFormatError)

    def _check_present(self, row: dict) -> None:
        """A checkpoint deleted or moved since it was opened is named as that, not as a damaged file."""
        m = self.manifest
        shards = row.get("shards") or []
        files = [m.path / s["file"] for s in shards if s.get("file")] if m.path.is_dir() else [m.path]
        gone = next((f for f in files if not f.exists()), None)
        if gone is not None:
            raise CheckpointFormatError(gone, "no such file: the checkpoint was deleted or moved after it was opened",
                                        "open it again from where it is now")

    def _read_dcp(self, stored: str, row: dict) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from workbench.checkpoint.safeload import SafeFileSystemReader, check_tensor_claim

        dtype = getattr(torch, row["dtype"])
        # the shape is the metadata's claim: held against the chunks and the data files before it is allocated
        check_tensor_claim(self.manifest.path, stored, row["shape"], dtype,
                           [(s["file"], s["offsets"], s["lengths"]) for s in row["shards"]], self._sizes)
        if self._reader is None:
            self._reader = SafeFileSystemReader(str(self.manifest.path))
        t = torch.empty(row["shape"], dtype=dtype)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
                dcp.load({stored: t}, storage_reader=self._reader, no_dist=True)
        except CheckpointFormatError:
            raise
        except (Exception, CheckpointException) as e:  # (DCP's CheckpointException is a BaseException)
            refused = _refusal_in(e)  # our reader refused to open a file (outside, a FIFO, too large): that line
            if refused is not None and refused.reason != "format":
                raise refused from None
            # a corrupted or truncated shard: torch.load of its slice fails inside DCP's read step
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            msg = (lines[-1] if lines else type(e).__name__).split(". ")[0][:160]
            raise CheckpointFormatError(self._bad_file(row), f"cannot read {stored!r} ({msg})",
                                        "the shard file is corrupted or truncated; run `workbench ckpt verify` "
                                        "and restore it or use another step") from None
        return t

    def _bad_file(self, row: dict) -> Path:
        """The shard file whose slice for ``row`` does not load (tried one by one; for error messages)."""
        import io

        from types import SimpleNamespace

        from workbench.checkpoint.directread import scan_item_pickle

        for s in row["shards"]:
            f = self.manifest.path / s["file"]
            try:
                with open_regular(self._shard_path(s["file"]), "DCP data file", error=CheckpointFormatError) as fh:
                    item = SimpleNamespace(offset=s["byte_offset"], length=s["byte_length"])
                    scan_item_pickle(fh, item, f, row["key"])  # torch.load below must not meet a hostile pickle
                    fh.seek(s["byte_offset"])
                    data = fh.read(s["byte_length"])
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception:
                return f
        return self.manifest.path


def _refusal_in(e: BaseException) -> CheckpointFormatError | None:
    """The CheckpointFormatError our reader raised inside ``dcp.load``, which DCP wraps per rank, or None."""
    for _ in range(5):
        if isinstance(e, CheckpointFormatError):
            return e
        failures = getattr(e, "failures", None)
        if not isinstance(failures, dict) or not failures:
            return None
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    return None


def _pread_exact(fh, offset: int, length: int, path: Path) -> torch.Tensor:
    """``length`` bytes of an open file from ``offset``, as a fresh uint8 tensor.

    safetensors tensors are read this way, by the offsets of the (already checked) header, rather than
    through the safetensors library, so every dtype torch has reads, whatever that library's version knows
    (older ones raise KeyError on F8_E8M0).
    """
    out = torch.empty(length, dtype=torch.uint8)
    view, done = memoryview(out.numpy()), 0
    while done < length:
        n = os.preadv(fh.fileno(), [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointFormatError(path, f"ends inside a tensor (byte {offset + done} of {offset + length} "
                                        "needed)", "the file is truncated; re-export or re-download it")
        done += n
    return out


def model_config_of(m: CheckpointManifest):
    """The ModelConfig a checkpoint records (workbench.json job, export metadata, config.json), or None."""
    from workbench.config import ModelConfig

    job = m.info.get("job") or {}
    recorded = job.get("model") if "model" in job else m.info.get("model")
    if isinstance(recorded, dict):
        try:
            return ModelConfig.from_dict(recorded)
        except (ValueError, TypeError, KeyError) as e:  # a damaged manifest: named as that, in one line
            raise CheckpointFormatError(m.path, f"records a model config that does not read back ({type(e).__name__}: "
                                        f"{str(e).splitlines()[0][:160] if str(e).strip() else 'no detail'})",
                                        "the checkpoint's metadata is damaged; pass the model explicitly") from None
    base = m.path if m.path.is_dir() else m.path.parent
    cfg = confine(base, "config.json", base, "model config", error=CheckpointFormatError)  # not a link out
    if cfg.exists():
        regular_size(cfg, "model config", limit=CONFIG_MAX, error=CheckpointFormatError)
        try:
            return ModelConfig.from_hf_config(cfg)
        except ValueError:
            return None
    return None


def open_source(src: "str | os.PathLike | CheckpointManifest | TensorSource", names: str = "auto",
                model_cfg=None) -> TensorSource:
    """Open ``src`` for tensor reads. ``names``: "auto" (detect), "workbench" or "hf-llama"."""
    if isinstance(src, TensorSource):
        return src
    m = src if isinstance(src, CheckpointManifest) else inspect(src)
    stored = list(m.tensors()["key"])
    if names == "auto":
        names = m.info.get("names") or ("hf-llama" if any(_HF_LLAMA_HINT.search(k) for k in stored) else "workbench")
    keys: dict[str, str] = {}
    for k in stored:
        if m.format in ("dcp", "workbench"):
            canon = k
        elif names == "hf-llama" and (k.startswith("model.") or k == "lm_head.weight"):
            try:
                canon = "model." + from_hf_llama_name(k)
            except ValueError:  # e.g. rotary_emb.inv_freq buffers of older exports: kept, under their own name
                canon = "unmapped." + k
        elif k.split(".", 1)[0] in _PREFIXES:
            canon = k
        else:
            canon = "model." + k
        keys[canon] = k
    # Without a config, HF-named q/k projections cannot be un-permuted: TensorSource.get refuses those (naming
    # the config it needs) and serves every other tensor.
    cfg = model_cfg or model_config_of(m)
    problem = _config_problem(m) if cfg is None and names == "hf-llama" else None
    return TensorSource(manifest=m, names=names, model_cfg=cfg, keys=keys, cfg_problem=problem)


def _config_problem(m: CheckpointManifest) -> str | None:
    """Why the config.json beside a checkpoint does not read as a ModelConfig (None: there is none, or it reads)."""
    from workbench.config import ModelConfig

    base = m.path if m.path.is_dir() else m.path.parent
    cfg = base / "config.json"
    if not cfg.is_file():
        return None
    try:
        ModelConfig.from_hf_config(confine(base, "config.json", base, "model config", error=CheckpointFormatError))
    except ValueError as e:
        return str(e).splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return None


def read_tensor(src, key: str) -> torch.Tensor:
    """One tensor of any checkpoint, by canonical key (``model.<fqn>`` etc.), read on its own."""
    return open_source(src).get(key)


def iter_tensors(src, keys: Iterable[str] | None = None, kinds: Iterable[str] | None = None,
                 progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical key, tensor)`` one at a time; drop each before the next to keep memory at one tensor."""
    source = open_source(src)
    rows = source.canonical_rows()
    if kinds is not None:
        kinds = set(kinds)
        rows = [r for r in rows if r["kind"] in kinds]
    if keys is not None:
        wanted = list(keys)
        have = {r["key"] for r in rows}
        rows = [{"key": k} for k in wanted if k in have]
    for r in tqdm(rows, desc="tensors", unit="tensor", disable=not progress, leave=False):
        yield r["key"], source.get(r["key"])


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

def _tensor_bytes(t: torch.Tensor):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def write_safetensors_streaming(path: Path, entries: list[tuple[str, torch.dtype, tuple]],
                                tensor_of: Callable[[int, str], torch.Tensor],
                                metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file whose entries are known up front, fetching one tensor at a time.

    ``entries``: ``(name, dtype, shape)`` in file order; ``tensor_of(i, name)`` returns entry ``i``.
    Returns the file size.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_CODE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i, (name, dtype, shape) in enumerate(entries):
            t = tensor_of(i, name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: expected {dtype}{list(shape)}, read {t.dtype}{list(t.shape)}")
            f.write(_tensor_bytes(t))
            del t
    os.replace(tmp, path)
    return 8 + len(raw) + offset


@dataclass
class ExportResult:
    """What :func:`export` wrote."""

    dst: Path
    to: str
    files: list[str]
    tensors: int
    bytes: int
    by_kind: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"dst": str(self.dst), "to": self.to, "files": self.files, "tensors": self.tensors,
                "bytes": self.bytes, "bytes_by_kind": self.by_kind}

    def _repr_html_(self) -> str:
        return (f"<b>exported</b> {self.tensors} tensors ({format_bytes(self.bytes)}) to <code>{self.dst}</code> as "
                f"{self.to}: {', '.join(self.files[:6])}{' ...' if len(self.files) > 6 else ''}")


def _out_name(canon: str, kind: str, names: str) -> str:
    if kind != "model" or not canon.startswith("model."):
        return canon
    fqn = canon.removeprefix("model.")
    return to_hf_llama_name(fqn) if names == "hf-llama" else fqn


def export(src, dst: str | os.PathLike, to: str = "hf", include: Iterable[str] = ("model",),
           max_shard_size: int | str = "2GiB", names: str | None = None, overwrite: bool = False,
           progress: bool = True, keep_quant: bool = False) -> ExportResult:
    """Convert ``src`` (any checkpoint) to ``to``, streaming tensor by tensor.

    ``to``: ``hf`` (a directory of ``<set>-0000i-of-0000n.safetensors`` + ``<set>.safetensors.index.json`` per
    shard set: model, optimizer, master), ``safetensors`` (one consolidated file), ``torch`` (one
    torch.save file) or ``dcp`` (a single-writer DCP directory, from a non-DCP source). ``include``: the
    kinds to export ("model", "optimizer", "master", "rng", "extra"). ``names``: "hf-llama" (the default of
    ``to="hf"`` for this model: Hugging Face Llama names, q/k permuted, and a config.json that transformers
    loads; tied embeddings are written once, as HF does) or "workbench" (the default of the other formats, and
    of a checkpoint of another model, which records no config and has no q/k projections; with ``to="hf"``
    its config.json names a model_type transformers refuses, rather than let it half-load). Names apply to
    weights; optimizer state keeps its workbench keys. ``overwrite``: replace an existing ``dst``
    that is a file, an empty directory or an export of ours; ``dst`` that is, holds or lies inside ``src`` is
    refused (ValueError) either way. The export is written beside ``dst`` and renamed into place at the end:
    a failed export leaves ``dst`` as it was (:mod:`workbench.checkpoint.destination`).
    Optimizer state saved quantized (``--ckpt-quant``) is exported dequantized to fp32 under its own keys,
    or, with ``keep_quant``, as stored (``<key>.q`` + ``<key>.qscale``).
    """
    if to not in FORMATS:
        raise ValueError(f"unknown format {to!r}; choose one of {list(FORMATS)}")
    if names not in (None, "workbench", "hf-llama"):
        raise ValueError(f"names={names!r} is unknown; choose 'workbench' or 'hf-llama'")
    include = list(dict.fromkeys(checkpoint_kind(k) for k in include))  # "optim", "Optimizer" -> "optimizer"
    source = open_source(src)
    m = source.manifest
    rows = [r for r in source.canonical_rows() if r["kind"] in include]
    dequant: dict[str, tuple[str, str, bool]] = {}  # fp32 key -> (q key, scale key, on its square root)
    if m.quant and not keep_quant:
        from workbench.checkpoint.quant import SCALE, Q, is_sqrt

        by_key = {r["key"]: r for r in rows}
        for key in m.quant["keys"]:
            q = by_key.pop(key + Q, None)
            by_key.pop(key + SCALE, None)
            if q is not None:
                numel = int(math.prod(q["shape"]))
                by_key[key] = {**q, "key": key, "dtype": "float32", "bytes": numel * 4}
                dequant[key] = (key + Q, key + SCALE, is_sqrt(key))
        rows = sorted(by_key.values(), key=lambda r: r["key"])
    if not rows:
        raise ValueError(f"{m.path} has no tensors of kind(s) {include}; it holds "
                         f"{sorted(set(m.tensors()['kind']))}")
    if to == "dcp" and m.format in ("dcp", "workbench"):
        raise ValueError(f"{m.path} is already DCP: DCP reshards at load time (see plan_load); "
                         "convert to hf/safetensors/torch instead")
    dst = Path(dst)
    # Before a byte is read or written: DST is not the source (nor holds it, nor lies in it), and what an
    # existing DST holds may be replaced (workbench.checkpoint.destination).
    target = ExportDestination(dst, _source_paths(src, m), overwrite=overwrite, is_dir=to in ("hf", "dcp"))
    model_cfg = source.model_cfg
    has_model = any(r["kind"] == "model" for r in rows)
    if names is None:
        # to="hf": HF names for this model (a config recorded, or its q/k projections seen); a checkpoint of
        # some other model keeps its own names, and with no config.json transformers refuses it whole
        ours = model_cfg is not None or any(_needs_heads(r["key"]) for r in rows)
        names = "hf-llama" if to == "hf" and ours else "workbench"
    if names == "hf-llama" and has_model:
        if model_cfg is None:
            raise ValueError(f"Hugging Face names (names='hf-llama', the default of --to hf) need the model config "
                             f"(head counts) and {m.path} does not record it; put its config.json next to it, or "
                             "export workbench names with --names workbench (names='workbench'), which transformers "
                             "does not load")
        if model_cfg.n_experts:
            raise ValueError(f"{m.path} is a mixture-of-experts model (n_experts={model_cfg.n_experts}), which has "
                             "no Hugging Face Llama names; export workbench names with --names workbench "
                             "(names='workbench'), which transformers does not load")
    if source.names == "hf-llama" and source.model_cfg is None and any(_needs_heads(r["key"]) for r in rows):
        source.get(next(r["key"] for r in rows if _needs_heads(r["key"])))  # the one-line refusal, before writing
    if names == "hf-llama" and model_cfg is not None and model_cfg.tie_embeddings:
        # tied: HF writes the shared matrix once, as embed_tokens (lm_head is tied to it on load)
        rows = [r for r in rows if r["key"] != "model.output.weight"]
    meta = {"format": "pt", "source": str(m.path), "names": names}
    if m.step is not None:
        meta["step"] = str(m.step)
    # The optimizer's param groups (lr, betas, weight decay, ... per group of parameters) are one packed
    # uint8 item, kept as such so that an export loads back exactly; readable JSON goes beside it, in the
    # optimizer files' metadata, for whoever opens the export without workbench.
    packed = [r["key"] for r in rows if is_packed_hyper(r["key"])]
    param_groups = hyper_groups([source.get(k) for k in packed]) if packed else []
    opt_meta = {"optimizer_param_groups": json.dumps(param_groups, sort_keys=True)} if param_groups else {}

    def fetch(canon: str) -> torch.Tensor:
        if canon in dequant:
            from workbench.checkpoint.quant import dequantize

            qk, sk, sqrt = dequant[canon]
            return dequantize(source.get(qk), source.get(sk), sqrt)
        t = source.get(canon)
        heads = _heads_for(canon.removeprefix("model."), model_cfg) if names == "hf-llama" else None
        return _rope_permute(t, heads, to_hf=True) if heads else t

    by_kind: dict[str, int] = {}
    for r in rows:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + int(r["bytes"])
    total = sum(by_kind.values())
    limit = parse_size(max_shard_size)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"export {to}", disable=not progress, leave=False)

    def fetch_counted(canon: str) -> torch.Tensor:
        t = fetch(canon)
        bar.update(t.numel() * t.element_size())
        return t

    files: list[str] = []
    try:
        # written under a temporary name beside DST and swapped in whole: a failed or killed export leaves
        # the old DST as it was, and no half-written one
        with target.writing() as out:
            if to == "hf":
                for kind in include:
                    set_rows = [r for r in rows if r["kind"] == kind]
                    if not set_rows:
                        continue
                    prefix = kind  # one HF index per kind, named after it
                    shards: list[list[dict]] = [[]]
                    size = 0
                    for r in set_rows:  # greedy, in key order, like Hugging Face's shard_checkpoint
                        if shards[-1] and size + r["bytes"] > limit:
                            shards.append([])
                            size = 0
                        shards[-1].append(r)
                        size += r["bytes"]
                    weight_map = {}
                    for i, shard in enumerate(shards):
                        fname = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                        entries = [(_out_name(r["key"], kind, names), getattr(torch, r["dtype"]), tuple(r["shape"]))
                                   for r in shard]
                        write_safetensors_streaming(out / fname, entries,
                                                    lambda j, _n, s=shard: fetch_counted(s[j]["key"]),
                                                    {**meta, **opt_meta} if kind == "optimizer" else meta)
                        weight_map.update({e[0]: fname for e in entries})
                        files.append(fname)
                    index = {"metadata": {"total_size": by_kind[kind], "format": "workbench-export", "names": names,
                                          "kind": kind, **({"step": m.step} if m.step is not None else {}),
                                          **({"model": model_cfg.to_dict()} if model_cfg is not None else {}),
                                          **({"param_groups": param_groups} if kind == "optimizer" and param_groups
                                             else {})},
                             "weight_map": weight_map}
                    (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))
                    files.append(f"{prefix}.safetensors.index.json")
                model_rows = [r for r in rows if r["kind"] == "model"]
                if model_cfg is not None and model_rows:
                    from workbench.hf_config import hf_config_dict, workbench_names_config

                    dtype = model_rows[0]["dtype"]
                    doc = (hf_config_dict if names == "hf-llama" else workbench_names_config)(model_cfg, dtype)
                    (out / "config.json").write_text(json.dumps(doc, indent=2))
                    files.append("config.json")
            elif to == "safetensors":
                entries = [(_out_name(r["key"], r["kind"], names), getattr(torch, r["dtype"]), tuple(r["shape"]))
                           for r in rows]
                write_safetensors_streaming(out, entries, lambda j, _n: fetch_counted(rows[j]["key"]),
                                            {**meta, **opt_meta,
                                             **({"model": json.dumps(model_cfg.to_dict())} if model_cfg else {})})
                files.append(dst.name)
            elif to == "torch":
                # torch.save takes one dict: this output alone holds every exported tensor in memory.
                sd = {_out_name(r["key"], r["kind"], names): fetch_counted(r["key"]) for r in rows}
                torch.save(sd, out)
                files.append(dst.name)
            else:  # dcp
                _save_dcp_from(source, rows, out, fetch_counted)
                files = sorted(f.name for f in out.iterdir())
            target.commit(to, str(m.path), files)
    except OSError as e:
        named = storage_error(e, doing="writing the export to", where=dst, needed=total,
                              fix="free space there or choose another destination")
        if named is None:
            raise
        raise named from e
    finally:
        bar.close()
    return ExportResult(dst=dst, to=to, files=files, tensors=len(rows), bytes=total, by_kind=by_kind)


def _source_paths(src, m: CheckpointManifest) -> list[Path]:
    """What an export reads: the path it was given (a run directory, say) and the checkpoint that resolved to."""
    given = [Path(src)] if isinstance(src, (str, os.PathLike)) else []
    return [*given, Path(m.path)]


def _save_dcp_from(source: TensorSource, rows: list[dict], dst: Path, fetch) -> None:
    """A single-writer DCP checkpoint (dcp.save takes one dict).

    Safetensors sources with workbench names are memory-mapped, so that dict costs no anonymous memory;
    other sources (torch.save is mmapped by torch.load too; hf-llama names need the q/k permutation) are
    read tensor by tensor into it.
    """
    import torch.distributed.checkpoint as dcp

    m = source.manifest
    sd: dict[str, torch.Tensor] = {}
    if m.format in ("hf", "safetensors") and source.names == "workbench":
        mapped = _mmap_safetensors(m)
        for r in rows:
            sd[r["key"]] = mapped[r["stored_key"]]
    else:
        for r in rows:
            sd[r["key"]] = fetch(r["key"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(dst), single_file_per_rank=True), no_dist=True)


def _mmap_safetensors(m: CheckpointManifest) -> dict[str, torch.Tensor]:
    """Stored key -> a tensor viewing the file's pages (copy-on-write map; nothing read until used)."""
    import numpy as np

    from workbench.checkpoint.safeload import read_safetensors_header

    out = {}
    for rel in m.files:
        if not rel.endswith(".safetensors"):
            continue
        f = confine(m.path, rel, m.path, "safetensors file", error=CheckpointFormatError) if m.path.is_dir() else m.path
        header, start = read_safetensors_header(f)  # opens only a regular file
        buf = np.memmap(f, dtype=np.uint8, mode="c")
        for key, e in header.items():
            if key == "__metadata__":
                continue
            b, end = e["data_offsets"]
            dtype = SAFETENSORS_DTYPES[e["dtype"]]
            t = torch.from_numpy(buf[start + b:start + end]) if end > b else torch.empty(0, dtype=torch.uint8)
            out[key] = t.view(dtype).reshape(e["shape"])
    return out


def load_into(model: torch.nn.Module, src, strict: bool = True, progress: bool = True) -> dict[str, list[str]]:
    """Copy a checkpoint's model weights into ``model`` (plain tensors), one tensor at a time.

    Returns ``{"missing": [...], "unexpected": [...]}`` (FQNs); raises ValueError on a shape mismatch,
    or when ``strict`` and any key is missing or unexpected.
    """
    source = open_source(src)
    have = {k.removeprefix("model."): k for k in source.keys if k.startswith("model.")}
    sd = model.state_dict()
    missing = sorted(set(sd) - set(have))
    unexpected = sorted(set(have) - set(sd))
    if strict and (missing or unexpected):
        raise ValueError(f"{source.manifest.path} does not match the model: {len(missing)} missing "
                         f"(first {missing[:2]}), {len(unexpected)} unexpected (first {unexpected[:2]}); "
                         "pass strict=False to load the overlap")
    with torch.no_grad():
        for fqn in tqdm([k for k in sd if k in have], desc="load", unit="tensor", disable=not progress, leave=False):
            t = source.get(have[fqn])
            if tuple(t.shape) != tuple(sd[fqn].shape):
                raise ValueError(f"{fqn}: checkpoint shape {list(t.shape)} != model shape {list(sd[fqn].shape)}; "
                                 "the checkpoint is of another model config")
            sd[fqn].copy_(t)
    return {"missing": missing, "unexpected": unexpected}
