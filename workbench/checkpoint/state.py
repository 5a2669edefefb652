"""The train state as one nested dict of tensors whose keys do not depend on the layout.

DCP flattens nesting with dots, so what lands on disk is::

    model.<fqn>                              weights: DTensor shards, or plain tensors (replicated)
    optim.state.<fqn>.exp_avg|exp_avg_sq|step   AdamW state, keyed by the parameter's FQN
    optim.param_groups.<fqn>.<hyper>         lr, betas, eps, weight_decay, ... as 0-d/1-d tensors
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
optimizer hyperparameters as float64/int64/bool tensors, so loading never unpickles anything.
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

from workbench.kinds import KEY_PREFIXES

__all__ = ["TrainState", "model_view", "local_optimizer", "capture_rng", "restore_rng", "KINDS",
           "encode_hyper", "decode_hyper", "encode_optim", "encode_state"]

KINDS = KEY_PREFIXES  # the key prefixes a save writes, in order (see workbench.kinds)
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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


def encode_optim(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A flattened optimizer state dict with every value a tensor (values that have none are dropped)."""
    return {k: t for k, v in osd.items() if (t := encode_hyper(v)) is not None}


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
            msd, osd = get_state_dict(self.view, local_optimizer(self.optimizer), options=_OPTIONS)
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

    def kinds(self) -> list[str]:
        """The key prefixes a save of this state writes, in :data:`KINDS` order."""
        have = {"optim": self.optimizer is not None, "ema": self.ema is not None, "sched": self.scheduler is not None}
        return [k for k in KINDS if have.get(k, True)]

    # -- loading ------------------------------------------------------------------------------
    def load_targets(self, optimizer: bool = True, rng: bool = True) -> dict[str, Any]:
        """The nested dict of tensors to pass to ``dcp.load`` (full state, or model only)."""
        targets: dict[str, Any] = {"model": self.model_state()}
        if optimizer and self.optimizer is not None:
            targets["optim"] = {k: t for k, v in self.optim_state().items() if (t := encode_hyper(v)) is not None}
        if optimizer and self.ema is not None:
            targets["ema"] = self.ema.state_dict()
        if optimizer and self.scheduler is not None:
            targets["sched"] = self.sched_state()
        if rng:
            targets["rng"] = {f"rank{self.rank}": capture_rng()}
        targets["extra"] = self.extra_state()
        return targets

    def apply_loaded(self, loaded: dict[str, Any]) -> None:
        """Push values that ``dcp.load`` wrote into ``loaded`` back into the live objects."""
        set_model_state_dict(self.view, loaded["model"], options=_OPTIONS)
        if "optim" in loaded:
            osd = self.optim_state()  # current values fill in what is not stored (e.g. fused=None)
            for k, t in loaded["optim"].items():
                osd[k] = decode_hyper(t, osd.get(k, t))
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
