"""Our grad-norm/clipping matches torch's on one process (the multi-rank case is in test_parity)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from workbench.config import PRESETS
from workbench.models import build_model
from workbench.train.trainer import clip_grads_


def test_clip_matches_torch_single_process():
    a = build_model(PRESETS["tiny"], seed=0)
    b = copy.deepcopy(a)
    x = torch.randint(0, 256, (2, 16))
    for m in (a, b):
        F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    ours = clip_grads_(a.parameters(), 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert abs(ours - float(theirs)) < 1e-5 * float(theirs)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
