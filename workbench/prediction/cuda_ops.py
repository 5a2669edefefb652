"""What a CUDA training step runs, for fake steps on CPU tensors that predict a GPU's memory.

Predicting ``--device cuda`` on a machine without a GPU runs the step on fake CPU tensors (autograd's
engine and FSDP2 need a CUDA build to run on fake CUDA ones). Most operators save and allocate the same
on both devices: their fake kernels are the same meta functions. Where CUDA's implementation differs,
:class:`CudaOps` makes the fake step run what CUDA would, with torch's own meta implementation of the
CUDA operator (FakeTensorMode runs meta functions whatever the tensors' device)::

    operator                       CPU picks                         CUDA picks (sm >= 8.0)
    scaled_dot_product_attention   flash_attention_for_cpu:          flash (fp16/bf16): out, lse (B,H,S) fp32,
                                   out, lse (B,H,S) fp32 saved          rng_state (2,) u64 + () u64 on the GPU
                                                                     efficient (fp32): out, lse (B,H,ceil32(S))
                                                                        fp32, seed + offset () i64 on the GPU
                                                                     cuDNN: out, lse (B,H,S,1) fp32, seed, offset
    AdamW (optim_impl=auto)        the per-parameter loop: two        fused: no temporaries
                                   parameter-sized temporaries
    embedding backward             embedding_dense_backward: one      our Triton index_put: zeros (V, D), then
    (kernels=auto|triton)          (V, D) output                      its (V, D) result (both alive at once)

The backend is chosen as ``sdp_utils.cpp`` chooses it on the target GPU (:func:`attention_backend`):
torch's priority order (``torch._C._get_sdp_priority_order()``, flash, efficient, math, cuDNN by
default), the backends ``torch.backends.cuda`` enables, and each backend's checks on dtype, head dim,
mask, causal shape and compute capability (default 9.0, an H100). Cross-entropy (log_softmax + nll_loss)
and the matmuls are composite or structured operators with the same meta functions on both devices; the
cuBLAS workspaces the GPU adds are counted once (``workbench.prediction.memory.cublas_workspace_bytes``).
docs/cuda_ops.md has the table of every operator the step runs.

Not modelled: allocations a CUDA kernel makes for itself inside one call and frees before returning
(flash backward's fp32 ``dq_accum`` and ``softmax_d``; efficient backward's ``delta`` and workspace),
which no meta function describes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workbench import compat

__all__ = ["CudaTarget", "CudaOps", "attention_backend", "cuda_train_config", "DEFAULT_CAPABILITY"]

DEFAULT_CAPABILITY = (9, 0)  # an H100 (and H200): what a prediction targets without a GPU to ask
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaTarget:
    """The GPU a CPU-simulated prediction stands in for: its compute capability and what the job's
    settings pick on it (``kernels``: the job's ``--kernels``)."""

    capability: tuple[int, int] = DEFAULT_CAPABILITY
    kernels: str = "auto"

    @property
    def triton_kernels(self) -> bool:
        """Our kernels run as Triton on this target (``kernels`` auto or triton; a CUDA build has Triton)."""
        return self.kernels in ("auto", "triton")


def cuda_train_config(train):
    """``train`` as a CUDA run resolves it: ``optim_impl="auto"`` is fused AdamW on CUDA
    (``workbench.parallel.apply.optimizer_impl``), not the CPU's per-parameter loop."""
    import dataclasses

    if getattr(train, "optim_impl", None) == "auto":
        return dataclasses.replace(train, optim_impl="fused")
    return train


# --------------------------------------------------------------------------------------------------
# Which attention kernel CUDA runs (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)
# --------------------------------------------------------------------------------------------------


def _priority_order() -> list[str]:
    try:
        order = compat.get("sdp_priority_order")()
    except compat.MissingTorchAPI:
        order = [1, 2, 0, 3]
    return [_BACKEND_NAMES.get(int(b), "?") for b in order]


def _enabled() -> dict[str, bool]:
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()}


def _gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """sdp_utils' minimum_gemm_alignment: the head dim the efficient kernel needs a multiple of."""
    half = dtype in _HALF
    tensor_cores = capability[0] >= 8 or (capability[0] >= 7 and half)
    align = 4 if capability[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def _dense_heads_ok(q, k, v, enable_gqa: bool) -> bool:
    if q.size(0) != k.size(0) or k.size(0) != v.size(0):
        return False
    if enable_gqa:
        return k.size(1) == v.size(1) and q.size(1) % k.size(1) == 0
    return q.size(1) == k.size(1) == v.size(1)


def _flash_ok(q, k, v, mask, dropout_p, is_causal, enable_gqa, cap) -> bool:
    if q.dim() != 4 or mask is not None or not (8, 0) <= cap:
        return False
    if q.dtype not in _HALF or not (q.dtype == k.dtype == v.dtype):
        return False
    d = q.size(-1)
    if not (d == k.size(-1) == v.size(-1)) or d > 256:
        return False
    if is_causal and q.size(-2) != k.size(-2):
        return False                                   # check_flash_causal_non_square_seqlens
    if (8, 6) <= cap <= (8, 9) and d > 192 and q.requires_grad:
        return False                                   # sm86-89 backward limit
    return _dense_heads_ok(q, k, v, enable_gqa) and min(q.size(-2), k.size(-2)) > 0


def _efficient_ok(q, k, v, mask, dropout_p, is_causal, enable_gqa, cap) -> bool:
    if q.dim() != 4 or cap < (5, 0) or enable_gqa and q.size(1) != k.size(1):
        return False
    if q.dtype not in (torch.float32, *_HALF) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.dtype == torch.bfloat16 and cap < (8, 0):
        return False
    a = _gemm_alignment(q.dtype, cap)
    if q.size(-1) != k.size(-1) or q.size(-1) % a or v.size(-1) % a:
        return False
    return _dense_heads_ok(q, k, v, False) and min(q.size(-2), k.size(-2)) > 0


def _cudnn_ok(q, k, v, mask, dropout_p, is_causal, enable_gqa, cap) -> bool:
    if q.dim() != 4 or cap < (8, 0) or q.dtype not in _HALF or not (q.dtype == k.dtype == v.dtype):
        return False
    d = q.size(-1)
    if d % 8 or d > 128 or v.size(-1) != d or k.size(-1) != d:
        return False
    return _dense_heads_ok(q, k, v, False)


_CHECKS = {"flash": _flash_ok, "efficient": _efficient_ok, "cudnn": _cudnn_ok}


def attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False, *,
                      capability: tuple[int, int] = DEFAULT_CAPABILITY) -> str:
    """``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``: what ``F.scaled_dot_product_attention``
    runs for these inputs on a GPU of ``capability``: the first backend in torch's priority order that is
    enabled and whose checks pass (sdp_utils.cpp's ``select_sdp_backend``)."""
    enabled = _enabled()
    for name in _priority_order():
        if not enabled.get(name, False):
            continue
        if name == "math":
            return "math"
        check = _CHECKS.get(name)
        if check is not None and check(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, capability):
            return name
    return "math"


# --------------------------------------------------------------------------------------------------
# The fused attention kernels, forward and backward, with CUDA's saved tensors
# --------------------------------------------------------------------------------------------------


class _FusedAttention(torch.autograd.Function):
    """One of CUDA's fused attention operators, its saved tensors as its derivative formula saves them
    (``tools/autograd/derivatives.yaml``), forward and backward run by their meta functions."""

    @staticmethod
    def forward(ctx, backend: str, q, k, v, mask, dropout_p: float, is_causal: bool, scale):
        aten = torch.ops.aten
        ctx.backend, ctx.dropout_p, ctx.is_causal, ctx.scale = backend, dropout_p, is_causal, scale
        ctx.has_mask = mask is not None
        if backend == "flash":
            out, lse, _cq, _ck, mq, mk, seed, offset, _dbg = aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)
            ctx.max_qk = (mq, mk)
            ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        elif backend == "efficient":
            lse_wanted = any(ctx.needs_input_grad[1:4])
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, lse_wanted, dropout_p, is_causal, scale=scale)
            ctx.save_for_backward(q, k, v, out, lse, seed, offset, *(() if mask is None else (mask,)))
        else:  # cudnn
            out, lse, _cq, _ck, mq, mk, seed, offset, _dbg = aten._scaled_dot_product_cudnn_attention(
                q, k, v, mask, True, dropout_p, is_causal, False, scale=scale)
            ctx.max_qk = (mq, mk)
            ctx.save_for_backward(q, k, v, out, lse, seed, offset, *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx, grad):
        aten = torch.ops.aten
        saved = ctx.saved_tensors
        q, k, v, out, lse, seed, offset = saved[:7]
        mask = saved[7] if ctx.has_mask else None
        if ctx.backend == "flash":
            mq, mk = ctx.max_qk
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad, q, k, v, out, lse, None, None, mq, mk, ctx.dropout_p, ctx.is_causal, seed, offset,
                scale=ctx.scale)
        elif ctx.backend == "efficient":
            dq, dk, dv, _db = aten._scaled_dot_product_efficient_attention_backward(
                grad, q, k, v, mask, out, lse, seed, offset, ctx.dropout_p, list(ctx.needs_input_grad[1:4]) + [False],
                ctx.is_causal, scale=ctx.scale)
        else:
            mq, mk = ctx.max_qk
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                grad, q, k, v, out, lse, seed, offset, mask, None, None, mq, mk, ctx.dropout_p, ctx.is_causal,
                scale=ctx.scale)
        return None, dq, dk, dv, None, None, None, None


def _sdpa_args(args, kwargs) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    out = dict(zip(names, args))
    out.update(kwargs or {})
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False, **out}


# --------------------------------------------------------------------------------------------------
# The mode that makes a fake CPU step run CUDA's operators
# --------------------------------------------------------------------------------------------------


class CudaOps:
    """Run the fake step's operators as CUDA runs them, while entered.

    Attention: a kernel for ``aten::scaled_dot_product_attention`` at the AutogradCPU key (a
    ``torch.library`` registration, undone on exit), so that the forward, a checkpoint's recomputation in
    backward and the backward all take CUDA's backend (a TorchFunctionMode would not reach the
    recomputation: autograd's engine runs without the caller's function modes). Embedding backward: a
    dispatch mode on top of the recorder. ``summary()`` says what was substituted (the prediction's
    ``meta["device_model"]``)."""

    def __init__(self, target: CudaTarget | None = None):
        self.target = target or CudaTarget()
        self.attention: Counter = Counter()   # backend -> calls (forward runs, recomputations included)
        self.embedding_backward: Counter = Counter()
        self._lib = None
        self._mode = None

    def __enter__(self) -> "CudaOps":
        self._lib = torch.library.Library("aten", "IMPL")
        self._lib.impl("scaled_dot_product_attention", self._attention, "AutogradCPU")
        if self.target.triton_kernels:
            ops = self
            emb_bwd = torch.ops.aten.embedding_dense_backward.default

            class _Mode(compat.get("TorchDispatchMode")):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    if func is emb_bwd:
                        return ops._embedding_backward(*args, **(kwargs or {}))
                    return func(*args, **(kwargs or {}))

            self._mode = _Mode()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        lib, self._lib = self._lib, None
        try:
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            if lib is not None:
                compat.get("library_destroy")(lib)

    # -- attention -----------------------------------------------------------------------------------
    def _attention(self, *args, **kwargs):
        a = _sdpa_args(args, kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        grad_mask = isinstance(mask, torch.Tensor) and mask.requires_grad
        backend = attention_backend(q, k, v, mask, a["dropout_p"], a["is_causal"], a["enable_gqa"],
                                    capability=self.target.capability)
        if backend != "math" and (grad_mask or backend == "cudnn" and mask is not None):
            # a mask that learns (its gradient is the fused kernels' grad_bias, not modelled here) or a
            # mask for cuDNN (whose bias support varies by release): the composite math path
            backend = "math"
        dropout_p = a["dropout_p"]
        self.attention[backend] += 1
        if backend == "math":  # CUDA's math path is the composite every device shares
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, mask, dropout_p, a["is_causal"], None, scale=a["scale"], enable_gqa=a["enable_gqa"])[0]
        d = q.size(-1)
        if backend == "flash" and d % 8:
            # the CUDA front end pads the head dim to a multiple of 8 for flash and slices the output
            pad = 8 - d % 8
            scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(d)
            qp, kp, vp = (F.pad(t, (0, pad)) for t in (q, k, v))
            return _FusedAttention.apply("flash", qp, kp, vp, None, dropout_p, a["is_causal"], scale)[..., :d]
        return _FusedAttention.apply(backend, q, k, v, mask, dropout_p, a["is_causal"], a["scale"])

    # -- embedding backward under our Triton kernels -------------------------------------------------
    def _embedding_backward(self, grad, indices, num_weights, padding_idx, scale_grad_by_freq=False):
        """What ``workbench.kernels.embedding`` runs on CUDA under Triton: zeros of the weight's shape and
        our deterministic ``index_put`` of the gradient rows into them (a new tensor)."""
        if scale_grad_by_freq or getattr(grad, "device_mesh", None) is not None:
            self.embedding_backward["aten"] += 1
            return torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx,
                                                           scale_grad_by_freq)
        from workbench.kernels.index_put import index_put

        self.embedding_backward["triton index_put"] += 1
        rows = grad.reshape(-1, grad.shape[-1])
        zeros = grad.new_zeros((num_weights, grad.shape[-1]))
        out = index_put(zeros, (indices.reshape(-1),), rows, accumulate=True, deterministic=True)
        del zeros
        if padding_idx >= 0:
            out[padding_idx] = 0
        return out

    # -- what was used -------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        att = dict(self.attention)
        main = max(att, key=att.get) if att else None
        return {"cuda_ops": "substituted", "capability": "%d.%d" % self.target.capability,
                "attention": main, "attention_calls": att,
                # what ran here, else what would run (a pipeline stage without the embedding runs none)
                "embedding_backward": (max(self.embedding_backward, key=self.embedding_backward.get)
                                       if self.embedding_backward else
                                       "triton index_put" if self.target.triton_kernels else None),
                "cross_entropy": "same kernels (log_softmax + nll_loss)",
                "matmul_workspaces": "cuBLAS, counted once"}
