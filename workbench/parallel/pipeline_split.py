"""How a model's layers split into pipeline stages, and what a stage sends per step.

The part of pipeline parallelism that needs neither ``torch.distributed.pipelining`` nor the memory
marks (whose timeline schema loads pandas): the build path (``workbench.parallel.build``) and plans
import it from here, and ``workbench.parallel.pipeline`` re-exports it beside the schedules. See that
module for the picture.
"""

from __future__ import annotations

import copy

from torch import nn

from workbench.parallel.collectives import Collective

__all__ = ["split_layers", "stage_ids", "build_stage_module", "pp_comm"]


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Layer indices of each stage: contiguous runs, sizes differing by at most one, larger first."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split n_layers={n_layers} into {n_stages} stages; choose 1..{n_layers} stages")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """The stages pp rank ``pp_rank`` runs (looped placement, as torch's interleaved schedules expect)."""
    return [pp_rank + j * pp for j in range(stages_per_rank)]


def build_stage_module(model: nn.Module, layer_ids: list[int], *, first: bool, last: bool,
                       in_place: bool = False) -> nn.Module:
    """``model`` keeping only ``layer_ids`` (+ embeddings if first, norm/output if last).

    A deep copy, unless ``in_place``: a rank's last (often only) stage prunes the model itself, so the
    whole model is never held twice.
    """
    stage = model if in_place else copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for name in [k for k in stage.layers.keys() if k not in keep]:
        del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def pp_comm(stages: list[int], n_stages: int, act_bytes: float, micro: int) -> list[Collective]:
    """What this pp rank sends per step: per microbatch, each of its ``stages`` sends its output
    activation forward (not the last stage) and its input gradient backward (not the first)."""
    out = []
    for s in stages:
        if s < n_stages - 1:
            out.append(Collective("send/recv", "pp", "forward", act_bytes, 2, micro, "PP activations to the next stage"))
        if s > 0:
            out.append(Collective("send/recv", "pp", "backward", act_bytes, 2, micro,
                                  "PP input gradients to the previous stage"))
    return out
