"""The layout a real run actually has, rank by rank, to hold a simulated plan against.

A plan is only worth trusting if a real run agrees with it. Each rank of a real job can report what it
holds: for every parameter, gradient and AdamW state, the local shape, the global offset of its block
(DTensor's own ``compute_local_shape_and_global_offset``) and the dtype::

    rows = live_layout(model, optimizer)             # on each rank, after one optimizer step
    problems = check(plan, rows, rank)               # [] when the plan predicted this rank exactly

``python -m torch.distributed.run --nproc-per-node 2 -m workbench.plan.live --layout tiny:tp=2 --out DIR``
builds the model through the trainer's own build path (``workbench.parallel.build.build_stages`` and
``Stages.optimizer``), takes one training step on random tokens, and writes ``DIR/0/rank{r}.json``
(one numbered folder per ``--layout``, all run by one job).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["live_layout", "check"]


def _block(t: torch.Tensor) -> tuple[list[int], list[int], str]:
    from torch.distributed.tensor import DTensor
    from workbench.compat import compute_local_shape_and_global_offset

    dtype = str(t.dtype).removeprefix("torch.")
    if isinstance(t, DTensor):
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return list(t.to_local().shape), list(offsets), dtype
    return list(t.shape), [0] * t.dim(), dtype


def live_layout(modules: nn.Module | Iterable[nn.Module],
                optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
    """What this rank holds: one row per parameter, gradient and optimizer state it has.

    Names are the plan's: DDP's ``module.`` prefix is dropped; optimizer states are ``name.exp_avg`` /
    ``name.exp_avg_sq``. Under ZeRO-1 only this rank's partition has optimizer state.
    """
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    named = [(n.removeprefix("module."), p) for m in modules for n, p in m.named_parameters()]
    rows = []
    for name, p in named:
        shape, offsets, dtype = _block(p)
        rows.append({"name": name, "kind": "parameter", "local_shape": shape, "offsets": offsets, "dtype": dtype})
        if p.grad is not None:
            shape, offsets, dtype = _block(p.grad)
            rows.append({"name": name, "kind": "gradient", "local_shape": shape, "offsets": offsets, "dtype": dtype})
    if optimizer is not None:
        state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer wraps the local one
        for name, p in named:
            for key in ("exp_avg", "exp_avg_sq"):
                if p in state and key in state[p]:
                    shape, offsets, dtype = _block(state[p][key])
                    rows.append({"name": f"{name}.{key}", "kind": "optimizer", "local_shape": shape,
                                 "offsets": offsets, "dtype": dtype})
    return rows


def check(plan, rows: list[dict[str, Any]], rank: int) -> list[str]:
    """Differences between ``plan`` and what ``rank`` really held (``rows`` from :func:`live_layout`).

    Compares every live tensor's local shape and offsets with ``plan.local``; its dtype with the plan's
    (a live parameter against the ``master`` dtype under mixed precision, which is what the run
    stores); and that every tensor the plan gives this rank is live (gradients and states included).
    """
    problems = []
    seen = set()
    mixed = any(t.kind == "master" for t in plan.tensors)
    for row in rows:
        name, kind = row["name"], row["kind"]
        seen.add((name, kind))
        try:
            expect = plan.local(name, rank, kind)
        except KeyError:
            problems.append(f"rank {rank}: live {kind} {name} is not in the plan")
            continue
        got = (tuple(row["local_shape"]), tuple(row["offsets"]))
        if expect != got:
            problems.append(f"rank {rank}: {kind} {name} is {got} live, {expect} in the plan")
        dtype_kind, dtype_name = ("master", name + ".master") if kind == "parameter" and mixed else (kind, name)
        planned = plan.tensor(dtype_name, dtype_kind).dtype
        if planned != row["dtype"]:
            problems.append(f"rank {rank}: {kind} {name} is {row['dtype']} live, {planned} in the plan")
    for t in plan.tensors:
        if t.kind == "master" or (t.name, t.kind) in seen:
            continue
        if plan.local(t.name, rank, t.kind) is not None:
            problems.append(f"rank {rank}: the plan gives it {t.kind} {t.name}, which the run does not hold")
    return problems


def _parse_layout(text: str) -> tuple[str, dict[str, Any]]:
    """``"tiny:dp_shard=2,zero=1,mixed_precision=bf16"`` -> ("tiny", {...}): ParallelConfig and TrainConfig
    fields, parsed by the one layout parser (:func:`workbench.settings.parse_settings`)."""
    from workbench.settings import parse_settings

    model, _, rest = text.partition(":")
    return model, parse_settings(rest, ("parallel", "train"))


def run_layout(model_name: str, kw: dict[str, Any], rank: int) -> dict[str, Any]:
    """Build ``model_name`` under layout ``kw`` the way the trainer does, take one step, report."""
    import torch.nn.functional as F

    from workbench.config import ParallelConfig, TrainConfig, resolve_model
    from workbench.mesh import build_mesh
    from workbench.parallel.build import build_stages
    from workbench.parallel.precision import compute_context

    cfg = resolve_model(model_name)
    import torch.distributed as dist

    from workbench.settings import split_settings

    parts = split_settings(kw, ("parallel", "train"))
    pcfg = ParallelConfig(**parts["parallel"]).resolved(dist.get_world_size())
    tcfg = TrainConfig(**{"global_batch": 2 * pcfg.dp, "seq_len": 16, **parts["train"]})
    mesh = build_mesh(pcfg, "cpu") if pcfg.world_size > 1 else None
    torch.manual_seed(tcfg.seed)
    stages = build_stages(cfg, pcfg, tcfg, mesh, "cpu")  # the trainer's build
    model = stages.model
    opt = stages.optimizer(pcfg, mesh, tcfg)
    tokens = torch.randint(0, cfg.vocab_size, (tcfg.global_batch // pcfg.dp, tcfg.seq_len + 1),
                           generator=torch.Generator().manual_seed(rank // pcfg.tp))
    with compute_context(model, tcfg.mixed_precision, "cpu"):
        logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    return {"rank": rank, "model": model_name, "parallel": pcfg.to_dict(), "train": tcfg.to_dict(),
            "rows": live_layout(model, opt)}


def _main(argv: list[str] | None = None) -> None:
    """Each ``--layout MODEL:k=v,...`` in turn on this job's ranks; writes OUT/<i>/rank<r>.json."""
    import torch.distributed as dist

    ap = argparse.ArgumentParser(prog="workbench.plan.live")
    ap.add_argument("--layout", action="append", required=True,
                    help='e.g. "tiny:dp_shard=2" or "tiny-moe:dp_shard=2,ep=2" or "tiny:tp=2,mixed_precision=bf16"')
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        for i, text in enumerate(args.layout):
            model_name, kw = _parse_layout(text)
            doc = run_layout(model_name, kw, rank)
            out = Path(args.out) / str(i)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(doc))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from workbench.lifeline import exit_now

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _main()
    exit_now(0)  # a gloo teardown race at interpreter exit can abort a finished rank
