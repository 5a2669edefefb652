"""Data is a function of (seed, sample index): the layout never changes what is trained on."""

from __future__ import annotations

import torch

from workbench.train.data import SyntheticDataset, TextDataset, corpus_bytes, make_dataset, micro_batches


def _rows(ds, step, B, dp, micro):
    out = []
    for d in range(dp):
        for x, y in micro_batches(ds, step, B, d, dp, micro):
            torch.testing.assert_close(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
            out.append(torch.cat([x, y[:, -1:]], dim=1))
    return torch.cat(out)


def test_global_batch_is_the_same_for_every_layout():
    ds = make_dataset("synthetic", 256, 32, seed=7)
    ref = _rows(ds, step=3, B=8, dp=1, micro=8)
    for dp, micro in [(2, 4), (2, 1), (4, 2), (8, 1)]:
        torch.testing.assert_close(_rows(ds, 3, 8, dp, micro), ref)


def test_steps_and_seeds_differ():
    ds = make_dataset("synthetic", 256, 32, seed=7)
    assert not torch.equal(_rows(ds, 0, 8, 1, 8), _rows(ds, 1, 8, 1, 8))
    other = make_dataset("synthetic", 256, 32, seed=8)
    assert not torch.equal(_rows(ds, 0, 8, 1, 8), _rows(other, 0, 8, 1, 8))


def test_synthetic_data_is_learnable():
    ds = SyntheticDataset(256, 512, seed=0)
    seq = ds[0]
    follows = (ds.next_token[seq[:-1]] == seq[1:]).float().mean()
    assert 0.85 < follows < 0.95  # 90% of transitions follow the chain


def test_text_corpus_is_shipped_and_readable():
    tokens = corpus_bytes()
    assert len(tokens) > 300_000
    text = bytes(tokens[:200].tolist()).decode()
    assert text.startswith("In the beginning God created the heaven and the earth.")
    ds = TextDataset(256, 64, seed=0)
    assert ds[5].shape == (65,) and int(ds[5].max()) < 256
