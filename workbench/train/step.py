"""One training step: the same code for a real run (the trainer) and a predicted one (``workbench.memory``).

The trainer and the memory predictor build a :class:`TrainStep` with :func:`build_train_step` and call
it once per step::

    step s   set_step(s)
             forward + loss        phase "forward",  microbatch m      } each of this rank's micro-batches,
             loss.backward()       phase "backward", microbatch m      } or the pipeline schedule (its
                                                                         stages mark every F and B)
             clip, step, zero_grad phase "optimizer"
             scheduler.step()

Nothing here reads a tensor's value, so a step also runs under ``FakeTensorMode`` with a fake process
group: the loss and the gradient norm come back as tensors, and the trainer alone turns them into
numbers (``float``, ``math.isfinite``). Loss bookkeeping keeps every layout equal to the single-process
run: each micro-batch loss is the token-mean cross entropy divided by the number of micro-batches, and
data parallelism averages over dp ranks, so the gradient is that of the mean loss over the global batch.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from workbench.config import ModelConfig, ParallelConfig, TrainConfig
from workbench.kernels.dropout import dropout_scope
from workbench.memory.marks import MARKS, microbatch, phase, set_step
from workbench.parallel.expert import load_balancing_loss
from workbench.parallel.pipeline import Pipeline, build_pipeline, stage_io
from workbench.parallel.precision import compute_context
from workbench.time.labels import BACKWARD, DATA, FORWARD, OPTIMIZER, label, labelled_batches
from workbench.train.data import micro_batches

__all__ = ["TrainStep", "StepResult", "build_train_step", "grad_norm", "clip_grads_", "lr_lambda"]


def grad_norm(params, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients of plain tensors and DTensors on any meshes.

    A DTensor gradient's local sum of squares is summed over the mesh dimensions it is sharded on and
    left alone on those it is replicated on. Grads that share those dimensions share one all-reduce.
    Pipeline stages hold different parameters, so the squares are finally summed over ``pp_group``.
    """
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    pgs: dict[tuple, list] = {}
    device = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            # Shard and FSDP's _StridedShard (not a Shard subclass) both split the tensor; Partial
            # grads do not survive backward under our styles, so "not replicated" means "sharded".
            sharded = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key = tuple(mesh.get_group(i).group_name for i in sharded)
            pgs[key] = [mesh.get_group(i) for i in sharded]
            local = g.to_local()
        else:
            key = ()
            pgs[key] = []
            local = g
        device = local.device
        groups[key].append(local.detach().float().pow(2).sum())
    if device is None and pp_group is None:
        return torch.zeros(())
    total = torch.zeros((), device=device)
    for key, parts in groups.items():
        s = torch.stack(parts).sum()
        for pg in pgs[key]:
            dist.all_reduce(s, group=pg)
        total = total + s
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grads_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Scale the gradients so their global norm is at most ``max_norm`` (0: no clipping).

    Returns the norm before clipping, as a 0-dim tensor: the decision to clip is made on the device,
    ``g *= max_norm / (norm + 1e-6)`` where ``norm > max_norm`` and ``g *= 1`` elsewhere, so nothing waits
    for the value (and a fake step, which has none, runs the same code).
    """
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params, pp_group)
    if max_norm > 0 and params:
        coef = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
        for p in params:
            p.grad.mul_(coef)
    return norm


def lr_lambda(tcfg: TrainConfig):
    """The LR multiplier of step ``s``: linear warmup over ``warmup_steps``, then constant.

    ``LambdaLR`` sets ``lr = base_lr * f(s)`` at step ``s`` (``scheduler.step()`` after each optimizer step).
    """
    warmup = tcfg.warmup_steps
    return (lambda s: min(1.0, (s + 1) / warmup)) if warmup else (lambda s: 1.0)


@dataclass
class StepResult:
    """What one step returns on this rank, all as tensors (0-dim unless said)."""

    loss_sum: torch.Tensor          # this rank's loss: the mean over its batch (0 on non-last pp stages)
    aux_sum: torch.Tensor           # MoE router loss over its batch (0 for a dense model)
    expert_load: torch.Tensor | int  # MoE: (layers, experts) token-slots over all dp ranks; 0 if dense
    grad_norm: torch.Tensor         # global gradient norm before clipping


@dataclass
class TrainStep:
    """Everything one step needs, built once by :func:`build_train_step`; call it once per step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    model_cfg: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    device: torch.device
    pipe: Pipeline | None = None
    pp_group: Any = None
    dp_groups: list = field(default_factory=list)
    probe: Any = None               # a PeakMemoryProbe entered around the pipeline schedule (trainer)
    seq_shard: tuple[int, int] | None = None  # sequence parallelism: (tp rank, tp), for dropout's masks
    params: list = field(init=False)

    def __post_init__(self) -> None:
        self.params = list(self.model.parameters())

    def batches(self, dataset, step: int, dp_rank: int):
        """This rank's (inputs, targets) at ``step``: its micro-batches, or under pp its whole local batch
        (the pipeline splits it into microbatches itself)."""
        t, dp = self.train, self.parallel.dp
        micro = t.global_batch // dp if self.pipe is not None else t.local_micro_batch(dp)
        return micro_batches(dataset, step, t.global_batch, dp_rank, dp, micro)

    def __call__(self, step: int, dataset, dp_rank: int) -> StepResult:
        set_step(step)
        # The global-batch index of this rank's first sequence: dropout masks follow the samples.
        first = dp_rank * (self.train.global_batch // self.parallel.dp)
        if self.pipe is not None:
            with label(DATA):
                batch = next(iter(self.batches(dataset, step, dp_rank)))
            loss_sum = pipeline_forward_backward(self, batch, step, first)
            aux_sum, expert_load = torch.zeros((), device=self.device), 0
        else:
            loss_sum, aux_sum, expert_load = forward_backward(self, self.batches(dataset, step, dp_rank), step, first)
        with phase("optimizer"), label(OPTIMIZER):
            gnorm = clip_grads_(self.params, self.train.grad_clip, self.pp_group)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        return StepResult(loss_sum, aux_sum, expert_load, gnorm)


def forward_backward(ts: TrainStep, batches, step: int = 0,
                     first_sample: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
    """Forward and backward over this rank's micro-batches, accumulating gradients.

    Each micro-batch loss is divided by ``accum`` so the accumulated gradient is that of the mean loss;
    gradient sync (FSDP2 reduce-scatter, DDP all-reduce) runs only on the last micro-batch.
    Dropout (``ModelConfig.dropout``) draws its masks in a scope spanning each micro-batch's forward and
    backward (so activation checkpointing recomputes the same ones), from ``step`` and the global index
    of the micro-batch's first sequence (``first_sample`` is this rank's first).
    Returns (loss sum, router aux-loss sum, tokens per expert) for this rank.
    """
    model, tcfg, mcfg, device = ts.model, ts.train, ts.model_cfg, ts.device
    accum = tcfg.grad_accum(ts.parallel.dp)
    moe = mcfg.n_experts > 0
    loss_sum = torch.zeros((), device=device)
    aux_sum, expert_load = torch.zeros((), device=device), 0
    for m, (x, y) in enumerate(labelled_batches(batches)):
        last = m == accum - 1
        sync = nullcontext()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: skip reduce-scatter until last
            model.set_requires_gradient_sync(last)
        elif hasattr(model, "no_sync") and not last:  # DDP
            sync = model.no_sync()
        scope = dropout_scope(seed=tcfg.seed, step=step, first_sample=first_sample, seq_shard=ts.seq_shard)
        first_sample += x.shape[0]
        with sync, microbatch(m), scope:
            with phase("forward"), label(FORWARD):
                with compute_context(model, tcfg.mixed_precision, device.type):
                    logits = model(x.to(device))
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten()) / accum
                del logits  # else it lives on through the next micro-batch's forward (the loss saved its own)
                aux, load = load_balancing_loss(model, ts.dp_groups) if moe else (None, None)
                total = loss if aux is None else loss + mcfg.router_aux_coef * aux / accum
            with phase("backward"), label(BACKWARD):
                total.backward()
            del total
        loss_sum += loss.detach()
        if aux is not None:
            aux_sum += aux.detach() / accum
            expert_load = expert_load + load
    return loss_sum, aux_sum, expert_load


def pipeline_forward_backward(ts: TrainStep, batch, step: int = 0, first_sample: int = 0) -> torch.Tensor:
    """One step through the pipeline schedule, which runs every microbatch's forward and backward
    (its stages mark each one's phase and microbatch). Returns this rank's loss: the mean microbatch
    loss on the last stage's ranks, zero elsewhere.

    Dropout: the scope spans the whole schedule; a block adds the running microbatch's index (the
    stage's mark) times its rows to ``first_sample``. That is each sequence's global index only because
    the schedule cuts the local batch into equal contiguous chunks (torch's pipelining does); then the
    masks are the single-process run's whatever ``microbatches``, and a schedule chunking otherwise
    would draw other (still valid) masks."""
    x, y = batch
    device = ts.device
    loss_sum = torch.zeros((), device=device)
    probe = ts.probe if ts.probe is not None else nullcontext()
    if ts.probe is not None:
        ts.probe.reset_peak()
    scope = dropout_scope(seed=ts.train.seed, step=step, first_sample=first_sample,
                          microbatch=lambda: MARKS.microbatch, seq_shard=ts.seq_shard)
    with probe, phase("forward"), compute_context(ts.model[0], ts.train.mixed_precision, device.type), scope:
        stage_loss = ts.pipe.step(x.to(device), y.to(device))
    if stage_loss is not None:  # only the last stage knows the loss
        loss_sum += stage_loss
    return loss_sum


def data_parallel_groups(parallel: ParallelConfig, mesh: DeviceMesh | None) -> list:
    """The process groups of the data-parallel mesh dimensions (the MoE router loss counts over them)."""
    if mesh is None:
        return []
    return [mesh.get_group(d) for d, n in (("dp_replicate", parallel.dp_replicate), ("dp_shard", parallel.dp_shard))
            if n > 1]


def build_train_step(stages, model_cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                     mesh: DeviceMesh | None) -> TrainStep:
    """The step over ``stages`` (``workbench.parallel.build.build_stages``): this rank's pipeline
    schedule (pp > 1, its stages told their boundary shapes: ``workbench.parallel.pipeline.stage_io``),
    the run's optimizer (AdamW, or ZeRO-1's) and its LR schedule."""
    pipe = pp_group = None
    if parallel.pp > 1:
        pipe = build_pipeline(stages, parallel, mesh, example_io=stage_io(stages, model_cfg, parallel, train))
        pp_group = mesh["pp"].get_group()
    opt = stages.optimizer(parallel, mesh, train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(train))
    seq_shard = None
    if parallel.sequence_parallel and parallel.tp > 1 and mesh is not None:
        seq_shard = (mesh["tp"].get_local_rank(), parallel.tp)  # the residual stream is this sequence chunk
    return TrainStep(stages.model, opt, sched, model_cfg, parallel, train, stages.device, pipe, pp_group,
                     data_parallel_groups(parallel, mesh), seq_shard=seq_shard)
