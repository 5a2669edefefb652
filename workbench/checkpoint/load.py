"""Loading a checkpoint into whatever layout the model has now: model only, or the full train state.

DCP stores every tensor under its global key with each shard's global offsets. Loading asks for the
tensors *this* layout holds (a tp shard, an FSDP shard, a whole replicated tensor) and DCP reads the
overlapping pieces of whichever shards were saved::

    saved under tp=2:      wq = [rows 0..63 | rows 64..127]        (each half in its rank's files)
    loaded by dp_shard=2:  rank 0 asks rows 0..63, rank 1 rows 64..127    -> same bytes, new owners
    loaded by 1 process:   asks rows 0..127                                -> both files

So save under tp=2 and load under dp_shard=2, fsdp x tp into one process, pp=2 into pp=1 (a pipeline
rank's keys are the full model's FQNs), ep=2 into ep=1: all the same call.

Before anything is read, the request is checked against the checkpoint's metadata, and a different
model is refused in one line naming the first key that does not fit::

    ValueError: checkpoint step-000003 does not fit this model: model.tok_embeddings.weight is
    (256, 128) in the checkpoint but (512, 128) here; use the model config it was saved with

``.metadata`` (a pickle written by DCP) is read with ``workbench.checkpoint.safeload``'s unpickler,
which only admits DCP's metadata classes, ``torch.Size`` and dtypes; every key loaded is a tensor, its
bytes read straight into place (:mod:`workbench.checkpoint.directread`, whose archive parser resolves no
globals), or where that reader cannot place an item, with ``torch.load(weights_only=True)``. Moments
saved quantized (``quant``) are read as stored and dequantized into the optimizer's fp32 state.
"""

from __future__ import annotations

import html
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from workbench.checkpoint import quant
from workbench.checkpoint.index import index_metadata
from workbench.checkpoint.safeload import SafeFileSystemReader, check_claims, read_dcp_metadata
from workbench.checkpoint.state import TrainState, is_packed_hyper, local_optimizer
from workbench.checkpoint.store import MANIFEST, BackgroundVerify, read_manifest, resolve_checkpoint

__all__ = ["load", "LoadResult", "read_metadata", "checkpoint_shapes", "check_model_fits", "check_resume"]

def read_metadata(ckpt_dir: str | Path) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint directory, through ``safeload``'s restricted unpickler."""
    return read_dcp_metadata(ckpt_dir)


def checkpoint_shapes(ckpt_dir: str | Path, metadata: Metadata | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global key -> (shape, dtype) of every tensor in the checkpoint."""
    md = metadata if metadata is not None else read_metadata(ckpt_dir)
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _leaves(sd: dict[str, Any], prefix: str = ""):
    """(flat DCP key, containing dict, key in it) for every tensor of a nested state dict."""
    for k, v in list(sd.items()):
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", sd, k


def _fmt(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def check_model_fits(ckpt_dir: str | Path, model_state: dict[str, torch.Tensor], name: str | None = None,
                     shapes: dict | None = None) -> None:
    """Raise one ValueError naming the first ``model.*`` key that is missing or has another shape."""
    shapes = shapes if shapes is not None else checkpoint_shapes(ckpt_dir)
    name = name or Path(ckpt_dir).name
    for fqn, t in model_state.items():
        key = f"model.{fqn}"
        if key not in shapes:
            raise ValueError(f"checkpoint {name} does not fit this model: it has no {key}; "
                             "use the model config it was saved with (see its workbench.json)")
        if tuple(t.shape) != shapes[key][0]:
            raise ValueError(f"checkpoint {name} does not fit this model: {key} is {_fmt(shapes[key][0])} in "
                             f"the checkpoint but {_fmt(t.shape)} here; use the model config it was saved with")


@dataclass
class LoadResult:
    """What was loaded: from where, which step, and which parts of the state."""

    path: Path
    step: int
    consumed_samples: int
    kinds: list[str]
    skipped: list[str] = field(default_factory=list)  # keys asked for but not in the checkpoint
    manifest: dict[str, Any] = field(default_factory=dict)
    # How this rank's tensors were read (directread.ReadStats.to_dict()): "path" is "direct" (every item
    # read straight into place), "direct+narrow" (some items were parts of saved chunks: the layout
    # changed), "mixed" or "dcp" (items DCP's torch.load path read; "dcp_reasons" says why), or "mmap"
    # (tensors left on the mapped files: "mapped", "mapped_bytes"; "copied", "copied_bytes" the rest);
    # "mmap" what was asked ("auto", "on", "off") and "not_mapped" why tensors were not mapped.
    read: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "consumed_samples": self.consumed_samples,
                "kinds": self.kinds, "skipped": self.skipped,
                "saved_layout": self.manifest.get("layout"), "saved_world_size": self.manifest.get("world_size"),
                "read": self.read, "quant": (self.manifest.get("quant") or {}).get("mode", "none")}

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in self.to_dict().items())
        return f"<table><caption>Loaded checkpoint</caption>{rows}</table>"


def _group(process_group):
    if not dist.is_initialized():
        return None
    return process_group or dist.group.WORLD


def _resolve_everywhere(path: str | Path, group, verify: bool) -> Path:
    """Rank 0 resolves (and verifies) the checkpoint; every rank gets the same answer or error."""
    rank = dist.get_rank(group) if group is not None else 0
    answer: list[Any] = [None]
    if rank == 0:
        try:
            answer[0] = str(resolve_checkpoint(path, verify_checksums=verify))
        except ValueError as e:
            answer[0] = ValueError(str(e))
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(answer, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(answer[0], ValueError):
        raise answer[0]
    return Path(answer[0])


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         scheduler=None, ema=None, rng: bool = False, process_group=None, verify: bool = True,
         direct: bool = True, mmap: bool | None = None) -> LoadResult:
    """Load a checkpoint into ``model`` as it is laid out now (any layout); with ``optimizer``, the full state.

    ``path``: a ``step-NNNNNN`` directory, a ``checkpoints/`` directory or a run directory (its newest
    complete checkpoint). Every rank of ``process_group`` calls this. ``model`` may be a whole model,
    a parallelized one, or a pipeline rank's ``nn.ModuleList`` of stages. ``optimizer`` (and
    ``scheduler``, ``ema``, ``rng``) restore the rest of the train state. ``verify``: check every file's
    checksum against the manifest (rank 0, on a thread, while every rank reads). A mismatch is refused
    before the optimizer, scheduler and RNG take the values; a run or checkpoints directory then falls back
    to its newest intact step and loads that. ``direct``: read tensor bytes straight into place
    (:mod:`workbench.checkpoint.directread`; DCP still plans which saved chunks each tensor needs);
    False: DCP's reader, one ``torch.load`` per item. ``mmap`` (in one process; elsewhere the direct path
    runs): True points the model's and optimizer's tensors at the memory-mapped files instead of copying
    (:mod:`workbench.checkpoint.mmapload`: zero-copy, copy-on-write); False copies every tensor into place;
    None (the default) copies into tensors that have memory already and maps only what needs new memory
    anyway, a fresh optimizer's state on resume, where no file could change under the mapping. A fresh
    optimizer's state is made from the checkpoint, not by torch's zero-gradient step. Returns a
    :class:`LoadResult`, whose ``read`` says which path the bytes took (``"mmap"`` when any tensor was left
    mapped), how many tensors and bytes were ``mapped`` and ``copied``, and why not mapped (``not_mapped``).
    """
    group = _group(process_group)
    ckpt = _resolve_everywhere(path, group, verify=False)  # sizes now; checksums overlap the read below
    rank = dist.get_rank(group) if group is not None else 0
    single = group is None or dist.get_world_size(group) == 1
    try:
        manifest = read_manifest(ckpt) if (ckpt / MANIFEST).exists() else None
    except ValueError:
        manifest = None  # damaged: the verification below names it (or the read fails and says so)
    maps, hazards = None, []
    if (mmap or direct) and single and manifest is not None:
        from workbench.checkpoint.mmapload import map_files

        # hashed through these, the tensors' pages come in with the check
        maps = map_files(ckpt, manifest, hazards=hazards if mmap is None else None)
    checker = BackgroundVerify(ckpt, manifest=manifest, mapped=maps) \
        if verify and rank == 0 and (ckpt / MANIFEST).exists() else None
    state = TrainState(model, optimizer, scheduler, ema, rank=rank)
    # One process, a manifest: the saver's index of where each tensor lies (workbench.checkpoint.index)
    # stands in for .metadata, whose unpickling is the largest part of a mapped load otherwise.
    indexed = index_metadata(manifest) if maps is not None else None
    metadata = indexed if indexed is not None else read_metadata(ckpt)
    shapes, packed = _shapes(ckpt, metadata)
    # A fresh optimizer (a resumed run's) gets its state made from the checkpoint where the bytes come from
    # the mapped files (new_state), not by torch's zero-gradient step; any other read takes torch's walk.
    new_state: dict[int, tuple[torch.Tensor, str]] = {}
    fresh = dict(saved=shapes, names=set(metadata.state_dict_metadata), new_state=new_state) \
        if maps is not None else {}
    targets, quantized, skipped = _targets(state, ckpt, shapes, packed, optimizer is not None, rng, single, fresh)
    mapped, why = None, []
    if (mmap or direct) and maps is not None and not quantized:
        # One process, every tensor stored whole: the bytes are taken from the mapped files (a copying load
        # copies them from there into place), without DCP's read planning.
        from workbench.checkpoint.mmapload import mapped_tensors

        mapped = mapped_tensors(ckpt, metadata, targets, manifest=manifest, maps=maps, why=why)
    if mapped is None and (indexed is not None or new_state):
        # read another way: with DCP's own .metadata, and a fresh optimizer's state by torch's walk
        if indexed is not None:
            metadata = read_metadata(ckpt)
            shapes, packed = _shapes(ckpt, metadata)
        new_state.clear()
        targets, quantized, skipped = _targets(state, ckpt, shapes, packed, optimizer is not None, rng, single, {})
    if mapped is not None:
        from workbench.checkpoint.mmapload import plan_hyper, plan_pointing, point_at, set_hyper
        from workbench.checkpoint.state import HYPER_PREFIX, unpack_hyper

        tensors, mstats = mapped
        # mmap=None: what has memory of its own takes a copy, what needs new memory is mapped (mmapload's
        # docstring says why), unless a file could change under a mapping (hazards: then all is copied)
        mode = "map" if mmap else "copy" if mmap is False or hazards else "auto"
        # Everything is worked out while the checksums are computed. A mapped load changes nothing until they
        # match; a copying load copies into place meanwhile, as the read below does (the optimizer, scheduler
        # and RNG take their values only after the match).
        opt = local_optimizer(optimizer) if optimizer is not None else None
        actions, copied, counts = plan_pointing(targets, tensors, state.view, opt, mode=mode, new_state=new_state)
        unmapped = None
        if mmap is None and hazards:
            unmapped = hazards[0]
        elif mmap is None and not counts["mapped"]:
            unmapped = "every tensor has memory of its own here: copied into it"
        report = {**mstats.to_dict(), "path": "mmap" if counts["mapped"] else "direct", **counts,
                  **_mmap_report(mmap, unmapped)}
        if mode != "map":
            point_at(actions, pointing=False)
        optim = targets.get("optim")
        hyper_updates = None
        if optim is not None and not copied:
            try:
                hyper = unpack_hyper([tensors[f"optim.{k}"] for k in optim if k.startswith(HYPER_PREFIX)])
                hyper_updates = plan_hyper(opt, targets["model"], state.view, hyper)
            except Exception:  # noqa: BLE001 - unreadable bytes: decided below, after the checksums
                hyper_updates = None
        damaged = checker.result() if checker is not None else None
        if damaged is not None:  # refused before anything was repointed (or any optimizer setting applied)
            intact = _resolve_everywhere(path, group, verify=True)
            return load(intact, model, optimizer, scheduler=scheduler, ema=ema, rng=rng,
                        process_group=process_group, verify=False, direct=direct, mmap=mmap)
        point_at(actions, copies=mode == "map")
        targets.setdefault("extra", {})
        optim = targets.pop("optim", None)
        if optim is not None:  # the state tensors are the optimizer's own now; the hyperparameters remain
            if hyper_updates is None:
                targets["optim"] = optim  # the long way: torch's set_optimizer_state_dict
            else:
                set_hyper(hyper_updates)
        state.apply_loaded(targets, model_in_place=True)
        if optim is not None:
            targets["optim"] = optim
        return _result(ckpt, state, targets, skipped, ema, report, manifest)
    reader = SafeFileSystemReader(ckpt)
    reader._cached = metadata  # read once above; DCP asks for it again
    reader.direct = direct
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        try:
            dcp.load(targets, storage_reader=reader, process_group=group, no_dist=group is None)
            read_error = None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged file: the checksums say which
            read_error = e
    damaged: list[Any] = [checker.result() if checker is not None else None]
    if group is not None and dist.get_world_size(group) > 1 and verify:
        dist.broadcast_object_list(damaged, src=dist.get_global_rank(group, 0), group=group)
    if damaged[0] is not None:
        # The named step directory: refused, naming the file. A run dir: its newest intact step (every file
        # hashed before this second load, as it is only read after a damaged one).
        intact = _resolve_everywhere(path, group, verify=True)
        return load(intact, model, optimizer, scheduler=scheduler, ema=ema, rng=rng, process_group=process_group,
                    verify=False, direct=direct, mmap=mmap)
    if read_error is not None:
        raise _one_line(ckpt, read_error) from read_error
    quant.dequantize_loaded(targets, quantized)
    targets.setdefault("extra", {})
    state.apply_loaded(targets)
    stats = getattr(reader, "stats", None)
    unmapped = "not one process" if not single else "direct=False: DCP's reader" if not direct else \
        "no readable manifest" if manifest is None else "moments stored quantized: dequantized into place" \
        if quantized else why[0] if why else "the files could not be mapped"
    return _result(ckpt, state, targets, skipped, ema,
                   {**(stats.to_dict() if stats else {}), **_mmap_report(mmap, unmapped)}, manifest)


def _shapes(ckpt: Path, metadata: Metadata) -> tuple[dict, dict]:
    """The checkpoint's tensors (key -> (shape, dtype)) and its packed hyperparameter items (key -> shape)."""
    shapes = checkpoint_shapes(ckpt, metadata)
    packed = {k[len("optim."):]: shape for k, (shape, _) in shapes.items() if is_packed_hyper(k)}
    # the packed hyperparameters' targets are allocated at the shapes .metadata claims (every other target
    # has the model's shapes): held against their chunks and data files first
    check_claims(metadata, ckpt, [f"optim.{k}" for k in packed])
    return shapes, packed


def _mmap_report(mmap: bool | None, unmapped: str | None) -> dict[str, Any]:
    """The ``read`` fields that say what was asked of mapping and, where tensors were not mapped, why."""
    return {"mmap": "auto" if mmap is None else "on" if mmap else "off",
            **({"not_mapped": unmapped} if unmapped and mmap is not False else {})}


def _targets(state: TrainState, ckpt: Path, shapes: dict, packed: dict, optimizer: bool, rng: bool, single: bool,
             fresh: dict[str, Any]) -> tuple[dict[str, Any], list, list[str]]:
    """The load's targets (:meth:`TrainState.load_targets`; ``fresh``: its ``saved``, ``names`` and
    ``new_state`` for a fresh optimizer), the quantized moments to read in their stead, and the optional
    keys the checkpoint lacks (dropped); a required key it lacks is refused in one line."""
    targets = state.load_targets(optimizer=optimizer, rng=rng, hyper=packed or None, direct=single, **fresh)
    if single and not _keys_match(targets, shapes):  # the direct walk guessed other names: torch's walk decides
        fresh.get("new_state", {}).clear()
        targets = state.load_targets(optimizer=optimizer, rng=rng, hyper=packed or None)
    check_model_fits(ckpt, targets["model"], shapes=shapes)
    quantized = quant.load_targets(targets, shapes)  # moments saved as int8/fp8 + scales: read those
    skipped: list[str] = []
    for key, container, sub in list(_leaves(targets)):
        if key in shapes:
            continue
        # Optional parts: this rank's RNG (another world size), EMA, scheduler, hyperparameters.
        if key.startswith(("rng.", "ema.", "sched.", "optim.param_groups.", "extra.")):
            del container[sub]
            skipped.append(key)
            continue
        raise ValueError(f"checkpoint {ckpt.name} has no {key}; it was saved without that state "
                         "(load with optimizer=None for weights only)")
    for kind in [k for k, v in targets.items() if isinstance(v, dict) and not _has_leaf(v)]:
        del targets[kind]
    return targets, quantized, skipped


def _keys_match(targets: dict[str, Any], shapes: dict[str, Any]) -> bool:
    """Every model and optimizer-state key of ``targets`` is in the checkpoint, and every model key of the
    checkpoint is in ``targets``: what a direct walk of the state must give to be used."""
    model = targets.get("model", {})
    saved_model = sum(k.startswith("model.") for k in shapes)
    if len(model) != saved_model or any(f"model.{k}" not in shapes for k in model):
        return False
    return all(f"optim.{k}" in shapes for k in targets.get("optim", {}))


def _result(ckpt: Path, state: TrainState, targets: dict, skipped: list[str], ema, read: dict,
            manifest: dict | None = None) -> LoadResult:
    if ema is not None and any(k.startswith("ema.") for k in skipped):
        ema.reset()  # no EMA in the checkpoint: start it from the loaded weights
    if manifest is None:
        manifest = read_manifest(ckpt) if (ckpt / MANIFEST).exists() else {}
    step = state.step if "extra" in targets and "step" in targets["extra"] else int(manifest.get("step", 0))
    consumed = state.consumed_samples if "consumed_samples" in targets.get("extra", {}) else \
        int(manifest.get("consumed_samples", 0))
    return LoadResult(ckpt, step, consumed, sorted(targets), skipped, manifest, read)


def _one_line(ckpt: Path, e: BaseException) -> ValueError:
    """A read failure as one line naming the checkpoint and the first cause (DCP wraps rank errors)."""
    from workbench.checkpoint.safeload import CheckpointFormatError

    cause: BaseException = e
    for _ in range(5):  # DCP's CheckpointException holds {rank: (exception, traceback)}
        failures = getattr(cause, "failures", None)
        if not failures:
            break
        first = next(iter(failures.values()))
        cause = first[0] if isinstance(first, tuple) else first
    if isinstance(cause, CheckpointFormatError):
        return cause
    text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return ValueError(f"{ckpt}: could not be read ({type(cause).__name__}: {text}); run `workbench ckpt verify "
                      f"{ckpt}` to find the damaged file, or load another step")


def _has_leaf(d: dict) -> bool:
    return any(_has_leaf(v) if isinstance(v, dict) else True for v in d.values())


def check_resume(resume: str, ckpt_root: str | Path, model_cfg, model_state: dict | None = None) -> Path:
    """Before any process starts: the checkpoint ``resume`` names exists, is complete, and fits ``model_cfg``.

    Builds the model on the meta device (no memory) to compare every ``model.*`` key's shape;
    ``model_state``: the expected state dict instead (on meta), for a job that trains another module
    around the model (the embedding trainer).
    """
    from workbench.models import build_model

    # Sizes only: rank 0 verifies every checksum when it loads (and falls back past a damaged latest).
    ckpt = resolve_checkpoint(ckpt_root if resume == "latest" else resume, verify_checksums=False)
    if model_state is None:
        model_state = build_model(model_cfg, seed=None, device="meta").state_dict()
    check_model_fits(ckpt, model_state)
    return ckpt
