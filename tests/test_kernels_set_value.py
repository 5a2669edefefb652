"""set_value and set_value_ (workbench.kernels.set_value): slice and strided assignment, the Triton kernel
(through Triton's interpreter on CPU) against the reference path and torch's setitem, with gradients, fake
tensors and torch.compile; the >2^31-element case on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import workbench.kernels  # noqa: F401  (before Triton loads: interpreter mode without CUDA)
from workbench.kernels import backend
from workbench.kernels.cases import CASES, as_tuple
from workbench.kernels.set_value import set_value, set_value_

BACKENDS = ("triton", "torch")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ops = torch.ops.workbench
S = slice


def _rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


KEYS = [  # (self's shape, key)
    ((40, 24), (S(3, 30),)),                          # whole rows: one contiguous run
    ((40, 24), (S(None), S(5, 20))),                  # part of every row
    ((40, 24), (S(1, None, 3), S(None, None, 2))),    # strided rows and columns
    ((40, 24), (S(-9, -1, 2), S(-30, None))),         # negative bounds (and one before the start)
    ((40, 24), (S(2, None, 100),)),                   # a step past the end: one row
    ((40, 24), (S(5, 5),)),                           # empty region
    ((40, 24), (S(30, 10),)),                         # end before start: empty
    ((1000,), (S(17, 901, 7),)),
    ((6, 7, 8), (S(1, 5), S(None, None, 3))),         # fewer slices than dims
    ((0, 24), (S(None), S(2, 9, 3))),                 # zero-element self
    ((3, 4, 5, 6, 7, 8), (S(None, None, 2), S(1, None, 2), S(None, None, 2), S(1, None, 2),
                          S(None, None, 2), S(1, None, 3))),  # 6 dims that do not merge: host loop
]


def _value(kind, region, dtype):
    return {"region": lambda: _rand(region, dtype, 1),
            "row": lambda: _rand((1, *region[1:]), dtype, 1) if len(region) > 1 else _rand((1,), dtype, 1),
            "last dim": lambda: _rand(region[-1:], dtype, 1),
            "scalar": lambda: torch.tensor(-3.25, dtype=dtype),
            "leading ones": lambda: _rand((1, 1, *region), dtype, 1)}[kind]()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,key", KEYS, ids=str)
def test_set_value_matches_torch(dtype, shape, key):
    x = _rand(shape, dtype)
    region = x[key].shape
    for kind in ("region", "row", "last dim", "scalar", "leading ones"):
        value = _value(kind, region, dtype)
        want = x.clone()
        want[key] = value
        for b in BACKENDS:
            with backend.use(b):
                y = set_value(x, key, value)
                z = x.clone()
                assert set_value_(z, key, value) is z
            assert torch.equal(y, want) and y.is_contiguous(), (b, kind)
            assert torch.equal(z, want), (b, kind)


def test_python_scalar_and_value_of_another_dtype():
    x = _rand((40, 24), torch.bfloat16)
    v = _rand((10, 24), torch.float32)  # rounded to bf16 like torch's setitem rounds it
    want = x.clone()
    want[10:20] = v
    want_s = x.clone()
    want_s[::3, 1::2] = 0.1
    for b in BACKENDS:
        with backend.use(b):
            assert torch.equal(set_value(x, S(10, 20), v), want)
            assert torch.equal(set_value(x, (S(None, None, 3), S(1, None, 2)), 0.1), want_s)


def test_non_contiguous_self_in_place_writes_through_the_view():
    for b in BACKENDS:
        base = _rand((24, 40))
        x = base.t()  # (40, 24) column-major view of base
        want = base.clone().t()
        v = _rand((9, 5), seed=4)
        want[S(3, 30, 3), S(2, 20, 4)] = v
        with backend.use(b):
            y = set_value(x, (S(3, 30, 3), S(2, 20, 4)), v)
            set_value_(x, (S(3, 30, 3), S(2, 20, 4)), v)
        assert torch.equal(y, want) and torch.equal(x, want) and torch.equal(base.t(), want), b


def test_in_place_value_that_overlaps_self_is_read_first():
    for b in BACKENDS:
        x = torch.arange(20.0)
        with backend.use(b):
            set_value_(x, S(1, None), x[:-1])
        assert torch.equal(x, torch.cat([torch.zeros(1), torch.arange(19.0)])), b


def test_region_dims_merge_what_is_linear():
    from workbench.kernels.triton_set_value import region_dims

    x = torch.empty(40, 24)
    whole_rows = [(3, 27, 1), (0, 24, 1)]
    assert region_dims(x, torch.empty(27, 24), whole_rows) == (72, [(27 * 24, 1, 1)])
    assert region_dims(x, torch.empty(24), whole_rows) == (72, [(27, 24, 0), (24, 1, 1)])
    part_rows = [(0, 40, 1), (5, 15, 1)]
    assert region_dims(x, torch.empty(40, 15), part_rows) == (5, [(40, 24, 15), (15, 1, 1)])
    assert region_dims(x, torch.empty(()), [(2, 1, 100), (0, 24, 2)]) == (48, [(24, 2, 0)])
    # offsets are python ints: a region past 2^31 elements keeps them exact
    big = torch.empty((3 << 30, 2), device="meta")
    base, dims = region_dims(big, torch.empty(()), [((3 << 30) - 5, 5, 1), (1, 1, 1)])
    assert base == ((3 << 30) - 5) * 2 + 1 and dims == [(5, 2, 0)]


def test_gradients_match_torch_autograd():
    for dtype in DTYPES:
        for key in [(S(3, 30),), (S(1, None, 3), S(None, None, 2)), (S(5, 5),)]:
            for kind in ("region", "row", "scalar"):
                x = _rand((40, 24), dtype).requires_grad_()
                value = _value(kind, x[key].shape, dtype).requires_grad_()
                ref = x.clone()
                ref[key] = value
                g = _rand(ref.shape, dtype, 7)
                want = torch.autograd.grad(ref, (x, value), g)
                for b in BACKENDS:
                    with backend.use(b):
                        got = torch.autograd.grad(set_value(x, key, value), (x, value), g)
                    assert torch.equal(got[0], want[0]), (b, dtype, key, kind)
                    assert got[1].shape == value.shape
                    torch.testing.assert_close(got[1].float(), want[1].float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("b", BACKENDS)
def test_errors_are_one_line(b):
    x = _rand((10, 6))
    with backend.use(b):
        with pytest.raises(ValueError, match="slice step must be positive, got -1 for dim 0; flip the tensor"):
            set_value(x, S(None, None, -1), 0.0)
        with pytest.raises(ValueError, match="slice step must be positive, got 0 for dim 1"):
            set_value(x, (S(None), S(0, 4, 0)), 0.0)
        with pytest.raises(ValueError, match="slice step must be positive"):
            ops.set_value(x, torch.tensor(0.0), [0], [4], [0])
        with pytest.raises(TypeError, match="set_value takes a slice or a tuple of slices, got int"):
            set_value(x, (3,), 0.0)
        with pytest.raises(IndexError, match="too many indices for tensor of dimension 2"):
            set_value(x, (S(None),) * 3, 0.0)
        with pytest.raises(ValueError, match=r"value of shape \(4, 6\) does not broadcast to the region's "
                                             r"shape \(5, 6\)"):
            set_value(x, S(0, 5), _rand((4, 6)))
        with pytest.raises(RuntimeError, match="set_value_ is not differentiable and self requires grad; "
                                               "use set_value"):
            set_value_(x.clone().requires_grad_(), S(0, 5), 0.0)
        with pytest.raises(RuntimeError, match="value requires grad"):
            set_value_(x.clone(), S(0, 5), torch.tensor(1.0, requires_grad=True))
        with pytest.raises(ValueError, match="elements share memory"):
            set_value_(torch.zeros(6).expand(4, 6), S(0, 2), 1.0)
    leaf = x.clone().requires_grad_()
    with torch.no_grad(), backend.use(b):  # initialising a parameter in place is allowed
        set_value_(leaf, S(0, 2), 0.0)
    assert torch.equal(leaf[:2], torch.zeros(2, 6))


def test_ops_under_fake_tensor_mode():
    with FakeTensorMode():
        x = torch.randn(40, 24)
        assert set_value(x, (S(1, None, 3), S(2, 9)), torch.randn(13, 7)).shape == (40, 24)
        assert set_value_(x, S(0, 4), torch.randn(24)) is x
        with pytest.raises(ValueError, match="does not broadcast"):
            set_value(x, S(0, 4), torch.randn(5, 24))


def test_torch_compile_fullgraph():
    def f(x, v):
        y = set_value(x, (S(1, 7, 2), S(None, None, 2)), v)
        return y * 2

    def g(x):
        set_value_(x, S(0, 2), 7.0)
        return x + 1

    x = _rand((8, 6)).requires_grad_()
    v = _rand((3, 3), seed=3).requires_grad_()
    with backend.use("torch"):
        got, want = torch.compile(f, fullgraph=True)(x, v), f(x, v)
        assert torch.equal(got, want)
        gg, gw = torch.autograd.grad(got.sum(), (x, v)), torch.autograd.grad(want.sum(), (x, v))
        assert all(torch.equal(a, b) for a, b in zip(gg, gw))
        a, b = x.detach().clone(), x.detach().clone()
        assert torch.equal(torch.compile(g, fullgraph=True)(a), g(b)) and torch.equal(a, b)


@pytest.mark.parametrize("name", ["set_value/slice", "set_value/strided", "set_value/inplace"])
def test_registered_cases_check(name):
    case = CASES[name]
    dev = torch.device("cpu")
    for dtype in case.dtypes:
        items = [(f"size {n}", case.make(n, dtype, dev, torch.Generator().manual_seed(n))) for n in case.check_sizes]
        items += list(case.edge_cases(dtype, dev, torch.Generator().manual_seed(0)))
        for label, inp in items:
            x0 = inp["x"].clone()
            with backend.use("triton"):
                ours = as_tuple(case.run({**inp, "x": x0.clone()}))
            with backend.use("torch"):
                ref = as_tuple(case.run({**inp, "x": x0.clone()}))
            eager = as_tuple(case.torch_eager({**inp, "x": x0.clone()}))
            assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(ours, ref, eager)), label
            assert case.bytes_moved(inp) > 0 or inp["x"][inp["key"]].numel() == 0, label


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the >2^31-element case needs a GPU")
def test_over_2_31_elements_on_cuda():
    n = (1 << 31) + 4099
    with backend.use("triton"):
        x = torch.zeros(n, dtype=torch.int8, device="cuda")
        set_value_(x, S((1 << 31) - 6, None, 3), 5)  # a region on both sides of element 2^31
        hit = torch.arange((1 << 31) - 6, n, 3, device="cuda")
        assert int(x.sum()) == 5 * hit.numel() and int(x[hit].min()) == 5
        del x, hit
        rows, cols = (1 << 16) + 3, 1 << 15  # 2^31 + 98304 elements, rows of 2^15
        x = torch.zeros(rows, cols, dtype=torch.int8, device="cuda")
        v = torch.arange(cols // 2, device="cuda").remainder(7).to(torch.int8) + 1
        set_value_(x, (S(rows - 3, None), S(1, None, 2)), v)
        assert torch.equal(x[-3:, 1::2], v.expand(3, -1)) and int(x[:-3].abs().sum()) == 0
        assert int(x[-3:, ::2].abs().sum()) == 0
        y = set_value(x, (S(rows - 2, None), S(None, None, 2)), 9)
        assert int(y[-2:, ::2].min()) == 9 and torch.equal(y[-3:, 1::2], x[-3:, 1::2])
