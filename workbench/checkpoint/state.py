"""The train state as one nested dict of tensors whose keys do not depend on the layout.

DCP flattens nesting with dots, so what lands on disk is::

    model.<fqn>                              weights: DTensor shards, or plain tensors (replicated)
    optim.state.<fqn>.exp_avg|exp_avg_sq|step   AdamW state, keyed by the parameter's FQN
    optim.hyper.<digest>                     the hyperparameters (lr, betas, eps, weight_decay, ...) of every
                                             parameter this rank's optimizer holds, one group per distinct
                                             set, as UTF-8 JSON in a uint8 tensor (:func:`pack_hyper`)
    ema.<fqn>                                fp32 exponential moving average of weights (optional)
    sched.last_epoch|step_count|base_lrs|last_lr    the LambdaLR scheduler
    rng.rank<r>.torch|cuda|python|numpy      each rank's generators, as integer tensors
    extra.step|consumed_samples              optimizer steps taken, samples consumed

FQNs are the full model's (``layers.3.attention.wq.weight``) under every layout: wrappers' prefixes
(DDP's ``module.``, activation checkpointing's ``_checkpoint_wrapped_module.``) are stripped by
``torch.distributed.checkpoint.state_dict``, and a pipeline rank's stage modules are viewed as one
module (:func:`model_view`) that holds exactly the layers it owns, under their own names. Optimizer
state is flattened per parameter (``flatten_optimizer_state_dict``), so it too is layout-free: the same
key holds a tp shard, an FSDP shard, a ZeRO-1 partition's whole tensor or a plain tensor, and DCP
reshards it by global shape and offset on load.

Master weights: this trainer's parameters *are* the fp32 master weights under
``mixed_precision='bf16'`` (FSDP2 casts to bf16 for compute, autocast elsewhere), so ``model.*`` holds
them and no separate ``master.*`` keys exist. Under ``dtype='bfloat16'`` there are no fp32 masters.

Everything is a tensor. Python and NumPy RNG states are stored as int64 tensors (not pickled objects),
optimizer hyperparameters as JSON bytes, so loading never unpickles anything.

Hyperparameters, packed. torch's flattened optimizer state repeats every param group's values under each
parameter (``param_groups.<fqn>.lr``, ...): 10 values x 75 parameters of the small preset were 750 of a
checkpoint's 1,131 items, and each item costs a save and a load about the same whatever its size. They
are now one item per distinct content, ``optim.hyper.<xxh64 of the JSON>``: ranks holding the same
parameters (data parallel, FSDP) write identical items under one key, which DCP stores once; pipeline
stages write one each. A load reads every ``optim.hyper.*`` item (a few KiB) and takes each parameter's
values from whichever holds it, so any layout loads any other. Checkpoints written before (one
``optim.param_groups.<fqn>.<hyper>`` tensor each) still load.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from workbench.kinds import KEY_PREFIXES

__all__ = ["TrainState", "model_view", "local_optimizer", "capture_rng", "restore_rng", "KINDS",
           "encode_hyper", "decode_hyper", "encode_optim", "encode_state", "pack_hyper", "unpack_hyper",
           "HYPER_PREFIX", "is_packed_hyper"]

KINDS = KEY_PREFIXES  # the key prefixes a save writes, in order (see workbench.kinds)
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Module names torch's state-dict walk removes from FQNs (DDP, torch.compile, activation checkpointing, FSDP1)
_WRAPPER_NAMES = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


class StageUnion(nn.Module):
    """A pipeline rank's stage modules seen as one module with the full model's FQNs.

    Stage modules are pruned copies of the whole model, so their parameter names already are the full
    model's; this module only gathers them (``layers`` from every stage, the root modules from the
    stages that have them). It owns nothing: the stages' parameters are shared, not copied.
    """

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(stage, name, None) is not None:
                    setattr(self, name, getattr(stage, name))
            for key, block in stage.layers.items():
                self.layers[key] = block


def model_view(model: nn.Module) -> nn.Module:
    """The module whose state dict keys are full-model FQNs (unwraps pipeline stage lists)."""
    if isinstance(model, nn.ModuleList) and len(model) and all(hasattr(m, "layers") for m in model):
        return StageUnion(list(model))
    return model


def local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO-1's local AdamW over its partition."""
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


# -- hyperparameters as tensors ------------------------------------------------------------------


def encode_hyper(value: Any) -> torch.Tensor | None:
    """A param-group value as a tensor (None: not stored, e.g. ``fused=None``)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


HYPER_PREFIX = "hyper."  # under optim: optim.hyper.<digest>
_GROUPS = "param_groups."
_FORMAT = "workbench.optim_hyper/1"


def _jsonable(value: Any) -> Any:
    """A param-group value as JSON (``_SKIP``: not stored, e.g. a callable)."""
    if value is None:
        return _SKIP  # unset (e.g. fused=None): the optimizer's own value stands, as before the packing
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):  # e.g. a tensor lr (capturable): its values and dtype
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        items = [_jsonable(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP


_SKIP = object()


def pack_hyper(osd: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict with its ``param_groups.<fqn>.<name>`` entries packed into one
    ``hyper.<digest>`` uint8 tensor (JSON: ``{"format", "groups": [{"hyper": {...}, "params": [fqn, ...]}]}``,
    one group per distinct set of values); the ``state.*`` tensors are kept as they are."""
    import json

    import xxhash

    out: dict[str, Any] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for k, v in osd.items():
        if not k.startswith(_GROUPS):
            out[k] = v
            continue
        fqn, _, name = k[len(_GROUPS):].rpartition(".")
        value = _jsonable(v)
        if value is not _SKIP:
            per_param.setdefault(fqn, {})[name] = value
    if not per_param:
        return out
    groups: dict[str, dict[str, Any]] = {}
    for fqn, hyper in per_param.items():
        text = json.dumps(hyper, sort_keys=True)
        groups.setdefault(text, {"hyper": hyper, "params": []})["params"].append(fqn)
    blob = json.dumps({"format": _FORMAT, "groups": list(groups.values())}, sort_keys=True,
                      separators=(",", ":")).encode()
    out[f"{HYPER_PREFIX}{xxhash.xxh64_hexdigest(blob)}"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


def hyper_groups(blobs: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The param groups of ``hyper.*`` tensors, as stored: ``[{"hyper": {name: JSON value}, "params": [fqn,
    ...]}, ...]`` (every rank's blobs; groups may repeat). ValueError, one line, if one is unreadable."""
    import json

    groups: list[dict[str, Any]] = []
    for t in blobs:
        try:
            doc = json.loads(bytes(t.detach().cpu().reshape(-1).numpy().tobytes()).decode("utf-8"))
            if doc.get("format") != _FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            for group in doc["groups"]:
                groups.append({"hyper": dict(group["hyper"]), "params": list(group["params"])})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"optimizer hyperparameters unreadable ({type(e).__name__}: {e}); the checkpoint is "
                             "corrupt or from a newer workbench") from None
    return groups


def unpack_hyper(blobs: list[torch.Tensor]) -> dict[str, dict[str, Any]]:
    """``fqn -> {name: JSON value}`` from ``hyper.*`` tensors (every rank's; they may overlap)."""
    return {fqn: dict(group["hyper"]) for group in hyper_groups(blobs) for fqn in group["params"]}


def is_packed_hyper(key: str) -> bool:
    """Whether a flattened checkpoint key (``optim.hyper.<digest>``) is a packed hyperparameter item."""
    return key.startswith("optim." + HYPER_PREFIX)


def _from_json(value: Any, like: Any) -> Any:
    """A stored JSON value back to the type of ``like`` (the optimizer's current value)."""
    if isinstance(value, dict) and "tensor" in value:
        t = torch.tensor(value["tensor"], dtype=getattr(torch, value.get("dtype", "float32")))
        return t.to(like.device) if isinstance(like, torch.Tensor) else t
    if isinstance(like, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def encode_optim(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A flattened optimizer state dict with every value a tensor: the state as it is, the hyperparameters
    packed (:func:`pack_hyper`)."""
    packed = pack_hyper(osd)
    return {k: t for k, v in packed.items() if (t := encode_hyper(v)) is not None}


def encode_state(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` from ``TrainState.state_dict(encode=False)`` with the hyperparameters encoded as tensors."""
    return {**sd, "optim": encode_optim(sd["optim"])} if "optim" in sd else sd


def decode_hyper(tensor: torch.Tensor, like: Any) -> Any:
    """Back to the Python type of ``like`` (the optimizer's current value)."""
    if isinstance(like, torch.Tensor):
        return tensor
    if isinstance(like, bool):
        return bool(tensor.item())
    if isinstance(like, int):
        return int(tensor.item())
    if isinstance(like, float):
        return float(tensor.item())
    if isinstance(like, (tuple, list)):
        return type(like)(tensor.tolist())
    return like


# -- RNG -------------------------------------------------------------------------------------------


def _float_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).view(torch.int64).item())


def _bits_float(x: int) -> float:
    return float(torch.tensor([x], dtype=torch.int64).view(torch.float64).item())


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's generators as tensors: torch, cuda (if initialised), python, numpy.

    python: ``[version, 625 Mersenne-Twister words, has_gauss, gauss bits]``;
    numpy:  ``[624 key words, pos, has_gauss, gauss bits]`` (all int64).
    """
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    version, words, gauss = random.getstate()
    out["python"] = torch.tensor([version, *words, gauss is not None, _float_bits(gauss or 0.0)],
                                 dtype=torch.int64)
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss, _float_bits(cached)], dtype=torch.int64)
    return out


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))
    if "python" in state:
        v = state["python"].tolist()
        random.setstate((v[0], tuple(v[1:-2]), _bits_float(v[-1]) if v[-2] else None))
    if "numpy" in state:
        v = state["numpy"].tolist()
        np.random.set_state(("MT19937", np.array(v[:624], dtype=np.uint32), v[624], v[625], _bits_float(v[626])))


# -- the state -------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """What a checkpoint holds, by reference to the live objects of one rank.

    ``state_dict()`` gives the nested dict of (live) tensors to save; ``load_targets()`` gives the
    same structure to load into, and ``apply_loaded()`` pushes loaded values back into the objects.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # torch.optim.lr_scheduler.LambdaLR
    ema: Any = None  # workbench.checkpoint.saver.EMA
    step: int = 0
    consumed_samples: int = 0
    rank: int = 0
    _view: nn.Module | None = field(default=None, repr=False)
    _sd_cache: tuple | None = field(default=None, repr=False)

    @property
    def view(self) -> nn.Module:
        if self._view is None:
            self._view = model_view(self.model)
        return self._view

    def model_state(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.view, options=_OPTIONS)

    def optim_state(self) -> dict[str, Any]:
        """Flattened optimizer state, creating it (zero-grad step at lr 0) if no step ran yet."""
        return get_optimizer_state_dict(self.view, local_optimizer(self.optimizer), options=_OPTIONS)

    def sched_state(self) -> dict[str, torch.Tensor]:
        s = self.scheduler
        return {"last_epoch": torch.tensor(s.last_epoch, dtype=torch.int64),
                "step_count": torch.tensor(s._step_count, dtype=torch.int64),
                "base_lrs": torch.tensor(s.base_lrs, dtype=torch.float64),
                "last_lr": torch.tensor(s.get_last_lr(), dtype=torch.float64)}

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"step": torch.tensor(self.step, dtype=torch.int64),
                "consumed_samples": torch.tensor(self.consumed_samples, dtype=torch.int64)}

    def state_dict(self, rng: bool = True, encode: bool = True) -> dict[str, Any]:
        """Nested dict of live tensors: {"model": ..., "optim": ..., "ema"?, "sched"?, "rng", "extra"}.

        ``encode=False`` leaves the optimizer's hyperparameters as the Python values they are (plain values,
        safe to read later on another thread); :func:`encode_state` turns them into tensors."""
        if self.optimizer is not None:  # one call: torch maps parameters to FQNs once for both
            msd, osd = self._model_and_optim()
            sd: dict[str, Any] = {"model": msd, "optim": encode_optim(osd) if encode else osd}
        else:
            sd = {"model": self.model_state()}
        if self.ema is not None:
            sd["ema"] = self.ema.state_dict()
        if self.scheduler is not None:
            sd["sched"] = self.sched_state()
        if rng:
            sd["rng"] = {f"rank{self.rank}": capture_rng()}
        sd["extra"] = self.extra_state()
        return sd

    def _identity(self, opt) -> tuple | None:
        """What the model's and optimizer's state dicts are made of, by identity and storage: equal between
        two calls, torch's walk would return the same tensors (None: DTensors, whose wrappers FSDP swaps)."""
        tensors = [*self.view.parameters(), *self.view.buffers()]
        tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if any(isinstance(t, DTensor) for t in tensors):
            return None
        return tuple((id(t), t.data_ptr(), t.shape) for t in tensors) + (len(opt.param_groups), len(opt.state))

    def _model_and_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``get_state_dict``'s flattened model and optimizer state dicts. torch's walk maps every parameter to
        its FQN (about 5 ms for 75 parameters); a periodic save of the same objects reuses the walk's result
        (the same tensors, read live) and takes only the hyperparameters afresh. Any change of parameter,
        buffer or optimizer-state tensor (a load that repointed them, a new state entry) walks again."""
        opt = local_optimizer(self.optimizer)
        ident = self._identity(opt)
        cached = self._sd_cache
        if ident is not None and cached is not None and cached[0] == ident:
            _, msd, tensors, hyper_refs = cached
            osd = dict(tensors)
            for key, (i, name) in hyper_refs.items():
                osd[key] = opt.param_groups[i][name]
            return dict(msd), osd
        msd, osd = get_state_dict(self.view, opt, options=_OPTIONS)
        self._sd_cache = None
        if ident is not None:
            owner = {}  # the param group of each parameter FQN, through the optimizer's own parameters
            fqn_of = {id(p): k for k, p in self.view.named_parameters()}
            for i, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    owner[fqn_of.get(id(p))] = i
            hyper_refs, tensors = {}, {}
            for key, v in osd.items():
                if key.startswith(_GROUPS):
                    fqn, _, name = key[len(_GROUPS):].rpartition(".")
                    if fqn not in owner or name not in opt.param_groups[owner[fqn]]:
                        return msd, osd  # a name torch maps otherwise: no cache
                    hyper_refs[key] = (owner[fqn], name)
                else:
                    tensors[key] = v
            self._sd_cache = (ident, dict(msd), tensors, hyper_refs)
        return msd, osd

    def _plain_state(self, optimizer: bool) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """The model state dict and the optimizer's flattened state tensors (``state.<fqn>.<name>``) as
        torch's ``get_state_dict`` gives them, read directly where that walk is the identity: a model in one
        process with no wrapper in its names (DDP's ``module``, compile's ``_orig_mod``, activation
        checkpointing's or FSDP1's wrapper) and no DTensor, whose every optimized parameter already has
        optimizer state made of tensors. torch's walk takes 5.4 ms for the small preset's 75 parameters;
        this one 0.36 ms. None where any condition fails (then torch's walk is used)."""
        view = self.view
        msd = view.state_dict()
        if any(part in _WRAPPER_NAMES for k in msd for part in k.split(".")) \
                or any(isinstance(t, DTensor) for t in msd.values()):
            return None
        if not optimizer or self.optimizer is None:
            return msd, None
        opt = self.optimizer
        if isinstance(opt, ZeroRedundancyOptimizer) or not opt.state:
            return None
        optimized = {id(p) for group in opt.param_groups for p in group["params"]}
        osd: dict[str, Any] = {}
        for fqn, p in view.named_parameters():
            if id(p) not in optimized:
                continue
            st = opt.state.get(p)
            if not st:
                return None
            for name, v in st.items():
                if type(v) is not torch.Tensor:
                    return None
                osd[f"state.{fqn}.{name}"] = v
        return msd, osd

    def _fresh_optim_state(self, saved: dict[str, tuple[tuple[int, ...], torch.dtype]], names: set[str]
                           ) -> tuple[dict[str, torch.Tensor], dict[int, tuple[torch.Tensor, str]]] | None:
        """Targets for an optimizer that has no state yet (a resumed run's fresh one), made from the
        checkpoint's ``optim.state.<fqn>.<name>`` entries instead of torch's walk, which first creates the
        state with a zero-gradient step over every parameter (zeroed gradients and moments, then the step
        itself: 0.25 s of a 0.35 s resume of the small preset) only to have it overwritten. Each target is an
        empty tensor (no pages until written) that the load fills or replaces; returns the targets and
        ``id(target) -> (parameter, state name)`` for installing them into ``optimizer.state``.

        ``saved``: the checkpoint's tensors (key -> shape, dtype); ``names``: every key it stores. None
        where a condition of :meth:`_plain_state` fails, or the state is not what ``load_state_dict`` would
        install as is: a name with a dot, an entry that is not a tensor, a floating-point entry (other than
        ``step``) of another dtype than its parameter, a parameter off the CPU, or an optimized parameter with
        no saved state (torch's walk then names the missing key)."""
        opt = self.optimizer
        if opt is None or isinstance(opt, ZeroRedundancyOptimizer) or opt.state:
            return None
        optimized = {id(p) for group in opt.param_groups for p in group["params"]}
        state_keys: dict[str, list[str]] = {}
        for k in names:
            if k.startswith("optim.state."):
                fqn, _, name = k[len("optim.state."):].rpartition(".")
                state_keys.setdefault(fqn, []).append(name)
        osd: dict[str, torch.Tensor] = {}
        owner: dict[int, tuple[torch.Tensor, str]] = {}
        for fqn, p in self.view.named_parameters():
            if id(p) not in optimized:
                continue
            entries = state_keys.pop(fqn, None)
            if not entries or type(p) is not nn.Parameter or not p.is_cpu:
                return None
            for name in entries:
                key = f"optim.state.{fqn}.{name}"
                if "." in name or key not in saved:
                    return None
                shape, dtype = saved[key]
                if dtype.is_floating_point and name != "step" and dtype != p.dtype:
                    return None
                t = torch.empty(shape, dtype=dtype)
                osd[f"state.{fqn}.{name}"] = t
                owner[id(t)] = (p, name)
        if state_keys:  # state under a name this model does not optimize: torch's walk decides
            return None
        return osd, owner

    def kinds(self) -> list[str]:
        """The key prefixes a save of this state writes, in :data:`KINDS` order."""
        have = {"optim": self.optimizer is not None, "ema": self.ema is not None, "sched": self.scheduler is not None}
        return [k for k in KINDS if have.get(k, True)]

    # -- loading ------------------------------------------------------------------------------
    def load_targets(self, optimizer: bool = True, rng: bool = True,
                     hyper: dict[str, tuple[int, ...]] | None = None, direct: bool = False, *,
                     saved: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                     names: set[str] | None = None,
                     new_state: dict[int, tuple[torch.Tensor, str]] | None = None) -> dict[str, Any]:
        """The nested dict of tensors to pass to ``dcp.load`` (full state, or model only).

        ``hyper``: the checkpoint's packed hyperparameter items (``hyper.<digest>`` -> shape) to read; None
        for a checkpoint from before they were packed (one target per ``param_groups`` value). ``direct``:
        take the model's and optimizer's tensors without torch's walk where that is the identity
        (:meth:`_plain_state`); the caller checks the keys against the checkpoint's. ``new_state`` (with
        ``saved`` and ``names``, the checkpoint's tensors and keys): an optimizer with no state yet gets
        targets made from the checkpoint (:meth:`_fresh_optim_state`), and ``new_state`` is filled with
        ``id(target) -> (parameter, name)``: the caller installs them into ``optimizer.state``."""
        plain = self._plain_state(optimizer) if direct and (hyper is not None or not optimizer) else None
        if plain is None and direct and optimizer and hyper is not None and new_state is not None \
                and saved is not None and names is not None:
            fresh = self._fresh_optim_state(saved, names)
            msd = self._plain_state(False) if fresh is not None else None
            if msd is not None:
                plain = (msd[0], fresh[0])
                new_state.update(fresh[1])
        targets: dict[str, Any] = {"model": plain[0] if plain else self.model_state()}
        if plain and plain[1] is not None:
            targets["optim"] = dict(plain[1])
            targets["optim"].update({k: torch.empty(shape, dtype=torch.uint8) for k, shape in hyper.items()})
        elif optimizer and self.optimizer is not None:
            osd = self.optim_state()
            if hyper is None:
                targets["optim"] = {k: t for k, v in osd.items() if (t := encode_hyper(v)) is not None}
            else:
                targets["optim"] = {k: v for k, v in osd.items() if not k.startswith(_GROUPS)}
                targets["optim"].update({k: torch.empty(shape, dtype=torch.uint8) for k, shape in hyper.items()})
        if optimizer and self.ema is not None:
            targets["ema"] = self.ema.state_dict()
        if optimizer and self.scheduler is not None:
            targets["sched"] = self.sched_state()
        if rng:
            targets["rng"] = {f"rank{self.rank}": capture_rng()}
        targets["extra"] = self.extra_state()
        return targets

    def apply_loaded(self, loaded: dict[str, Any], model_in_place: bool = False) -> None:
        """Push values that ``dcp.load`` wrote into ``loaded`` back into the live objects
        (``model_in_place``: the model already holds them, as after a mapped load)."""
        if not model_in_place:
            set_model_state_dict(self.view, loaded["model"], options=_OPTIONS)
        if "optim" in loaded:
            osd = self.optim_state()  # current values fill in what is not stored (e.g. fused=None)
            packed = [t for k, t in loaded["optim"].items() if k.startswith(HYPER_PREFIX)]
            hyper = unpack_hyper(packed) if packed else {}
            for k, t in loaded["optim"].items():
                if not k.startswith(HYPER_PREFIX):
                    osd[k] = decode_hyper(t, osd.get(k, t))
            for k in [k for k in osd if k.startswith(_GROUPS)] if packed else ():
                fqn, _, name = k[len(_GROUPS):].rpartition(".")
                stored = hyper.get(fqn, {})
                if name in stored:
                    osd[k] = _from_json(stored[name], osd[k])
            set_optimizer_state_dict(self.view, local_optimizer(self.optimizer), osd, options=_OPTIONS)
        if "ema" in loaded:
            self.ema.load_state_dict(loaded["ema"])
        if "sched" in loaded and self.scheduler is not None:
            s, st = self.scheduler, loaded["sched"]
            s.last_epoch = int(st["last_epoch"])
            s._step_count = int(st["step_count"])
            s.base_lrs = [float(x) for x in st["base_lrs"].tolist()]
            s._last_lr = [float(x) for x in st["last_lr"].tolist()]
            # The lr the next step uses is the scheduler's (ZeRO-1 copies it into its local optimizer).
            for group, lr in zip(s.optimizer.param_groups, s._last_lr):
                group["lr"] = lr
        rng = loaded.get("rng", {}).get(f"rank{self.rank}")
        if rng:
            restore_rng(rng)
        extra = loaded.get("extra", {})
        if "step" in extra:
            self.step = int(extra["step"])
        if "consumed_samples" in extra:
            self.consumed_samples = int(extra["consumed_samples"])
