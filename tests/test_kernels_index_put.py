"""workbench::index_put and the Embedding built on it: Triton (interpreter on CPU) vs the torch reference
vs torch's own ops, bit for bit where the op promises it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import workbench.kernels  # noqa: F401  (TRITON_INTERPRET=1 before Triton loads)
from workbench.kernels import CASES, backend
from workbench.kernels.embedding import Embedding, embedding
from workbench.kernels.index_put import index_put

BACKENDS = ("triton", "torch")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODES = {"deterministic": (True, True), "atomic": (True, False), "overwrite": (False, True)}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rand(g, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=g).to(dtype)


def _ours(name, x, indices, v, accumulate=False, deterministic=True):
    with backend.use(name):
        return index_put(x, indices, v, accumulate, deterministic=deterministic)


def _torch(x, indices, v, accumulate=False):
    return torch.ops.aten.index_put(x, list(indices), v, accumulate)


def _close(a, b, dtype):
    tol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2), torch.float16: (5e-3, 5e-3)}[dtype]
    torch.testing.assert_close(a, b, atol=tol[0], rtol=tol[1])


# ---------------------------------------------------------------------------------------------------
# forward: every registered case and its edge cases (empty, zero-element, negative, int32, scalar
# value, non-contiguous, all-true / all-false masks, duplicates, None and separated index patterns)
# ---------------------------------------------------------------------------------------------------
FORWARD_CASES = [n for n, c in CASES.items() if c.op == "index_put" and not c.backward]


def test_cases_are_registered():
    names = set(CASES)
    for mode in ("accumulate-deterministic", "accumulate-atomic", "overwrite"):
        assert {f"index_put/{mode}-1d", f"index_put/{mode}-rows"} <= names
    assert {"index_put/accumulate-backward-rows", "index_put/overwrite-backward-rows"} <= names
    assert CASES["index_put/accumulate-deterministic-1d"].bench_sizes[-1] == 1 << 24


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORWARD_CASES)
def test_case_matches_reference_and_torch(name, dtype):
    case = CASES[name]
    g = _gen(1)
    inputs = [(f"size{n}", case.make(n, dtype, torch.device("cpu"), g)) for n in case.check_sizes[:1]]
    inputs += list(case.edge_cases(dtype, torch.device("cpu"), g))
    for label, inp in inputs:
        with backend.use("triton"):
            got = case.run(inp)
        with backend.use("torch"):
            ref = case.run(inp)
        if case.exact:
            assert torch.equal(got, ref), label
        else:
            _close(got, ref, dtype)
        _close(got, case.torch_eager(inp), dtype)
        assert got.shape == inp["self"].shape and got.is_contiguous(), label


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.op == "index_put" and c.backward])
def test_backward_cases(name):
    case = CASES[name]
    inp = case.make(case.check_sizes[0], torch.float32, torch.device("cpu"), _gen(2))
    with backend.use("triton"):
        got = case.run(inp)
    with backend.use("torch"):
        ref = case.run(inp)
    for a, b, e in zip(got, ref, case.torch_eager(inp)):
        assert torch.equal(a, b)
        _close(a, e, torch.float32)


# ---------------------------------------------------------------------------------------------------
# duplicates: the deterministic sum, the last-writer rule, the atomics
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [(), (5,)], ids=["1d", "rows"])
def test_deterministic_accumulate_is_the_sorted_fp32_sum_bit_for_bit(dtype, width):
    g = _gen(3)
    x = _rand(g, 12, *width, dtype=dtype)
    idx = torch.randint(-12, 12, (300,), generator=g)   # ~25 writers per row, negatives included
    v = _rand(g, 300, *width, dtype=dtype) * 10
    runs = [_ours("triton", x, (idx,), v, True) for _ in range(2)] + [_ours("torch", x, (idx,), v, True)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    # the contract, spelled out: one fp32 sum per row, left to right over increasing k, rounded once
    want = x.clone()
    for r in range(12):
        acc = torch.zeros(width, dtype=torch.float32)
        for k in range(300):
            if int(idx[k]) % 12 == r:
                acc = acc + v[k].float()
        want[r] = (x[r].float() + acc).to(dtype)
    assert torch.equal(runs[0], want)
    if dtype == torch.float32:
        _close(runs[0], _torch(x, (idx,), v, True), dtype)


def test_bf16_sum_rounds_to_nearest_even():
    # 1 + 2^-8 and (1 + 2^-7) + 2^-8 are ties in bf16: round to even gives 1 and 1 + 2^-6
    x = torch.tensor([1.0, 1.0078125, 1.0, -3.0], dtype=torch.bfloat16)
    v = torch.tensor([2.0**-8, 2.0**-8, 2.0**-9, float("nan")], dtype=torch.bfloat16)
    idx = torch.arange(4)
    got = _ours("triton", x, (idx,), v, True)
    assert torch.equal(got[:3], torch.tensor([1.0, 1.015625, 1.0], dtype=torch.bfloat16))
    assert torch.isnan(got[3])
    assert torch.equal(got[:3], _ours("torch", x, (idx,), v, True)[:3])


@pytest.mark.parametrize("name", BACKENDS)
def test_overwrite_last_writer_wins(name):
    g = _gen(4)
    x = _rand(g, 10, 3)
    idx = torch.tensor([4, 1, -6, 9, 1, 4, 4, 0])   # 4 (and -6) written four times, 1 twice
    v = _rand(g, 8, 3)
    want = x.clone()
    for k, i in enumerate(idx.tolist()):
        want[i] = v[k]
    assert torch.equal(_ours(name, x, (idx,), v), want)
    assert torch.equal(_ours(name, x, (idx,), v), _ours(name, x, (idx,), v))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_atomic_accumulate_with_duplicates(dtype):
    g = _gen(5)
    x = _rand(g, 20, 4, dtype=dtype)
    idx = torch.randint(0, 20, (200,), generator=g)
    v = _rand(g, 200, 4, dtype=dtype)
    got = _ours("triton", x, (idx,), v, True, deterministic=False)
    _close(got, _ours("torch", x, (idx,), v, True, deterministic=False), dtype)
    _close(got, _torch(x, (idx,), v, True), dtype)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(got[untouched], x[untouched])   # the fp32 workspace round trip is exact


# ---------------------------------------------------------------------------------------------------
# index patterns, wrapping, errors
# ---------------------------------------------------------------------------------------------------
PATTERNS = {
    "2d-mask": lambda g: (torch.rand(4, 5, generator=g) > 0.5,),
    "mask-after-none": lambda g: (None, torch.rand(5, generator=g) > 0.3),
    "none-then-two": lambda g: (None, torch.tensor([0, 4, -1]), torch.tensor([[1], [2]])),
    "separated": lambda g: (torch.tensor([3, 0]), None, torch.tensor([-2, 1])),
    "int32-pair": lambda g: (torch.tensor([1, 2, 1], dtype=torch.int32), torch.tensor([0, 4, 0], dtype=torch.int32)),
}


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_index_patterns_match_torch(pattern, accumulate):
    g = _gen(6)
    x = _rand(g, 4, 5, 6)
    indices = PATTERNS[pattern](g)
    v = _rand(g, *x[tuple(slice(None) if i is None else i for i in indices)].shape)
    want = _torch(x, indices, v, accumulate)
    for name in BACKENDS:
        got = _ours(name, x, indices, v, accumulate)
        if not accumulate and pattern == "int32-pair":   # (1, 0) written twice: ours is the last writer
            want = x.clone()
            want[1, 0], want[2, 4] = v[2], v[1]
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", BACKENDS)
def test_out_of_range_raises_and_never_drops(name):
    x = torch.zeros(16, 4)
    for idx, bad in ((torch.tensor([0, 17, 3]), 17), (torch.tensor([-17, 2]), -17), (torch.tensor([16]), 16)):
        with pytest.raises(IndexError, match=f"^index {bad} is out of bounds for dimension 0 with size 16$"):
            _ours(name, x, (idx,), torch.ones(4), True)
    with pytest.raises(IndexError, match="^index 4 is out of bounds for dimension 1 with size 4$"):
        _ours(name, x, (torch.tensor([1]), torch.tensor([4])), torch.tensor(1.0))
    with pytest.raises(IndexError, match="^index 0 is out of bounds for dimension 0 with size 0$"):
        _ours(name, torch.zeros(0, 3), (torch.tensor([0]),), torch.ones(3))


def test_negative_indices_wrap():
    x = torch.zeros(6)
    for name in BACKENDS:
        got = _ours(name, x, (torch.tensor([-1, -6, 2]),), torch.tensor([1.0, 2.0, 3.0]), True)
        assert got.tolist() == [2.0, 0.0, 3.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("call, err, msg", [
    (lambda x: index_put(x, (torch.tensor([0]),), torch.ones(3, dtype=torch.float64)), TypeError,
     r"values are torch.float64 but self is torch.float32; cast with values.to\(self.dtype\)"),
    (lambda x: index_put(x, (torch.tensor([0, 1]),), torch.ones(2)), RuntimeError,
     r"shape mismatch: value tensor of shape \[2\] cannot be broadcast to indexing result of shape \[2, 3\]"),
    (lambda x: index_put(x, (torch.tensor([True, False]),), 1.0), IndexError, r"The shape of the mask \[2\]"),
    (lambda x: index_put(x, (torch.tensor([0.0]),), 1.0), IndexError, "must be long, int, byte or bool"),
    (lambda x: index_put(x, (None, None, torch.tensor([0])), 1.0), IndexError, "too many indices"),
    (lambda x: index_put(x, (None,), 1.0), IndexError, "needs at least one index tensor"),
    (lambda x: index_put(x, (torch.tensor([0, 1]), torch.tensor([0, 1, 2])), 1.0), IndexError,
     r"could not be broadcast together with shapes \[2\], \[3\]"),
    (lambda x: torch.ops.workbench.index_put(x, [torch.tensor([True] * 4)], torch.tensor(1.0)), IndexError,
     "takes int64/int32 index tensors"),
])
def test_errors_are_one_line(call, err, msg):
    with pytest.raises(err, match=msg) as info:
        call(torch.zeros(4, 3))
    assert "\n" not in str(info.value)


def test_input_is_not_modified_and_output_is_new():
    x = torch.arange(6.0)
    for name in BACKENDS:
        out = _ours(name, x, (torch.tensor([1]),), torch.tensor(9.0), True)
        assert x.tolist() == [0, 1, 2, 3, 4, 5] and out.data_ptr() != x.data_ptr()


# ---------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------
GRAD_CASES = {   # (self shape, indices, values shape): no duplicate writers (torch's overwrite races on them)
    "rows": ((10, 4), (torch.tensor([7, -1, 2]),), (3, 4)),
    "broadcast-row": ((10, 4), (torch.tensor([7, 0, 3]),), (4,)),
    "broadcast-scalar": ((10, 4), (torch.tensor([5, 1]),), ()),
    "middle-dim": ((3, 8, 2), (None, torch.tensor([6, 1, -3])), (3, 1, 2)),
    "separated": ((4, 3, 5), (torch.tensor([0, 3]), None, torch.tensor([4, 1])), (2, 3)),
}


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_match_torch_autograd(case, accumulate):
    shape, indices, vshape = GRAD_CASES[case]
    g = _gen(7)
    x, v = _rand(g, *shape), _rand(g, *vshape)
    up = _rand(g, *shape)
    xs, vs = x.clone().requires_grad_(), v.clone().requires_grad_()
    want = torch.autograd.grad(_torch(xs, indices, vs, accumulate), (xs, vs), up)
    for name in BACKENDS:
        xs, vs = x.clone().requires_grad_(), v.clone().requires_grad_()
        with backend.use(name):
            got = torch.autograd.grad(index_put(xs, indices, vs, accumulate), (xs, vs), up)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
            assert a.shape == b.shape


@pytest.mark.parametrize("name", BACKENDS)
def test_overwrite_gradient_goes_to_the_winner_only(name):
    x = torch.zeros(5, 2, requires_grad=True)
    v = torch.zeros(4, 2, requires_grad=True)
    up = torch.arange(10.0).view(5, 2)
    with backend.use(name):
        gx, gv = torch.autograd.grad(index_put(x, (torch.tensor([3, 1, -2, 1]),), v), (x, v), up)
    assert gv.tolist() == [[0, 0], [0, 0], [6, 7], [2, 3]]   # k=0 (row 3) and k=1 (row 1) lost
    assert gx.tolist() == [[0, 1], [0, 0], [4, 5], [0, 0], [8, 9]]


def test_backward_op_raises_on_out_of_range():
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0 with size 5"):
        torch.ops.workbench.index_put_backward(torch.zeros(5, 2), [torch.tensor([5])], [1, 2], True)


# ---------------------------------------------------------------------------------------------------
# fake tensors, torch.compile, opcheck
# ---------------------------------------------------------------------------------------------------
def test_fake_tensor_mode_gives_shapes_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1000, 64, dtype=torch.bfloat16)
        idx = torch.empty(5000, dtype=torch.int64)    # values never read: no bounds check can run
        out = index_put(x, (idx,), torch.empty(5000, 64, dtype=torch.bfloat16), True)
        gv = torch.ops.workbench.index_put_backward(x, [idx], [5000, 64], False)
        mid = torch.ops.workbench.index_put(torch.empty(3, 7, 2), [None, idx], torch.empty(()), False, True)
    assert out.shape == (1000, 64) and out.dtype == torch.bfloat16
    assert gv.shape == (5000, 64) and mid.shape == (3, 7, 2)


def test_torch_compile_fullgraph():
    def fn(x, idx, v):
        return index_put(x * 2, (idx,), v, True).sum(0)

    x, idx, v = torch.randn(8, 4), torch.tensor([1, 1, -1]), torch.randn(3, 4)
    with backend.use("torch"):
        compiled = torch.compile(fn, fullgraph=True)
        torch.testing.assert_close(compiled(x, idx, v), fn(x, idx, v))


def test_opcheck():
    x, idx, v = torch.randn(6, 3), torch.tensor([4, 0, 4]), torch.randn(3, 3)
    with backend.use("torch"):
        torch.library.opcheck(torch.ops.workbench.index_put.default, (x.requires_grad_(), [idx], v, True, True))
        torch.library.opcheck(torch.ops.workbench.index_put_backward.default, (torch.randn(6, 3), [idx], [3], False))


# ---------------------------------------------------------------------------------------------------
# Embedding
# ---------------------------------------------------------------------------------------------------
def _embedding_grads(module_cls, tokens, name, padding_idx=None, dtype=torch.float32):
    torch.manual_seed(0)
    emb = module_cls(50, 16, padding_idx=padding_idx).to(dtype)
    up = torch.randn(*tokens.shape, 16, generator=_gen(8)).to(dtype)
    with backend.use(name):
        (grad,) = torch.autograd.grad(emb(tokens), emb.weight, up)
    return emb, grad


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
@pytest.mark.parametrize("name", BACKENDS)
def test_embedding_gradient_matches_nn_embedding(name, padding_idx):
    tokens = torch.randint(0, 50, (4, 64), generator=_gen(9))
    tokens[0, :10] = 3   # a frequent token
    tokens[1, :5] = 49
    ours, g = _embedding_grads(Embedding, tokens, name, padding_idx)
    theirs, want = _embedding_grads(nn.Embedding, tokens, name, padding_idx)
    torch.testing.assert_close(ours(tokens), theirs(tokens))
    torch.testing.assert_close(g, want)


def test_embedding_gradient_is_bitwise_reproducible_under_triton():
    tokens = torch.randint(0, 20, (8, 128), generator=_gen(10))   # ~50 repeats of every token
    for dtype in (torch.float32, torch.bfloat16):
        grads = [_embedding_grads(Embedding, tokens, "triton", dtype=dtype)[1] for _ in range(2)]
        assert torch.equal(grads[0], grads[1])
        # one fp32 sum per row, rounded once: within half an ulp of dtype of the exact sum
        up = torch.randn(*tokens.shape, 16, generator=_gen(8)).to(dtype)
        exact = torch.zeros(50, 16, dtype=torch.float64).index_add_(0, tokens.flatten(), up.double().view(-1, 16))
        torch.testing.assert_close(grads[0].double(), exact, atol=1e-5, rtol=4e-3 if dtype == torch.bfloat16 else 1e-6)


def test_embedding_is_a_drop_in():
    ref = nn.Embedding(30, 8, padding_idx=0)
    emb = Embedding(30, 8, padding_idx=0)
    assert isinstance(emb, nn.Embedding) and emb.state_dict().keys() == ref.state_dict().keys()
    emb.load_state_dict(ref.state_dict())
    tokens = torch.tensor([[0, 5, 29]])
    assert torch.equal(emb(tokens), ref(tokens))
    with torch.device("meta"):
        meta = Embedding(30, 8)
    y = meta(torch.zeros(2, 3, dtype=torch.long, device="meta"))
    y.sum().backward()
    assert y.shape == (2, 3, 8) and meta.weight.grad.shape == (30, 8)
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert meta.weight.device.type == "cpu" and torch.isfinite(meta.weight).all()
    # the options our backward leaves to torch still work
    sparse = Embedding(30, 8, sparse=True)
    sparse(tokens).sum().backward()
    assert sparse.weight.grad.is_sparse


def test_embedding_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        emb = Embedding(100, 8)
        tokens = torch.zeros(4, 6, dtype=torch.long)
        with backend.use("triton"):
            emb(tokens).sum().backward()
    assert emb.weight.grad.shape == (100, 8)


def test_embedding_takes_rowwise_parallel(one_rank_mesh):
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(Embedding(40, 8))
    ref = nn.Sequential(nn.Embedding(40, 8))
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, one_rank_mesh, {"0": RowwiseParallel()})
    tokens = torch.randint(0, 40, (2, 16), generator=_gen(11))
    ref(tokens).sum().backward()
    # torch's own rules: a DTensor weight takes torch's embedding; ours: our index_put, shard-locally
    from workbench.spmd import our_rules

    for rules in (contextlib.nullcontext, our_rules):
        model[0].weight.grad = None
        with backend.use("triton"), rules():
            model(tokens).sum().backward()
        torch.testing.assert_close(model[0].weight.grad.full_tensor(), ref[0].weight.grad)


def test_functional_embedding_matches_f_embedding():
    w = torch.randn(10, 4, requires_grad=True)
    tokens = torch.tensor([1, 1, 9, 0])
    with backend.use("triton"):
        (g,) = torch.autograd.grad(embedding(tokens, w, padding_idx=-1).sum(), w)
    (want,) = torch.autograd.grad(torch.nn.functional.embedding(tokens, w, padding_idx=9).sum(), w)
    assert torch.equal(g, want)
