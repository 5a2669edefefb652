"""masked_fill, mask_select and mask_assign (workbench.kernels.masked): the Triton kernels (through Triton's
interpreter on CPU) against the reference path and torch's own ops, with gradients, fake tensors and
torch.compile."""

from __future__ import annotations

import pytest
import torch

from workbench.kernels.check import check
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import workbench.kernels  # noqa: F401  (before Triton loads: interpreter mode without CUDA)
from workbench.kernels import backend
from workbench.kernels.cases import CASES
from workbench.kernels.masked import mask_assign, mask_select, masked_fill

BACKENDS = ("triton", "torch")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ops = torch.ops.workbench


def _rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _mask(shape, p=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < p


def _grads(y, inputs, seed=2):
    g = _rand(y.shape, y.dtype, seed)
    return y, *torch.autograd.grad(y, inputs, g)


def _sum_close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol * (1 + b.float().abs().item()), rtol=tol)


# ---------------------------------------------------------------------------------------------------
# masked_fill
# ---------------------------------------------------------------------------------------------------
FILL_SHAPES = [  # (self, mask, self made non-contiguous)
    ((1000,), (1000,), False),
    ((37, 29), (37, 29), True),
    ((37, 29), (37, 1), False),       # broadcast over columns
    ((37, 29), (29,), True),          # broadcast over rows
    ((4, 5, 6), (4, 1, 6), False),    # a middle dim broadcast: read through strides
    ((3, 4, 5, 6, 7), (3, 1, 5, 1, 7), False),  # more unmerged mask dims than the kernel indexes
    ((6, 7), (), False),              # 0-dim mask
    ((0,), (0,), False),              # empty
    ((3, 0), (3, 1), False),          # zero elements
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,mask_shape,strided", FILL_SHAPES, ids=str)
def test_masked_fill_matches_torch(dtype, shape, mask_shape, strided):
    base = _rand(shape[::-1] if strided else shape, dtype)
    x = (base.t() if strided and len(shape) == 2 else base).detach().requires_grad_()
    mask = _mask(mask_shape)
    value = torch.tensor(0.75, dtype=dtype, requires_grad=True)
    want = _grads(x.masked_fill(mask, value), (x, value))
    for b in BACKENDS:
        with backend.use(b):
            got = _grads(masked_fill(x, mask, value), (x, value))
        assert got[0].is_contiguous()
        assert torch.equal(got[0], want[0]), b
        assert torch.equal(got[1], want[1]), b
        _sum_close(got[2], want[2], dtype)


def test_masked_fill_all_true_all_false_and_python_value():
    x = _rand((300,))
    for b in BACKENDS:
        with backend.use(b):
            assert torch.equal(masked_fill(x, torch.ones(300, dtype=torch.bool), -1.0), torch.full((300,), -1.0))
            assert torch.equal(masked_fill(x, torch.zeros(300, dtype=torch.bool), -1.0), x)
            xi = torch.arange(50, dtype=torch.int32)
            assert torch.equal(masked_fill(xi, xi % 3 == 0, 7), xi.masked_fill(xi % 3 == 0, 7))


def test_masked_fill_value_in_another_dtype_gets_its_gradient():
    x = _rand((64, 8), torch.bfloat16).requires_grad_()
    mask = _mask((64, 8))
    value = torch.tensor(0.1, dtype=torch.float32, requires_grad=True)
    for b in BACKENDS:
        with backend.use(b):
            y, gx, gv = _grads(masked_fill(x, mask, value), (x, value))
        assert y.dtype == torch.bfloat16 and gv.dtype == torch.float32
        assert torch.equal(y, x.masked_fill(mask, value.to(torch.bfloat16)))


def test_masked_fill_backward_is_deterministic_and_fp32_accumulated():
    g = _rand((20000,), torch.float16, seed=5) * 100  # a sum that overflows fp16 if accumulated in it
    mask = _mask((20000,), p=0.9)
    exact = g.double()[mask].sum()
    with backend.use("triton"):
        a = ops.masked_fill_backward(g, mask)
        b = ops.masked_fill_backward(g, mask)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # bit for bit
    assert torch.equal(a[0], g.masked_fill(mask, 0))
    assert abs(a[1].double() - exact) <= 1e-3 * abs(exact) + 1  # fp16 rounding of the result only
    with backend.use("torch"):
        _sum_close(ops.masked_fill_backward(g, mask)[1], a[1], torch.float16)


@pytest.mark.parametrize("b", BACKENDS)
def test_masked_fill_errors_are_one_line(b):
    x = _rand((4, 5))
    with backend.use(b):
        with pytest.raises(TypeError, match=r"mask must be a bool tensor, got torch.int64; pass mask.bool\(\)"):
            masked_fill(x, torch.ones(4, 5, dtype=torch.long), 1.0)
        with pytest.raises(ValueError, match=r"mask of shape \(4, 4\) does not broadcast to self's shape \(4, 5\)"):
            masked_fill(x, _mask((4, 4)), 1.0)
        with pytest.raises(ValueError, match=r"0-dim value, got shape \(5,\); use torch.where"):
            masked_fill(x, _mask((4, 5)), torch.ones(5))


# ---------------------------------------------------------------------------------------------------
# mask_select: x[mask]
# ---------------------------------------------------------------------------------------------------
SELECT_SHAPES = [  # (self, mask over its leading dims, p)
    ((1000,), (1000,), 0.5),
    ((9000,), (9000,), 0.3),          # one element per row, several row blocks
    ((200, 7), (200,), 0.5),
    ((30, 600), (30,), 0.5),          # rows wider than one column block
    ((6, 5, 7), (6, 5), 0.5),
    ((3, 4), (), 1.0),                # 0-dim mask: x[True] adds a dim
    ((50, 8), (50,), 1.1),            # all true
    ((50, 8), (50,), -0.1),           # all false
    ((0, 8), (0,), 0.5),              # empty
    ((9, 0), (9,), 0.5),              # zero-width rows
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,mask_shape,p", SELECT_SHAPES, ids=str)
def test_mask_select_matches_torch(dtype, shape, mask_shape, p):
    x = _rand(shape, dtype).requires_grad_()
    mask = _mask(mask_shape, p)
    want = _grads(x[mask], (x,))
    for b in BACKENDS:
        with backend.use(b):
            got = _grads(mask_select(x, mask), (x,))
        assert got[0].shape == want[0].shape and torch.equal(got[0], want[0]), b
        assert torch.equal(got[1], want[1]), b


def test_mask_select_non_contiguous_self_and_mask():
    x = _rand((40, 70)).t()  # (70, 40), column-major
    mask = _mask((140,))[::2]  # a strided mask
    for b in BACKENDS:
        with backend.use(b):
            assert torch.equal(mask_select(x, mask), x[mask])


@pytest.mark.parametrize("b", BACKENDS)
def test_mask_select_errors_are_like_torch(b):
    x = _rand((4, 5))
    with backend.use(b):
        with pytest.raises(IndexError, match=r"The shape of the mask \[3\] at index 0 does not match the shape "
                                             r"of the indexed tensor \[4, 5\] at index 0"):
            mask_select(x, _mask((3,)))
        with pytest.raises(IndexError, match="too many indices for tensor of dimension 2"):
            mask_select(x, _mask((4, 5, 1)))
        with pytest.raises(TypeError, match="mask must be a bool tensor"):
            mask_select(x, torch.ones(4, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------
# mask_assign: y = x.clone(); y[mask] = value
# ---------------------------------------------------------------------------------------------------
def _value(kind, mask, tail, dtype):
    n = int(mask.sum())
    return {"scalar": lambda: torch.tensor(-2.5, dtype=dtype),
            "rows": lambda: _rand((n, *tail), dtype, 3),
            "one row": lambda: _rand(tail, dtype, 3),
            "leading ones": lambda: _rand((1, 1, *tail), dtype, 3),
            "tail broadcast": lambda: _rand((n, *([1] * len(tail))), dtype, 3)}[kind]().requires_grad_()


ASSIGN = [  # (self, mask, p)
    ((1000,), (1000,), 0.5),
    ((120, 9), (120,), 0.5),
    ((20, 300), (20,), 0.5),
    ((6, 5, 7), (6, 5), 0.5),
    ((50, 8), (50,), 1.1),
    ((50, 8), (50,), -0.1),
    ((0, 8), (0,), 0.5),
]


@pytest.mark.parametrize("kind", ["scalar", "rows", "one row", "leading ones", "tail broadcast"])
@pytest.mark.parametrize("shape,mask_shape,p", ASSIGN, ids=str)
def test_mask_assign_matches_torch(kind, shape, mask_shape, p):
    for dtype in DTYPES:
        x = _rand(shape, dtype).requires_grad_()
        mask = _mask(mask_shape, p)
        value = _value(kind, mask, shape[len(mask_shape):], dtype)
        ref = x.clone()
        ref[mask] = value
        want = _grads(ref, (x, value))
        for b in BACKENDS:
            with backend.use(b):
                got = _grads(mask_assign(x, mask, value), (x, value))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (b, dtype)
            assert got[2].shape == value.shape
            if kind == "rows":
                assert torch.equal(got[2], want[2]), (b, dtype)
            else:
                torch.testing.assert_close(got[2].float(), want[2].float(), atol=0.05, rtol=0.02)


def test_mask_assign_python_scalar_and_non_contiguous_self():
    x = _rand((30, 40)).t()
    mask = _mask((40,))
    want = x.clone()
    want[mask] = 3.0
    rows = _rand((int(mask.sum()), 30), seed=9)
    want_rows = x.clone()
    want_rows[mask] = rows
    for b in BACKENDS:
        with backend.use(b):
            assert torch.equal(mask_assign(x, mask, 3.0), want)
            assert torch.equal(mask_assign(x, mask, rows), want_rows)
            assert torch.equal(mask_assign(x, mask, rows.double()), want_rows)  # cast like setitem


@pytest.mark.parametrize("b", BACKENDS)
def test_mask_assign_wrong_value_shape_names_both_shapes(b):
    x = _rand((10, 4))
    mask = torch.tensor([True, False] * 5)
    with backend.use(b):
        with pytest.raises(ValueError, match=r"value of shape \(3, 4\) does not broadcast to the masked rows' "
                                             r"shape \(5, 4\)"):
            mask_assign(x, mask, _rand((3, 4)))
        with pytest.raises(ValueError, match=r"value of shape \(5, 3\) does not broadcast"):
            mask_assign(x, mask, _rand((5, 3)))


# ---------------------------------------------------------------------------------------------------
# fake tensors, torch.compile, the registered kernel cases
# ---------------------------------------------------------------------------------------------------
def test_ops_under_fake_tensor_mode():
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.randn(8, 6)
        m, r = torch.rand(8, 6) < 0.5, torch.rand(8) < 0.5
        assert masked_fill(x, m, 1.0).shape == (8, 6)
        g_self, g_value = ops.masked_fill_backward(x, m)
        assert g_self.shape == (8, 6) and g_value.shape == ()
        y = mask_select(x, r)
        assert y.shape[1] == 6 and not isinstance(y.shape[0], int)  # data-dependent: an unbacked size
        assert mask_assign(x, r, torch.randn(3, 6)).shape == (8, 6)
        assert ops.mask_select_backward(torch.randn(3, 6), r).shape == (8, 6)
        with pytest.raises(ValueError, match="does not broadcast"):
            mask_assign(x, r, torch.randn(3, 5))


def test_torch_compile_fullgraph():
    def f(x, m, r, v):
        a = masked_fill(x, m, v)
        b = mask_assign(a, r, 2.0)
        return b, mask_select(b, r).sum()

    x = _rand((8, 6)).requires_grad_()
    v = torch.tensor(1.5, requires_grad=True)
    m, r = _mask((8, 6)), _mask((8,))
    with backend.use("torch"):
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, m, r, v)
        want = f(x, m, r, v)
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
        g = torch.autograd.grad(got[0].sum() + got[1], (x, v))
        w = torch.autograd.grad(want[0].sum() + want[1], (x, v))
        assert all(torch.allclose(a, b) for a, b in zip(g, w))


@pytest.mark.parametrize("name", ["masked_fill/forward-backward", "mask_select/flat", "mask_select/rows",
                                  "mask_assign/scalar", "mask_assign/tensor"])
def test_registered_cases_check(name):
    """The registered case, every dtype, check size and edge case, through the checker the CLI runs."""
    result = check(ops=[name], progress=False)
    assert result.ok, result.failures[["case", "dtype", "label", "note"]].to_string()
    assert len(result.to_frame()) > len(CASES[name].dtypes) and (result.to_frame()["status"] == "pass").all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the >2^31-element case needs a GPU")
def test_over_2_31_elements_on_cuda():
    n = (1 << 31) + 4099
    x = torch.zeros(n, dtype=torch.int8, device="cuda")
    mask = torch.zeros(n, dtype=torch.bool, device="cuda")
    mask[-5:] = True
    mask[7] = True
    with backend.use("triton"):
        y = masked_fill(x, mask, 3)
        assert int(y[-5:].sum()) == 15 and int(y[7]) == 3 and int(y.sum()) == 18
        del y
        s = mask_select(x + 1, mask)
        assert s.shape == (6,) and int(s.sum()) == 6
