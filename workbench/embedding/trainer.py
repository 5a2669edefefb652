"""The embedding training loop every rank runs, and :func:`train_embedding`, its Python entry point.

One step on data-parallel rank ``d`` of ``dp`` (tensor-parallel ranks of one replica read the same rows)::

    rows     global batch of step s (PairCorpus.batch_ids), this rank's contiguous slice of B = global/dp
    embed    GradCache (workbench.embedding.gradcache): no-grad pass, InfoNCE over every rank's
             candidates (gathered with the right gradient), replay per chunk; the data-parallel engine
             (DDP, FSDP2) reduces the backbone's gradients on the last replay only
    head     the projection and the learned temperature sit outside the engine: their gradients are
             averaged over the dp ranks here, as the engine averages the backbone's
    update   clip, AdamW, LR schedule (workbench.train.step's helpers)

Rank ``d``'s loss is the mean over its queries, and gradients are averaged over the ``dp`` ranks: the
step is that of one process with the whole global batch (tests/test_embedding.py).

The run directory is the main trainer's: ``config.json`` (the JobConfig: model, layout, training
settings), ``embedding.json`` (:class:`EmbeddingConfig`), ``events.jsonl`` (``start``, ``step`` with
``loss``, ``tokens_per_s``, ``step_time_s``, ``mem_bytes``; ``eval`` with ``retrieval_accuracy``;
``checkpoint``, ``resume``, ``end``, ``error``) and ``checkpoints/`` written by
``workbench.checkpoint``'s Checkpointer, which ``resume`` reads back in any layout.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from workbench.checkpoint.load import load as load_checkpoint
from workbench.checkpoint.saver import Checkpointer, manifest_base
from workbench.checkpoint.state import TrainState
from workbench.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from workbench.display import RendersInNotebook
from workbench.embedding.config import EmbeddingConfig
from workbench.embedding.data import PairCorpus
from workbench.embedding.encoder import Encoder, drop_head
from workbench.embedding.gradcache import cached_backward
from workbench.embedding.loss import InfoNCE, retrieval_accuracy
from workbench.mesh import build_mesh, dp_rank
from workbench.models import build_model
from workbench.parallel.apply import build_optimizer, ddp_dim, shard
from workbench.parallel.build import materialize
from workbench.parallel.data import apply_ddp
from workbench.train.events import EventWriter, read_events
from workbench.train.group import init_group
from workbench.train.step import clip_grads_, lr_lambda
from workbench.train.trainer import _mem_bytes  # the main trainer's step-event memory: CUDA peak or RSS

EMBEDDING_FILE = "embedding.json"

__all__ = ["EmbeddingModel", "EmbeddingRun", "build_encoder", "check_layout", "train_embedding", "train_rank",
           "embedding_task"]


class EmbeddingModel(nn.Module):
    """What is trained and checkpointed: the encoder (backbone, projection) and the loss (its learned
    temperature). Checkpoint keys are ``encoder.backbone.<the model's own names>``, ``encoder.projection.weight``
    and ``loss.log_scale`` under every layout."""

    def __init__(self, encoder: Encoder, loss: InfoNCE):
        super().__init__()
        self.encoder, self.loss = encoder, loss

    def head_parameters(self) -> list[nn.Parameter]:
        """Parameters outside the backbone's data-parallel engine (their gradients are averaged here)."""
        return [*(self.encoder.projection.parameters() if self.encoder.projection is not None else ()),
                *self.loss.parameters()]


def corpus_of(ecfg: EmbeddingConfig, tcfg: TrainConfig) -> PairCorpus:
    return PairCorpus(seq_len=tcfg.seq_len, held_out=ecfg.held_out, hard_gap=ecfg.hard_gap, seed=tcfg.seed,
                      task=ecfg.task, crop=ecfg.crop)


# TrainConfig settings the embedding loop does not implement, with what to use instead.
_UNSUPPORTED = {
    "micro_batch": "use --chunk (GradCache: chunks keep every in-batch negative, which accumulation would not)",
    "ema": "turn --ema off",
    "memory": "record memory with the main trainer (workbench train --memory)",
    "compile": "turn --compile off",
    "mixed_precision": "use --mixed-precision none (or --dtype bfloat16)",
}


def check_train_settings(tcfg: TrainConfig) -> None:
    """Refuse, in one line, a training setting this loop would otherwise ignore."""
    defaults = TrainConfig()
    for name, fix in _UNSUPPORTED.items():
        if getattr(tcfg, name) != getattr(defaults, name):
            raise ValueError(f"{name}={getattr(tcfg, name)!r} is not supported by the embedding trainer; {fix}")


def check_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """What the embedding trainer runs: any dp_replicate x dp_shard x tp of a dense model."""
    if parallel.pp > 1:
        raise ValueError(f"pp={parallel.pp}: the embedding trainer runs without pipeline stages (pooling needs the "
                         "last stage's states on every rank); use pp=1 with dp_shard/dp_replicate/tp")
    if model.n_experts:
        raise ValueError(f"{model.name} is a mixture of experts; the embedding trainer takes a dense model "
                         "(e.g. tiny or small)")
    if parallel.sequence_parallel and parallel.tp > 1:
        raise ValueError("sequence_parallel: the final hidden states would hold a slice of each sequence, which "
                         "pooling needs whole; turn sequence_parallel off (tp alone works)")


def build_encoder(mcfg: ModelConfig, pcfg: ParallelConfig, tcfg: TrainConfig, ecfg: EmbeddingConfig, mesh,
                  device: torch.device) -> EmbeddingModel:
    """The parallelized encoder, through the pieces of the main build path (``workbench.parallel.build``):
    the model on meta without its LM head, sharded (TP, activation checkpointing, FSDP2), materialized from
    ``train.seed`` (the same weights as ``build_model(cfg, seed)`` in every layout), then DDP where the
    layout replicates with it."""
    check_layout(mcfg, pcfg)
    backbone = drop_head(build_model(mcfg, seed=None, device="meta"))
    if tcfg.dtype == "bfloat16":
        backbone = backbone.to(torch.bfloat16)
    backbone = shard(backbone, pcfg, mesh, tcfg)
    materialize(backbone, mcfg, tcfg.seed, device)
    dim = ddp_dim(pcfg) if mesh is not None else None
    if dim is not None:
        backbone = apply_ddp(backbone, mesh[dim])
    encoder = Encoder(mcfg, ecfg.pooling, seed=tcfg.seed, model=backbone, projection=ecfg.projection).to(device)
    ecfg.check_width(encoder.width)
    group = dp_group(pcfg) if mesh is not None else None
    loss = InfoNCE(ecfg.temperature, learn_temperature=ecfg.learn_temperature, dims=ecfg.dims(), group=group,
                  gather=pcfg.dp > 1)
    return EmbeddingModel(encoder, loss.to(device))


def expected_state(mcfg: ModelConfig, ecfg: EmbeddingConfig) -> dict[str, torch.Tensor]:
    """The state dict an embedding checkpoint holds under ``model.``, on the meta device (no memory): what a
    resume is checked against before any rank starts."""
    with torch.device("meta"):
        encoder = Encoder(mcfg, ecfg.pooling, model=drop_head(build_model(mcfg, seed=None, device="meta")),
                          projection=ecfg.projection)
        loss = InfoNCE(ecfg.temperature, learn_temperature=ecfg.learn_temperature)
    return EmbeddingModel(encoder, loss).state_dict()


def dp_group(pcfg: ParallelConfig):
    """This rank's data-parallel group (over dp_replicate x dp_shard, at its tp coordinate): the ranks whose
    candidates are its negatives. Every rank creates every group (``new_group`` is collective)."""
    if pcfg.dp == 1:
        return None
    mine = None
    for t in range(pcfg.tp):
        ranks = [(r * pcfg.dp_shard + s) * pcfg.tp + t for r in range(pcfg.dp_replicate) for s in range(pcfg.dp_shard)]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _grad_sync(backbone: nn.Module):
    """``sync(last)`` for :func:`cached_backward`: the engine reduces gradients on the last replay only."""
    @contextmanager
    def sync(last: bool):
        if hasattr(backbone, "set_requires_gradient_sync"):  # FSDP2
            backbone.set_requires_gradient_sync(last)
            yield
        elif hasattr(backbone, "no_sync") and not last:  # DDP
            with backbone.no_sync():
                yield
        else:
            yield
    return sync


def train_rank(job: JobConfig, ecfg: EmbeddingConfig, run_dir: str | Path) -> None:
    """Train on this rank: in a torchrun rank (RANK, WORLD_SIZE, ... set; a gloo or NCCL group is made
    here), or in the calling process when the job has one rank."""
    pcfg = job.parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world != pcfg.world_size:
        raise ValueError(f"{world} processes for the layout {pcfg.describe()}, which needs {pcfg.world_size}")
    use_cuda = job.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    events = EventWriter(run_dir, rank)
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        if use_cuda:
            torch.cuda.set_device(device)
        init_group(use_cuda)
    try:
        _train(job, ecfg, run_dir, rank, world, device, events)
        if world > 1:
            dist.barrier()  # tear down together (see workbench.train.trainer)
    finally:
        events.close()
        if own_group:
            dist.destroy_process_group()


def _train(job: JobConfig, ecfg: EmbeddingConfig, run_dir, rank: int, world: int, device: torch.device,
           events: EventWriter) -> None:
    mcfg, pcfg, tcfg = job.model, job.parallel, job.train
    mesh = build_mesh(pcfg, device.type) if world > 1 else None
    torch.manual_seed(tcfg.seed)
    model = build_encoder(mcfg, pcfg, tcfg, ecfg, mesh, device)
    encoder, loss_fn = model.encoder, model.loss
    head = model.head_parameters()
    params = list(model.parameters())
    opt = build_optimizer(model, pcfg, mesh, tcfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tcfg))
    dp, d_rank = pcfg.dp, dp_rank(pcfg, rank)
    if tcfg.global_batch % dp:
        raise ValueError(f"global_batch={tcfg.global_batch} is not a multiple of the {dp} data-parallel ranks")
    local = tcfg.global_batch // dp
    chunk = min(ecfg.chunk or local, local)
    corpus = corpus_of(ecfg, tcfg)
    eval_q, eval_p, _ = corpus.triples(corpus.eval_ids)
    parts = 3 if ecfg.hard_negatives else 2
    tokens_per_step = tcfg.global_batch * parts * tcfg.seq_len  # texts encoded per step, padded to seq_len
    events.emit("start", pid=os.getpid(), world_size=world, layout=pcfg.describe(), task="embedding",
                device=str(device), n_params=sum(p.numel() for p in params), chunk=chunk, local_batch=local,
                train_pairs=len(corpus.train_ids), held_out=len(corpus.eval_ids), embedding=ecfg.to_dict())

    state = TrainState(model, opt, sched, rank=rank)
    ckpt = None
    ckpt_root = tcfg.ckpt_dir or os.path.join(run_dir, "checkpoints")
    if tcfg.ckpt_every:
        base = manifest_base(world, kinds=["model", "optim", "sched", "rng", "extra"], ema=False,
                             layout=pcfg.to_dict(), job={**job.to_dict(), "embedding": ecfg.to_dict()})
        mode = "zero_stall" if tcfg.zero_stall else "async" if tcfg.ckpt_async else "sync"
        from workbench.train.trainer import ckpt_owner

        ckpt = Checkpointer(ckpt_root, every=tcfg.ckpt_every, mode=mode, keep=tcfg.keep,
                            keep_every=tcfg.keep_every, manifest=base, emit=events.emit, quant=tcfg.ckpt_quant,
                            owner=ckpt_owner(job, str(run_dir)))
    start = 0
    if tcfg.resume:
        t0 = time.perf_counter()
        res = load_checkpoint(ckpt_root if tcfg.resume == "latest" else tcfg.resume, model, opt, scheduler=sched,
                              rng=True)
        if res.consumed_samples != res.step * tcfg.global_batch:
            raise ValueError(f"checkpoint {res.path.name} consumed {res.consumed_samples} pairs in {res.step} steps, "
                             f"not global_batch={tcfg.global_batch} per step; resume with the global_batch it was "
                             "saved with")
        start = state.step = res.step
        state.consumed_samples = res.consumed_samples
        from workbench.train.resumed import describe_layout, layout_changes

        saved, now = res.manifest.get("layout"), pcfg.to_dict()  # the main trainer's resume event, field for field
        changes = layout_changes(saved, now)
        events.emit("resume", step=res.step, path=str(res.path), load_s=time.perf_counter() - t0,
                    saved_layout=saved, layout=now, layout_changed=None if changes is None else bool(changes),
                    layout_changes=changes, saved_layout_desc=describe_layout(saved), layout_desc=pcfg.describe(),
                    saved_world_size=res.manifest.get("world_size"), world_size=world, steps=tcfg.steps,
                    skipped=res.skipped, read=res.read)

    sync = _grad_sync(encoder.backbone)
    group = loss_fn.group
    eval_every = ecfg.eval_every

    def evaluate(step: int) -> None:
        acc = retrieval_accuracy(encoder, eval_q, eval_p)
        events.emit("eval", step=step, retrieval_accuracy=acc, chance=1.0 / len(corpus.eval_ids),
                    candidates=len(corpus.eval_ids))

    if start == 0 and eval_every:
        evaluate(0)  # the untrained encoder: where the curve starts
    for step in range(start, tcfg.steps):
        t0 = time.perf_counter()
        lr = opt.param_groups[0]["lr"]
        ids = corpus.batch_ids(step, tcfg.global_batch)[d_rank * local:(d_rank + 1) * local]
        q, p, h = corpus.triples(ids, step)
        batch = {"queries": q, "positives": p, **({"hard": h} if ecfg.hard_negatives else {})}
        batch = {k: (t.to(device), n.to(device)) for k, (t, n) in batch.items()}
        loss = cached_backward(encoder, loss_fn, batch, chunk, seed=tcfg.seed, step=step,
                               first_sample=d_rank * local, sync=sync)
        if group is not None:
            for prm in head:  # averaged over dp, as the engine averages the backbone's gradients
                dist.all_reduce(prm.grad, group=group)
                prm.grad /= dp
        gnorm = float(clip_grads_(params, tcfg.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if world > 1:  # tp ranks hold identical losses: the mean over every rank is the dp mean
            dist.all_reduce(loss)
            loss /= world
        value = float(loss)
        dt = time.perf_counter() - t0
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value} at step {step}; lower lr (now {tcfg.lr})")
        events.emit("step", step=step, loss=value, tokens_per_s=tokens_per_step / dt, step_time_s=dt,
                    mem_bytes=_mem_bytes(device), grad_norm=gnorm, lr=lr, temperature=loss_fn.temperature)
        state.step, state.consumed_samples = step + 1, (step + 1) * tcfg.global_batch
        if ckpt is not None:
            ckpt.after_step(state)
        if (eval_every and (step + 1) % eval_every == 0) or step + 1 == tcfg.steps:
            evaluate(step + 1)
    if ckpt is not None:
        ckpt.close()
    events.emit("end", steps=tcfg.steps)


# -- the Python entry point ------------------------------------------------------------------------


@dataclass
class EmbeddingRun(RendersInNotebook):
    """A finished embedding run, read from its event stream: ``metrics`` (one row per rank and step),
    ``evals`` (retrieval accuracy by step, rank 0), ``accuracy`` (the last) against ``chance``."""

    run_dir: Path
    returncode: int = 0
    run: Any = None  # the launched workbench.Run (status, stop, root cause), when it ran through launch()
    # Read once, when the run has finished: a later run in the same directory (a resume, an overwrite)
    # writes its own events there, which are not this run's.
    _events: list[dict[str, Any]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._events = read_events(self.run_dir)

    @property
    def events(self) -> list[dict[str, Any]]:
        return self._events

    @property
    def metrics(self) -> pd.DataFrame:
        rows = [e for e in self.events if e["type"] == "step"]
        cols = ["rank", "step", "loss", "tokens_per_s", "step_time_s", "mem_bytes", "grad_norm", "lr", "temperature"]
        return pd.DataFrame(rows, columns=cols)

    @property
    def evals(self) -> pd.DataFrame:
        rows = [e for e in self.events if e["type"] == "eval" and e["rank"] == 0]
        return pd.DataFrame(rows, columns=["step", "retrieval_accuracy", "chance", "candidates"])

    @property
    def accuracy(self) -> float:
        return float(self.evals["retrieval_accuracy"].iloc[-1])

    @property
    def chance(self) -> float:
        return float(self.evals["chance"].iloc[-1])

    @property
    def error(self) -> str | None:
        errors = [e for e in self.events if e["type"] == "error"]
        return errors[0]["message"] if errors else None

    def to_dict(self) -> dict[str, Any]:
        m = self.metrics
        return {"run_dir": str(self.run_dir), "returncode": self.returncode, "steps": int(m["step"].max() + 1) if len(m) else 0,
                "final_loss": float(m[m["rank"] == 0]["loss"].iloc[-1]) if len(m) else None,
                "evals": self.evals.to_dict("records"), "error": self.error}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _repr_html_(self) -> str:
        ev = self.evals
        rows = "".join(f"<tr><td>{int(r.step)}</td><td>{r.retrieval_accuracy:.3f}</td></tr>" for r in ev.itertuples())
        return (f"<b>embedding run</b> {self.run_dir} (chance {self.chance:.3f})"
                f"<table><tr><th>step</th><th>top-1 retrieval</th></tr>{rows}</table>")


def build_embedding_job(model: str | ModelConfig | dict = "tiny", *, nproc: int | None = None, nnodes: int = 1,
                        parallel: ParallelConfig | dict | None = None, train: TrainConfig | dict | None = None,
                        embedding: EmbeddingConfig | dict | None = None,
                        **settings: Any) -> tuple[JobConfig, EmbeddingConfig]:
    """Resolve and validate every setting (one ValueError naming the fix). ``settings`` are shortcuts for
    fields of any of the configs (``dp_shard=2``, ``steps=100``, ``chunk=4``, ``dropout=0.1``)."""
    from workbench.train.launcher import build_job

    names = {f for f in EmbeddingConfig.__dataclass_fields__}
    emb = {k: settings.pop(k) for k in list(settings) if k in names}
    if isinstance(embedding, dict):
        embedding = EmbeddingConfig.from_dict(embedding)
    ecfg = replace(embedding or EmbeddingConfig(), **emb)
    train = TrainConfig.from_dict(train) if isinstance(train, dict) else train
    job = build_job(model, nproc=nproc, nnodes=nnodes, parallel=parallel, train=train, **settings)
    job = replace(job, train=replace(job.train, data="text"))  # recorded in config.json: the shipped text
    check_train_settings(job.train)
    check_layout(job.model, job.parallel)
    ecfg.check_width(ecfg.projection or job.model.dim)
    if job.train.global_batch % job.parallel.dp:
        raise ValueError(f"global_batch={job.train.global_batch} is not a multiple of the {job.parallel.dp} "
                         f"data-parallel ranks; choose a multiple of {job.parallel.dp}")
    corpus_of(ecfg, job.train).batch_ids(0, job.train.global_batch)  # the corpus's own limits, before anything starts
    return job, ecfg


def train_embedding(model: str | ModelConfig | dict = "tiny", *, out: str | Path | None = None,
                    nproc: int | None = None, parallel: ParallelConfig | dict | None = None,
                    train: TrainConfig | dict | None = None, embedding: EmbeddingConfig | dict | None = None,
                    in_process: bool | None = None, timeout_s: float | None = None, progress: bool = True,
                    overwrite: bool = False, adopt_ckpt_dir: bool = False, **settings: Any) -> EmbeddingRun:
    """Train a contrastive sentence encoder on verse pairs from the shipped text and return the run.

    ``settings``: fields of ParallelConfig (``dp_shard=2``, ``tp=2``), TrainConfig (``steps``,
    ``global_batch``, ``lr``, ``ckpt_every``, ``resume``), EmbeddingConfig (``pooling``, ``chunk``,
    ``matryoshka``, ``task``, ...) or the model (``dropout``). Several ranks run through
    :func:`workbench.launch` (torchrun; gloo on CPU, NCCL on GPUs: the same ranks, events and failure
    reports as language-model runs); one rank runs in this process unless ``in_process=False``.
    ``out``: the run directory; one that holds a run is refused unless ``resume`` or ``overwrite=True``.
    Its checkpoint directory (``ckpt_dir``) is checked and claimed as :func:`workbench.launch` does
    (``adopt_ckpt_dir=True`` takes over one another run owns; :mod:`workbench.train.rundir`).
    ``progress``: a tqdm bar over the steps, with the loss and the latest retrieval accuracy. Raises
    ValueError for invalid settings (before anything starts), RuntimeError with the failing rank's
    message, TimeoutError after ``timeout_s`` (every rank stopped).
    """
    from workbench.train.rundir import check_outputs, check_reusable, clear_run

    job, ecfg = build_embedding_job(model, nproc=nproc, parallel=parallel, train=train, embedding=embedding,
                                    **settings)
    run_dir = Path(out) if out is not None else Path("runs") / ("embedding-" + time.strftime("%Y%m%d-%H%M%S"))
    world = job.parallel.world_size
    if in_process is None:
        in_process = world == 1
    if in_process and world != 1:
        raise ValueError(f"in_process=True runs one rank; the layout {job.parallel.describe()} has {world}")
    if not in_process:
        from workbench.train.launcher import launch

        names = set(EmbeddingConfig.__dataclass_fields__)  # already in ecfg
        rest = {k: v for k, v in settings.items() if k not in names}
        run = launch(model, out=run_dir, nproc=nproc, parallel=parallel, train=train, task=embedding_task(ecfg),
                     overwrite=overwrite, adopt_ckpt_dir=adopt_ckpt_dir, **rest)
        return _follow(run, timeout_s, _Progress(run_dir, job) if progress else None)
    check_reusable(run_dir, resume=job.train.resume is not None, overwrite=overwrite)
    target = None
    if job.train.resume is not None:  # before anything is written: the checkpoint exists and fits
        from workbench.checkpoint.load import check_resume

        root = job.train.ckpt_dir or run_dir / "checkpoints"
        target = check_resume(job.train.resume, root, job.model, expected_state(job.model, ecfg))
    outputs = check_outputs(run_dir, job, overwrite=overwrite, adopt=adopt_ckpt_dir, resume_target=target)
    if overwrite:
        clear_run(run_dir, keep_checkpoints=job.train.resume is not None)
    run_dir.mkdir(parents=True, exist_ok=True)
    outputs.claim()
    (run_dir / "events.jsonl").unlink(missing_ok=True)
    (run_dir / "config.json").write_text(json.dumps(job.to_dict(), indent=2))
    (run_dir / EMBEDDING_FILE).write_text(ecfg.to_json())
    from workbench.embedding import worker

    bar = _Progress(run_dir, job) if progress else None
    try:
        with _polling(bar):
            code = worker.main([str(run_dir)], raise_errors=True)
    finally:
        if bar is not None:
            bar.close()
    return EmbeddingRun(run_dir, code)


def embedding_task(embedding: EmbeddingConfig | dict | None = None):
    """This trainer as a :class:`workbench.train.launcher.Task`: ``workbench.launch(..., task=embedding_task(cfg))``
    starts it on the launcher's ranks (the settings then hold no EmbeddingConfig fields: they are in ``cfg``)."""
    from workbench.train.launcher import Task

    if isinstance(embedding, dict):
        embedding = EmbeddingConfig.from_dict(embedding)
    ecfg = embedding or EmbeddingConfig()
    names = set(EmbeddingConfig.__dataclass_fields__)

    def build(model, **settings) -> JobConfig:
        given = sorted(k for k in settings if k in names)
        if given:
            raise ValueError(f"{', '.join(given)}: embedding settings of a task go in its EmbeddingConfig "
                             "(embedding_task(EmbeddingConfig(...)))")
        return build_embedding_job(model, embedding=ecfg, **settings)[0]

    return Task(name="embedding", entry="workbench.embedding.trainer:task_main", build=build,
                files={EMBEDDING_FILE: ecfg.to_json()}, model_state=lambda job: expected_state(job.model, ecfg))


def task_main(job: JobConfig, run_dir: str) -> None:
    """A rank of an embedding task (the launcher's worker calls it): the settings from ``embedding.json``."""
    ecfg = EmbeddingConfig.from_dict(json.loads((Path(run_dir) / EMBEDDING_FILE).read_text()))
    train_rank(job, ecfg, run_dir)


def _follow(run, timeout_s: float | None, bar: "_Progress | None") -> EmbeddingRun:
    """Wait for a launched run, feeding the progress bar; stop every rank on timeout or Ctrl-C."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not run.done:
            if deadline is not None and time.monotonic() > deadline:
                run.stop()
                raise TimeoutError(f"the embedding run in {run.run_dir} took longer than {timeout_s:g} s; every rank "
                                   "was stopped; raise timeout_s or lower steps")
            if bar is not None:
                bar.poll()
            time.sleep(0.2)
    except KeyboardInterrupt:
        run.stop()
        raise
    finally:
        if bar is not None:
            bar.close()
    result = EmbeddingRun(run.run_dir, run.returncode or 0, run=run)
    err = run.error
    if err is not None:
        raise RuntimeError(f"embedding run failed: {err}; see {run.log_path}")
    return result


class _Progress:
    """A tqdm bar over the run's steps, fed from rank 0's events (it starts at the resumed step)."""

    def __init__(self, run_dir: Path, job: JobConfig):
        from workbench.progress import tqdm

        from workbench.train.events import EventReader

        self.reader = EventReader(run_dir)
        self.bar = tqdm(total=job.train.steps, unit="step",
                        desc=f"embedding {job.model.name} [{job.parallel.describe()}]")
        self.accuracy: float | None = None

    def poll(self) -> None:
        for e in self.reader.read_new():
            if e.get("rank") != 0:
                continue
            if e["type"] == "resume":
                self.bar.n = e["step"]
                self.bar.set_description(f"{self.bar.desc} from step {e['step']}", refresh=False)
            elif e["type"] == "eval":
                self.accuracy = e["retrieval_accuracy"]
            elif e["type"] == "step":
                post = {"loss": f"{e['loss']:.3f}"}
                if self.accuracy is not None:
                    post["top1"] = f"{self.accuracy:.3f}"
                self.bar.set_postfix(post, refresh=False)
                self.bar.update(e["step"] + 1 - self.bar.n)

    def close(self) -> None:
        self.poll()
        self.bar.close()


@contextmanager
def _polling(bar: "_Progress | None", every_s: float = 0.2):
    """Poll ``bar`` on a thread while the body (an in-process rank) runs."""
    if bar is None:
        yield
        return
    import threading

    stop = threading.Event()

    def loop():
        while not stop.wait(every_s):
            bar.poll()

    thread = threading.Thread(target=loop, name="embedding-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
