"""Contrastive embedding core: chunked (GradCache) gradients, cross-rank negatives' scale, label alignment.

Two gloo ranks each holding half the batch, with negatives gathered across them, must give the same loss
(averaged) and the same averaged parameter gradients as one process with the whole batch: values, so
the 1/world_size scale that Tevatron, lightly and pytorch-metric-learning each had to fix is checked.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from workbench.config import PRESETS
from workbench.embedding import Encoder, InfoNCE, PairCorpus
from workbench.embedding.gradcache import cached_backward, full_backward

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2, max_seq_len=64, dropout=0.1)
B = 8


def _batch(n: int = B):
    pc = PairCorpus(seq_len=40)
    q, p, h = pc.triples(pc.batch_ids(0, n))
    return {"queries": q, "positives": p, "hard": h}


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal up to float rounding of a different summation order: relative to the tensor's norm."""
    return float((a - b).norm()) <= rel * float(a.norm()) + 1e-9


def _grads(enc, loss):
    return [p.grad.detach().clone() for p in [*enc.parameters(), *loss.parameters()]]


def test_chunked_loss_gives_the_full_batch_gradients_with_dropout():
    torch.manual_seed(0)
    enc, loss = Encoder(CFG), InfoNCE(0.1, learn_temperature=True, dims=(128, 32))
    fn = lambda queries, positives, hard: loss(queries, positives, hard)  # noqa: E731
    ref_loss = full_backward(enc, fn, _batch(), seed=3, step=5)
    ref = _grads(enc, loss)
    enc.zero_grad(), loss.zero_grad()
    got_loss = cached_backward(enc, fn, _batch(), chunk=3, seed=3, step=5)
    assert torch.allclose(got_loss, ref_loss, rtol=1e-6)
    for a, b in zip(ref, _grads(enc, loss)):
        assert _close(a, b)
    # dropout is on: another step's masks give other gradients (so the equality above is not vacuous)
    enc.zero_grad(), loss.zero_grad()
    full_backward(enc, fn, _batch(), seed=3, step=6)
    assert any(not _close(a, b, 1e-2) for a, b in zip(ref, _grads(enc, loss)))


def test_hard_negatives_come_after_every_positive():
    """Perfect embeddings (each query equals its positive) are classified right only if the labels point
    at the positives, with the hard negatives appended behind them."""
    torch.manual_seed(0)
    q = torch.randn(B, 64)
    loss = InfoNCE(0.01)
    assert float(loss(q, q.clone(), torch.randn(B, 64))) < 1e-3
    assert float(loss(q, torch.randn(B, 64), q.clone())) > 1.0  # the match among the hard negatives is wrong


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        enc, loss = Encoder(CFG), InfoNCE(0.1, learn_temperature=True)
        fn = lambda queries, positives, hard: loss(queries, positives, hard)  # noqa: E731
        full = _batch(B * world)
        mine = {k: (t[rank * B:(rank + 1) * B], n[rank * B:(rank + 1) * B]) for k, (t, n) in full.items()}
        value = cached_backward(enc, fn, mine, chunk=3, seed=1, step=0, first_sample=rank * B)
        grads = _grads(enc, loss)
        for g in grads:  # data parallelism: average the gradients over the ranks
            dist.all_reduce(g)
            g /= world
        dist.all_reduce(value)
        out.put((rank, float(value) / world, [g.numpy() for g in grads]))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_two_ranks_with_gathered_negatives_equal_one_rank_with_the_whole_batch():
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    torch.manual_seed(0)
    enc, loss = Encoder(CFG), InfoNCE(0.1, learn_temperature=True)
    ref_loss = full_backward(enc, lambda queries, positives, hard: loss(queries, positives, hard), _batch(2 * B), seed=1)
    ref = _grads(enc, loss)
    for rank, value, grads in results:
        assert abs(value - float(ref_loss)) < 1e-5 * abs(float(ref_loss)), (rank, value, float(ref_loss))
        for a, b in zip(ref, grads):
            assert _close(a, torch.from_numpy(b)), rank
    # the scale matters: half of it (a backward without the cross-rank sum) is far outside the tolerance
    assert not _close(ref[0] / 2, torch.from_numpy(results[0][2][0]), 1e-2)


def test_encoder_pooling_ignores_padding():
    torch.manual_seed(0)
    enc = Encoder(dataclasses.replace(CFG, dropout=0.0)).eval()
    tokens = torch.randint(1, 256, (1, 20))
    padded = torch.cat([tokens, torch.zeros(1, 12, dtype=torch.long)], dim=1)
    for pooling in ("mean", "last"):
        enc.pooling = pooling
        a = enc(tokens, torch.tensor([20]))
        b = enc(padded, torch.tensor([20]))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pooling='max' is unknown"):
        Encoder(CFG, pooling="max")
    assert F.normalize(a, dim=-1).shape == (1, CFG.dim)
