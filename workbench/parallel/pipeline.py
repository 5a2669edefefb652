"""Pipeline parallelism: the model's layers split into stages, microbatches streamed through them.

Stage ``s`` of ``S`` holds a contiguous run of layers; the first also holds ``tok_embeddings``, the last
``norm`` and ``output``. Splits may be uneven (5 layers over 2 stages -> 3 + 2: earlier stages take the
extra layer). With ``pp`` ranks and ``v`` stages per rank (``v = 2`` under Interleaved1F1B), stage ``s``
lives on pp rank ``s % pp``::

    pp=2, 1F1B:         rank 0: [emb, L0 L1 L2]          rank 1: [L3 L4, norm, out]
    pp=2, Interleaved:  rank 0: [emb, L0 L1] [L3]        rank 1: [L2] [L4, norm, out]

Each stage is a pruned copy of the meta-device model (``workbench.parallel.build.build_stages`` splits,
shards and only then materializes it). ``layers`` is a ModuleDict keyed
"0".."n-1", so every parameter keeps its fully-qualified name ("layers.3.attention.wq.weight").

The engine is ``torch.distributed.pipelining``. Each microbatch loss is the token-mean cross entropy,
and the schedule divides gradients by the number of microbatches ``m`` (``scale_grads``)::

    g = 1/m sum_i grad mean_loss(mb_i) = grad mean_loss(local batch)     (equal-size microbatches)

then data parallelism averages over dp ranks, which gives the gradient of the global-batch mean.

``GPipeLean`` is GPipe that frees memory as soon as it can: a stage's output storage once it has been
sent (autograd only needs its grad_fn, unless the graph saved it), and the per-microbatch receive
buffers (activations and gradients) once that microbatch's backward has run.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from workbench import compat
from workbench.config import ModelConfig, ParallelConfig, TrainConfig
from workbench.memory import marks
from workbench.memory.probe import resize_storage_
from workbench.parallel.pipeline_split import build_stage_module, pp_comm, split_layers, stage_ids
from workbench.time.labels import BACKWARD, FORWARD, label, microbatch_label

if TYPE_CHECKING:
    from workbench.parallel.build import Stages

__all__ = ["split_layers", "stage_ids", "build_stage_module", "build_pipeline", "pp_comm", "Pipeline",
           "ScheduleGPipeLean", "TimedStage", "pipeline_loss", "SCHEDULES", "hold_recv_buffers_for"]


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross entropy of one microbatch (the schedule divides gradients by microbatches)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class TimedStage(PipelineStage):
    """A PipelineStage that records when each microbatch's forward (F) and backward (B) ran (wall clock),
    and marks them as memory phases "forward" and "backward" of that microbatch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.actions: list[dict] = []

    def _timed(self, phase: str, chunk: int, fn, *args, **kwargs):
        t0 = time.time()
        # The memory phase and microbatch of what runs inside (workbench.memory.marks).
        with marks.phase("forward" if phase == "F" else "backward"), marks.microbatch(chunk), \
                microbatch_label(FORWARD if phase == "F" else BACKWARD, chunk):  # a trace's label (--profile)
            out = fn(chunk, *args, **kwargs)
        self.actions.append({"stage": self.stage_index, "microbatch": chunk, "phase": phase,
                             "start": t0, "end": time.time()})
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed("F", fwd_chunk_id, super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("B", bwd_chunk_id, super().backward_one_chunk, *args, **kwargs)

    def perform_reduce_grad(self, *args, **kwargs):
        # Gradient scaling and data-parallel reduction after the last backward belong to backward.
        with marks.phase("backward"), label(BACKWARD):
            return super().perform_reduce_grad(*args, **kwargs)


@contextmanager
def _saved_storages(into: set[int]):
    """Record the storages autograd saves for backward (so we never free one it still needs)."""

    def pack(t):
        try:
            into.add(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _buffers(recv_infos) -> list[torch.Tensor]:
    # Model inputs have no receive buffer: torch 2.13 flags them (is_root_arg), 2.11 uses a placeholder
    # object without a buffer.
    return [b for info in recv_infos if not getattr(info, "is_root_arg", False)
            and (b := getattr(info, "buffer", None)) is not None]


def _regrow(recv_infos) -> None:
    for buf in _buffers(recv_infos):
        resize_storage_(buf, buf.numel() * buf.element_size())


def _shrink(recv_infos) -> None:
    for buf in _buffers(recv_infos):
        buf.grad = None
        resize_storage_(buf, 0)


def hold_recv_buffers_for(stage: PipelineStage, n_microbatches: int) -> None:
    """Make ``stage`` allocate receive buffers for ``n_microbatches`` when it sets up, however many
    microbatches its schedule runs.

    A stage allocates one activation and one gradient receive buffer per microbatch at its first step
    and keeps them. A memory prediction that runs fewer microbatches than the job
    (``workbench.prediction.fake.same_peak_job``) still has to hold all of them: the extra ones are copies
    of microbatch 0's, never used.
    """

    def pad(table: dict) -> None:
        first = table.get(0, ())
        for i in range(len(table), n_microbatches):
            infos = []
            for info in first:
                if isinstance(getattr(info, "buffer", None), torch.Tensor):
                    info = copy.copy(info)
                    info.buffer = torch.empty_like(info.buffer)
                infos.append(info)
            table[i] = tuple(infos)

    def after(method, table_name):
        def run(*args, **kwargs):
            out = method(*args, **kwargs)
            pad(getattr(stage, table_name))
            return out
        return run

    stage._prepare_forward_infra = after(stage._prepare_forward_infra, "args_recv_info")
    stage._prepare_backward_infra = after(stage._prepare_backward_infra, "grad_recv_info")


def _p2p(ops) -> None:
    sort, wait = compat.get("sorted_batch_p2p"), compat.get("wait_batch_p2p")
    for works in sort(ops).values():
        wait(works)


class ScheduleGPipeLean(ScheduleGPipe):
    """GPipe (all forwards, then all backwards) that releases memory per microbatch.

    * after forward i is sent: the output's storage is freed (shape and grad_fn stay, for backward),
      unless autograd saved that storage;
    * after backward i is sent: the receive buffers of microbatch i (input activation and output
      gradient) are freed; they are regrown just before the next step receives into them.
    Sends are waited on at once, so nothing else keeps those tensors alive.
    """

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        compat.call_trimmed(self._initialize_stage, arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        stage, n = self._stage, self._n_microbatches

        for i in range(n):
            _regrow(stage.args_recv_info.get(i, ()))
            _p2p(stage.get_fwd_recv_ops(i))
            saved: set[int] = set()
            with _saved_storages(saved):
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=False)
                compat.call_trimmed(self._maybe_compute_loss, stage, output, target_mbs, i, loss_kwargs)
            _p2p(stage.get_fwd_send_ops(i))
            del output
            for t in stage.fwd_cache[i][0]:
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in saved:
                    resize_storage_(t, 0)

        for i in range(n):
            _regrow(stage.grad_recv_info.get(i, ()))
            _p2p(stage.get_bwd_recv_ops(i))
            loss = self._maybe_get_loss(stage, i)
            stage.backward_one_chunk(i, loss=loss, last_backward=i == n - 1)
            if loss is not None:  # keep the value for logging, not the graph
                self._internal_losses[i] = loss.detach()
            _p2p(stage.get_bwd_send_ops(i))
            _shrink(stage.grad_recv_info.get(i, ()))
            _shrink(stage.args_recv_info.get(i, ()))

        self._update_losses(stage, losses)
        stage.perform_reduce_grad(n if self.scale_grads else 1)


SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipeLean": ScheduleGPipeLean,
}


@dataclass
class Pipeline:
    """This rank's stages of a pipeline, and the schedule that drives them."""

    schedule: object
    stages: list[TimedStage]
    modules: list[nn.Module]
    n_microbatches: int
    layers: dict[int, list[int]] = field(default_factory=dict)  # stage -> layer indices

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward + backward of one local batch. Returns the mean microbatch loss on the last stage."""
        for s in self.stages:
            s.actions.clear()
        losses: list[torch.Tensor] = []
        # Contiguous: the batch's inputs and targets are slices of one token row (stride seq+1), and torch
        # 2.11's stages check each microbatch's strides against the ones they expect (seq, 1).
        args = (inputs.contiguous(),) if self.has_first else ()
        target = targets.contiguous() if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if not self.has_last:
            return None
        return torch.stack([l.detach().float() for l in losses]).mean()

    def actions(self) -> list[dict]:
        """The measured F/B actions of the last step, in start order."""
        return sorted((a for s in self.stages for a in s.actions), key=lambda a: a["start"])


def stage_io(stages: "Stages", mcfg: ModelConfig, pcfg: ParallelConfig,
             tcfg: TrainConfig) -> list[tuple[tuple, tuple]]:
    """Example (inputs, outputs) of one microbatch for each of this rank's pipeline stages, on meta.

    Given to the stages, they need not learn them from their neighbours at the first step: a fake rank
    (memory prediction) has none to ask, and a real run skips torch 2.13's first-step shape inference,
    whose forward graph stayed alive for the whole run (one microbatch of activations on stage 0). Torch
    checks every microbatch against them::

        input    stage 0: token ids (mb, seq) int64        later: hidden states (mb, seq', dim)
        output   last stage: logits (mb, seq, vocab)       earlier: hidden states (mb, seq', dim)

    ``seq' = seq / tp`` under sequence parallelism (each tp rank passes its slice of the sequence).
    Hidden states are bfloat16 where the blocks' parameters are (dtype bfloat16, or FSDP2's bf16 mixed
    precision policy) and float32 otherwise: under autocast the residual stream stays float32. Logits
    are bfloat16 under any bf16 setting (autocast runs the output head in bfloat16).
    """
    from torch.distributed.fsdp import FSDPModule

    from workbench import compat

    mb = tcfg.global_batch // pcfg.dp // pcfg.pp_microbatches
    seq = tcfg.seq_len
    local_seq = seq // pcfg.tp if pcfg.sequence_parallel else seq
    bf16 = tcfg.dtype == "bfloat16"
    fsdp = isinstance(stages.modules[0], FSDPModule)
    hidden_dtype = torch.bfloat16 if bf16 or (tcfg.mixed_precision == "bf16" and fsdp) else torch.float32
    logits_dtype = torch.bfloat16 if bf16 or tcfg.mixed_precision == "bf16" else torch.float32
    out = []
    with compat.outside_dispatch_modes():  # plain meta tensors: shapes for the stages, not memory
        # requires_grad: their gradients travel back (torch derives the gradients' shapes from these)
        hidden = torch.empty((mb, local_seq, mcfg.dim), dtype=hidden_dtype, device="meta", requires_grad=True)
        for s in stages.stage_ids:
            ins = torch.empty((mb, seq), dtype=torch.long, device="meta") if s == 0 else hidden
            outs = torch.empty((mb, seq, mcfg.vocab_size), dtype=logits_dtype, device="meta", requires_grad=True) \
                if s == stages.n_stages - 1 else hidden
            out.append(((ins,), (outs,)))
    return out


def build_pipeline(stages: "Stages", parallel: ParallelConfig, mesh: DeviceMesh,
                   example_io: list[tuple[tuple, tuple]] | None = None) -> Pipeline:
    """Wrap this rank's already built stage modules (``workbench.parallel.build.build_stages``) into
    ``PipelineStage``s and the schedule that drives them.

    ``example_io``: per stage, example (inputs, outputs) of one microbatch (meta tensors will do), given
    to ``PipelineStage`` so it knows its boundary shapes without asking its neighbours (a fake run has
    none to ask). Without it the stages infer them at the first step, as torch does by default.
    """
    pp_mesh = mesh["pp"]
    io = example_io or [((), ())] * len(stages.modules)
    timed = [TimedStage(module, s, stages.n_stages, stages.device, group=pp_mesh.get_group(),
                        **({"input_args": ins, "output_args": outs} if example_io else {}))
             for module, s, (ins, outs) in zip(stages.modules, stages.stage_ids, io)]
    cls = SCHEDULES[parallel.pp_schedule]
    m = parallel.pp_microbatches
    schedule = cls(timed if parallel.pp_stages_per_rank > 1 else timed[0], n_microbatches=m,
                   loss_fn=pipeline_loss, scale_grads=True)
    return Pipeline(schedule, timed, list(stages.modules), m, dict(zip(stages.stage_ids, stages.layers)))
