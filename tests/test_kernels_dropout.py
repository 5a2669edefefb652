"""Fused dropout + residual add (workbench.kernels.dropout): the Triton kernel (through Triton's interpreter
on CPU) against the torch reference bit for bit, the Philox stream against Random123's known answers,
the statistics of the mask, the backward's regenerated mask, shards composing to the whole tensor,
fake tensors, torch.compile, and the training scope that seeds the model's residual adds."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import workbench.kernels  # noqa: F401  (before Triton loads: interpreter mode without CUDA)
from workbench.config import PRESETS, ModelConfig
from workbench.kernels import backend
from workbench.kernels.cases import CASES, as_tuple
from workbench.kernels.dropout import (dropout_add, dropout_scope, keep_mask, philox_rounds, residual_rng)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SEED = 987654321123  # above 2^32: both key words matter


def _rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _both(fn):
    """fn() under the Triton kernel and under the reference."""
    out = {}
    for name in ("triton", "torch"):
        with backend.use(name):
            out[name] = fn()
    return out["triton"], out["torch"]


def _fwd_bwd(x, r, p=0.3, grad=None, **kw):
    x, r = x.detach().requires_grad_(True), r.detach().requires_grad_(True)
    out = dropout_add(x, r, p, seed=SEED, **kw)
    grad = _rand(out.shape, out.dtype, seed=5) if grad is None else grad
    return (out, *torch.autograd.grad(out, (x, r), grad), grad)


def test_philox_matches_random123_known_answers():
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    m = 0xFFFFFFFF
    cases = [((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((m, m), (m, m, m, m), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for key, ctr, expect in cases:
        assert [int(w) for w in philox_rounds(*key, *map(t, ctr))] == list(expect)


LAYOUTS = [  # (local shape, kwargs): aligned and unaligned offsets, shards of larger tensors
    ((1000,), {}),
    ((4099,), {"offset": 8}),               # aligned fast path, a tail block
    ((37, 29), {"offset": 3}),              # unaligned: one Philox per element
    ((3, 20), {"global_shape": [6, 40], "shard_offset": [3, 20]}),
    ((4, 3), {"global_shape": [4, 7], "shard_offset": [0, 2], "offset": 1}),
    ((2, 3, 4, 5), {"global_shape": [4, 6, 8, 10], "shard_offset": [1, 3, 4, 5]}),  # 4 kernel dims
    ((2, 2, 2, 2, 3), {"global_shape": [2, 4, 4, 4, 6], "shard_offset": [0, 1, 2, 1, 3]}),  # 5: reference
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,kw", LAYOUTS, ids=lambda v: str(v))
def test_triton_equals_reference_bitwise(dtype, shape, kw):
    x, r = _rand(shape, dtype, 1), _rand(shape, dtype, 2)
    tri, ref = _both(lambda: _fwd_bwd(x, r, **kw))
    for a, b in zip(tri, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    out, gx, gr, grad = ref
    assert out.dtype == dtype and gx.dtype == dtype and torch.equal(gr, grad)
    # in fp32, rounded once: residual + keep * x / (1-p)
    keep = keep_mask(shape, 0.3, SEED, **kw)
    expect = (r.float() + torch.where(keep, x.float() * (1 / 0.7), 0.0)).to(dtype)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("name", ["dropout_add/forward", "dropout_add/forward-backward"])
def test_kernel_cases_match_reference(name):
    case = CASES[name]
    gen = torch.Generator().manual_seed(0)
    for dtype in case.dtypes:
        inputs = [(f"n={n}", case.make(n, dtype, torch.device("cpu"), gen)) for n in case.check_sizes]
        inputs += list(case.edge_cases(dtype, torch.device("cpu"), gen))
        for label, inp in inputs:
            tri, ref = _both(lambda: as_tuple(case.run(inp)))
            assert all(torch.equal(a, b) for a, b in zip(tri, ref)), f"{name} {dtype} {label}"
            eager = as_tuple(case.torch_eager(inp))  # timing baseline: other random bits, same shapes
            assert [t.shape for t in eager] == [t.shape for t in ref]
    assert 1 << 28 in case.bench_sizes and case.bytes_moved(case.make(10, torch.bfloat16, "cpu", gen)) > 0


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_expectation(p):
    n = 200_000
    keep = keep_mask((n,), p, seed=11, offset=12345)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * sigma
    # E[out] = residual + x: with x = 1, residual = 0 the mean of out is 1 up to the sampling error
    with backend.use("torch"):
        out = dropout_add(torch.ones(n), torch.zeros(n), p, seed=11, offset=12345)
    assert abs(out.mean().item() - 1) < 5 * math.sqrt(p / (1 - p) / n)
    # other seeds, offsets and neighbouring elements are independent draws
    other = keep_mask((n,), p, seed=12, offset=12345)
    shifted = keep_mask((n,), p, seed=11, offset=12346)
    for b in (other, shifted):
        both = (keep & b).float().mean().item()
        assert abs(both - (1 - p) ** 2) < 5 * math.sqrt((1 - p) ** 2 / n)


@pytest.mark.parametrize("name", ["triton", "torch"])
def test_backward_regenerates_the_forward_mask(name):
    x, r = _rand((3000,), seed=3), _rand((3000,), seed=4)
    with backend.use(name):
        out, gx, gr, grad = _fwd_bwd(x, r, p=0.4, offset=7)
    dropped = out == r
    assert 0.3 < dropped.float().mean() < 0.5
    assert torch.equal(gx[dropped], torch.zeros_like(gx[dropped]))
    assert torch.equal(gx[~dropped], grad[~dropped] * (1 / 0.6))
    assert torch.equal(gr, grad)
    # torch autograd on the equivalent expression with the mask spelled out
    xx, rr = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    y = rr + xx * (~dropped).float() / 0.6
    ex, er = torch.autograd.grad(y, (xx, rr), grad)
    torch.testing.assert_close(gx, ex, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gr, er)
    torch.testing.assert_close(out, y.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["triton", "torch"])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shards_compose_to_the_whole_tensor(name, dim):
    """Two halves computed with (global_shape, shard_offset) equal the whole tensor's result: rows, columns,
    and a middle dimension (sequence parallel's split)."""
    shape = (4, 6, 10)
    x, r, grad = _rand(shape, seed=5), _rand(shape, seed=6), _rand(shape, seed=7)
    with backend.use(name):
        whole = _fwd_bwd(x, r, offset=64, grad=grad)
        half = shape[dim] // 2
        parts = []
        for i, (xs, rs, gs) in enumerate(zip(x.split(half, dim), r.split(half, dim), grad.split(half, dim))):
            off = [0, 0, 0]
            off[dim] = i * half
            parts.append(_fwd_bwd(xs, rs, offset=64, grad=gs, global_shape=list(shape), shard_offset=off))
    for k in range(3):
        assert torch.equal(torch.cat([p[k] for p in parts], dim), whole[k])


def test_mixed_dtypes_and_plain_add():
    x, r = _rand((50, 3), torch.bfloat16, 7), _rand((50, 3), torch.float32, 8)
    tri, ref = _both(lambda: _fwd_bwd(x, r))
    assert all(torch.equal(a, b) for a, b in zip(tri, ref))
    out, gx, gr, _ = ref
    assert (out.dtype, gx.dtype, gr.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    # p = 0 and training=False are the plain add, bit for bit
    assert torch.equal(dropout_add(x, r, 0.0, seed=1), r + x)
    assert torch.equal(dropout_add(x, r, 0.5, seed=1, training=False), r + x)


def test_empty_and_non_contiguous():
    for shape in [(0,), (3, 0), (0, 5)]:
        tri, ref = _both(lambda: dropout_add(torch.ones(shape), torch.ones(shape), 0.2, seed=1))
        assert tri.shape == ref.shape == shape
    x, r = _rand((30, 20), seed=9), _rand((20, 30), seed=10)
    tri, ref = _both(lambda: _fwd_bwd(x.t(), r, offset=2))
    assert all(torch.equal(a, b) for a, b in zip(tri, ref))
    assert torch.equal(ref[0], dropout_add(x.t().contiguous(), r, 0.3, seed=SEED, offset=2))


@pytest.mark.parametrize("call,message", [
    (lambda x: dropout_add(x, x, 1.0, seed=1), r"p=1.0 must be a probability in \[0, 1\)"),
    (lambda x: dropout_add(x, x, -0.1, seed=1), r"p=-0.1 must be a probability"),
    (lambda x: dropout_add(x, x[:2], 0.1, seed=1), r"x has shape \(4, 5\) but residual has \(2, 5\)"),
    (lambda x: dropout_add(x, x, 0.1, seed=-3), r"seed=-3 must be an integer in \[0, 2\^63\)"),
    (lambda x: dropout_add(x, x, 0.1, seed=1, offset=-1), r"offset=-1 must be an integer >= 0"),
    (lambda x: dropout_add(x, x, 0.1, seed=1, global_shape=[4, 8], shard_offset=[0, 4]), r"does not fit"),
    (lambda x: dropout_add(x.long(), x.long(), 0.1, seed=1), r"floating-point"),
])
def test_errors_name_the_problem(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(torch.zeros(4, 5))


def test_fake_tensor_mode():
    with FakeTensorMode():
        x = torch.empty(64, 32, dtype=torch.bfloat16, requires_grad=True)
        r = torch.empty(64, 32, dtype=torch.float32, requires_grad=True)
        with backend.use("triton"):
            out = dropout_add(x, r, 0.1, seed=3, offset=5)
        assert out.shape == (64, 32) and out.dtype == torch.float32
        gx, gr = torch.autograd.grad(out.sum(), (x, r))
        assert gx.dtype == torch.bfloat16 and gr.dtype == torch.float32 and gx.shape == (64, 32)


def test_torch_compile_fullgraph():
    def fn(x, r):
        return dropout_add(x, r, 0.25, seed=42, offset=4) * 2

    x, r = _rand((16, 8), seed=11).requires_grad_(True), _rand((16, 8), seed=12)
    with backend.use("torch"):
        eager = fn(x, r)
        compiled = torch.compile(fn, fullgraph=True)(x, r)
        (g_eager,) = torch.autograd.grad(eager.sum(), x)
        (g_comp,) = torch.autograd.grad(compiled.sum(), x)
    assert torch.equal(eager, compiled) and torch.equal(g_eager, g_comp)


# ---------------------------------------------------------------------------------------------------
# the training scope and the model's residual adds
# ---------------------------------------------------------------------------------------------------
def test_scope_seeds_follow_step_layer_site_and_sample():
    x = torch.empty(2, 3, 4)
    with dropout_scope(seed=1, step=5, first_sample=6):
        base = residual_rng(0, 0, x)
        assert residual_rng(0, 0, x) == base                       # recomputation draws the same
        assert base["offset"] == 6 * 12                             # offset: first sample x elements per row
        others = {residual_rng(1, 0, x)["seed"], residual_rng(0, 1, x)["seed"]}
    with dropout_scope(seed=1, step=6, first_sample=6):
        others.add(residual_rng(0, 0, x)["seed"])
    with dropout_scope(seed=2, step=5, first_sample=6):
        others.add(residual_rng(0, 0, x)["seed"])
        with dropout_scope(seed=1, step=5, first_sample=0, microbatch=lambda: 3):  # pipeline: + 3 x 2 rows
            assert residual_rng(0, 0, x) == base
    assert len(others) == 4 and base["seed"] not in others
    # outside a scope each call draws afresh
    assert residual_rng(0, 0, x)["seed"] != residual_rng(0, 0, x)["seed"]


def test_sequence_parallel_chunks_draw_the_whole_sequence_mask():
    """Under sequence parallelism each tp rank holds one sequence chunk of the residual stream; the two
    chunks' masks, drawn at their global positions, are the unsharded stream's mask (not one mask twice)."""
    x, r = torch.randn(2, 8, 4), torch.randn(2, 8, 4)
    with dropout_scope(seed=3, step=1, first_sample=2):
        whole = dropout_add(x, r, 0.5, **residual_rng(0, 0, x))
    parts = []
    for rank in range(2):
        with dropout_scope(seed=3, step=1, first_sample=2, seq_shard=(rank, 2)):
            chunk = slice(4 * rank, 4 * rank + 4)
            parts.append(dropout_add(x[:, chunk], r[:, chunk], 0.5, **residual_rng(0, 0, x[:, chunk])))
    assert torch.equal(torch.cat(parts, dim=1), whole)
    assert not torch.equal(parts[0] - r[:, :4], parts[1] - r[:, 4:])
    with pytest.raises(ValueError, match="seq_shard"):
        with dropout_scope(seed=0, step=0, first_sample=0, seq_shard=(2, 2)):
            pass


def test_model_dropout_only_in_training():
    from workbench.models.llama import build_model

    cfg = PRESETS["tiny"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = build_model(cfg, seed=3)
    drop = build_model(ModelConfig(**{**cfg.to_dict(), "dropout": 0.2}), seed=3)
    with torch.no_grad(), dropout_scope(seed=0, step=0, first_sample=0):
        ref = plain(tokens)
        assert torch.equal(drop.eval()(tokens), ref)                 # eval: the plain adds, bit for bit
        a, b = drop.train()(tokens), drop(tokens)
        assert torch.equal(a, b) and not torch.equal(a, ref)         # same scope: same masks
    with pytest.raises(ValueError, match=r"dropout=1.0 must be a probability in \[0, 1\)"):
        ModelConfig(dropout=1.0)
