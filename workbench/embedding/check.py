"""Check, on real gloo ranks, that cross-rank negatives get the right gradient: the value *and* the scale.

:func:`check_gradients` starts ``world_size`` processes (a gloo group). Each holds ``batch_per_rank`` rows of
one global batch, runs the GradCache step (:func:`~workbench.embedding.gradcache.cached_backward`, chunked,
dropout on) with InfoNCE over every rank's candidates, and averages its gradients over the ranks, as data
parallelism does. This process then computes the same global batch on one rank, in one pass. The
report compares the loss and every parameter's gradient, relative to the one-rank values.

Each rank also runs the step once more with the gather that the anchors shipped and later fixed: the
backward keeps only this rank's slice of the gathered gradient, without summing the other ranks' use of its
rows (the bug behind Tevatron's, lightly's and pytorch-metric-learning's fixes). Its gradients miss every
other rank's use of this rank's candidates, so they are wrong in direction and in size; the report shows
by how much, next to the correct path's error (float rounding).
"""

from __future__ import annotations

import dataclasses
import html
import multiprocessing as mp
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workbench.config import PRESETS, ModelConfig
from workbench.display import RendersInNotebook


class _LocalSliceGather(torch.autograd.Function):
    """The common wrong gather: forward gathers every rank's rows; backward keeps this rank's slice only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.world, ctx.rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = grad.shape[0] // ctx.world
        return grad[ctx.rank * n:(ctx.rank + 1) * n], None


def local_slice_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    return _LocalSliceGather.apply(x, group)


@dataclass
class GradientCheck(RendersInNotebook):
    """Relative errors of ``world_size`` ranks with gathered negatives against one rank with the whole batch
    (``|a - b| / |b|``, the worst parameter for gradients)."""

    world_size: int
    global_batch: int
    chunk: int
    loss: float  # the one-rank loss
    loss_rel_err: float
    grad_rel_err: float
    local_slice_grad_rel_err: float  # the wrong gather's error
    local_slice_scale: float  # |wrong gradient| / |right gradient|, over all parameters
    tolerance: float = 1e-5

    @property
    def ok(self) -> bool:
        return self.loss_rel_err <= self.tolerance and self.grad_rel_err <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}

    def _repr_html_(self) -> str:
        verdict = "equal to float rounding" if self.ok else "DIFFERENT"
        rows = [("gathered negatives (workbench)", self.loss_rel_err, self.grad_rel_err, 1.0),
                ("backward keeps the local slice only", None, self.local_slice_grad_rel_err, self.local_slice_scale)]
        body = "".join(
            f"<tr><td>{html.escape(name)}</td><td>{'' if le is None else f'{le:.1e}'}</td><td>{ge:.1e}</td>"
            f"<td>{sc:.3f}</td></tr>" for name, le, ge, sc in rows)
        return (f"<b>{self.world_size} ranks x {self.global_batch // self.world_size} rows vs 1 rank x "
                f"{self.global_batch}</b> (GradCache chunks of {self.chunk}, dropout on): {verdict}"
                "<table><tr><th>path</th><th>loss rel. error</th><th>gradient rel. error (worst)</th>"
                f"<th>gradient norm / right norm</th></tr>{body}</table>")


def _config(model: str | ModelConfig, n_layers: int | None, dropout: float) -> ModelConfig:
    cfg = PRESETS[model] if isinstance(model, str) else model
    return dataclasses.replace(cfg, n_layers=n_layers or cfg.n_layers, dropout=dropout, max_seq_len=64)


def _step(cfg: ModelConfig, world: int, rank: int, global_batch: int, chunk: int, gather) -> tuple[float, list]:
    """One step's loss and gradients on ``rank`` of ``world`` (1: the whole batch in one pass)."""
    from workbench.embedding.data import PairCorpus
    from workbench.embedding.encoder import Encoder
    from workbench.embedding.gradcache import cached_backward, full_backward
    from workbench.embedding.loss import InfoNCE

    torch.manual_seed(0)
    enc, loss = Encoder(cfg), InfoNCE(0.1, learn_temperature=True, gather=gather if world > 1 else False)
    pc = PairCorpus(seq_len=40)
    q, p, h = pc.triples(pc.batch_ids(0, global_batch), step=0)
    full = {"queries": q, "positives": p, "hard": h}
    fn = lambda queries, positives, hard: loss(queries, positives, hard)  # noqa: E731
    if world == 1:
        value = full_backward(enc, fn, full, seed=1, step=0)
    else:
        per_rank = global_batch // world
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        mine = {k: (t[lo:hi], n[lo:hi]) for k, (t, n) in full.items()}
        value = cached_backward(enc, fn, mine, chunk=chunk, seed=1, step=0, first_sample=lo)
    grads = [prm.grad.detach().clone() for prm in [*enc.parameters(), *loss.parameters()]]
    return float(value), grads


def _fork_ranks(world: int, port: int, args: tuple, out) -> None:
    """In a fresh interpreter (spawned from the caller, a notebook kernel perhaps): fork the ranks, which
    share this process's imported pages (about 300 MiB of torch and workbench, paid once, not per rank),
    and wait for them. Forking here is safe: this process has run no threads of its own."""
    fctx = mp.get_context("fork")
    procs = [fctx.Process(target=_rank_main, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def _rank_main(rank: int, world: int, port: int, args: tuple, out) -> None:
    import signal

    from workbench.lifeline import follow_parent

    follow_parent(signal.SIGKILL)  # the spawned parent was stopped: do not linger
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = []
        for gather in (True, local_slice_gather):
            value, grads = _step(*args[:1], world, rank, *args[1:], gather=gather)
            for g in grads:  # data parallelism: gradients averaged over the ranks
                dist.all_reduce(g)
                g /= world
            v = torch.tensor(value)
            dist.all_reduce(v)
            results.append((float(v) / world, grads))
        # Rank 0 also runs the whole batch on its own and compares: only numbers go back to the caller,
        # whose process (a notebook kernel) then holds no model, activations or gradients of the check.
        out.put((rank, _compare(results, args) if rank == 0 else {}))
    except BaseException as e:  # noqa: BLE001 - reported in the parent as one line
        out.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def _compare(results: list, args: tuple) -> dict[str, float]:
    cfg, global_batch, chunk = args
    ref_loss, ref = _step(cfg, 1, 0, global_batch, chunk, gather=True)

    def rel(a, b) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    def norm(gs) -> float:
        return float(torch.sqrt(sum((g.double() ** 2).sum() for g in gs)))

    (loss, grads), (_, wrong) = results
    return {"loss": ref_loss, "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
            "grad_rel_err": max(rel(a, b) for a, b in zip(grads, ref)),
            "local_slice_grad_rel_err": max(rel(a, b) for a, b in zip(wrong, ref)),
            "local_slice_scale": norm(wrong) / norm(ref)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_gradients(world_size: int = 2, batch_per_rank: int = 8, chunk: int = 3, model: str | ModelConfig = "tiny",
                    n_layers: int | None = 2, dropout: float = 0.1, timeout_s: float = 120) -> GradientCheck:
    """Run the check (``world_size`` gloo processes, forked from one fresh interpreter: safe from a notebook
    kernel, and they share its memory) and return the report. Raises RuntimeError naming the rank if one fails, TimeoutError if they do not finish."""
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: the check compares several ranks with one; use 2 or more")
    if chunk < 1 or batch_per_rank < 1:
        raise ValueError(f"chunk={chunk} and batch_per_rank={batch_per_rank} must be at least 1")
    cfg = _config(model, n_layers, dropout)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    args = (cfg, batch_per_rank * world_size, chunk)
    import queue
    import time

    parent = ctx.Process(target=_fork_ranks, args=(world_size, port, args, out))
    parent.start()
    deadline = time.monotonic() + timeout_s
    try:
        got = {}
        while len(got) < world_size:
            try:
                rank, res = out.get(timeout=0.5)
            except queue.Empty:
                if parent.exitcode is not None and out.empty():
                    raise RuntimeError(f"the check's processes ended early (exit code {parent.exitcode}) with "
                                       f"{len(got)} of {world_size} results; see the output above") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world_size} ranks did not finish within {timeout_s:g} s; raise "
                                       "timeout_s") from None
                continue
            if isinstance(res, str):
                raise RuntimeError(f"rank {rank} failed: {res}")
            got[rank] = res
    finally:
        parent.join(timeout=10)
        if parent.is_alive():
            parent.kill()  # its ranks follow it (workbench.lifeline)
            parent.join()
    return GradientCheck(world_size=world_size, global_batch=batch_per_rank * world_size, chunk=chunk, **got[0])


__all__ = ["check_gradients", "GradientCheck", "local_slice_gather"]
