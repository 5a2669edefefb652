"""A trainer-written checkpoint and its Hugging Face exports, shared by the checkpoint-view tests (issue 28).

``trained_checkpoint`` saves what ``workbench train`` saves (``workbench.checkpoint.save`` of a
``TrainState``: model, AdamW state with its hyper-parameters packed in one ``optim.hyper.<digest>`` item, LR
scheduler, RNG, step counters) after one AdamW step of the tiny preset, in one process, in about a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig

TINY = PRESETS["tiny"]
N_MODEL = 48  # the tiny preset's weights: 5 layers x 9 + embeddings, norm, output


def trained_checkpoint(ckpt_dir: Path, *, seed: int = 0, steps: int = 1, lr: float = 3e-3,
                       quant: str | None = None) -> Path:
    """``ckpt_dir/step-NNNNNN`` (and ``ckpt_dir/latest``) of the tiny preset after ``steps`` AdamW steps
    (``quant``: Adam's moments stored as ``--ckpt-quant`` stores them)."""
    from workbench.checkpoint import TrainState, save
    from workbench.models import build_model

    model = build_model(TINY, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, TINY.vocab_size, (2, 16), generator=gen)).float().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    layout = ParallelConfig(dp_shard=1)
    job = JobConfig(model=TINY, parallel=layout, train=TrainConfig())
    state = TrainState(model, opt, sched, None, rank=0, step=steps, consumed_samples=8 * steps)
    return save(ckpt_dir, state, manifest={"job": job.to_dict(), "layout": layout.to_dict(), "step": steps},
                quant=quant)
