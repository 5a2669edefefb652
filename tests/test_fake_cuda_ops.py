"""Fake steps that run what CUDA runs (workbench.prediction.cuda_ops), on a machine without a GPU.

The saved tensors of the substituted attention are held against the sizes torch's CUDA kernels make
(flash_api.cpp, attention.cu and their meta functions): flash saves a (B, H, S) fp32 logsumexp and two
uint64 RNG tensors; efficient saves a logsumexp padded to a multiple of 32 rows and two int64 scalars;
cuDNN a (B, H, S, 1) logsumexp. The CPU's own kernel (what a CPU target keeps) saves (B, H, S) fp32 and
nothing else, so every check here fails if the substitution does not run, or runs for a CPU target.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workbench import compat
from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig, validate
from workbench.memory.recorder import MemoryRecorder
from workbench.prediction.cuda_ops import CudaOps, CudaTarget, attention_backend
from workbench.prediction.fake import run_fake_steps

pytestmark = pytest.mark.skipif(not compat.available("memory.cuda_ops"),
                                reason=f"torch {compat.TORCH_VERSION} lacks {compat.skip_reason('memory.cuda_ops')}")

B, H, S, D = 2, 4, 100, 64  # S is not a multiple of 32: efficient's padding shows


def _qkv(dtype, s=S, d=D, heads=H, device="meta"):
    return [torch.empty(B, heads, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3)]


def _saved(dtype, ops: CudaOps | None, **kw):
    """(what autograd saved for one attention call, the gradients' shapes), on fake CPU tensors."""
    saved = []
    with compat.fake_tensor_mode(allow_non_fake_inputs=True), (ops or _Nothing()):
        q, k, v = (torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        out.sum().backward()
        grads = [tuple(t.grad.shape) for t in (q, k, v)]
    # in the order of the derivative formula's arguments is not promised: compare as sorted lists
    return sorted(((tuple(t.shape), t.dtype) for t in saved), key=str), grads, tuple(out.shape)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


# --------------------------------------------------------------------------------------------------
# Which backend CUDA picks
# --------------------------------------------------------------------------------------------------


def test_backend_follows_cuda_rules():
    assert attention_backend(*_qkv(torch.bfloat16), is_causal=True) == "flash"
    assert attention_backend(*_qkv(torch.float16), is_causal=True) == "flash"
    assert attention_backend(*_qkv(torch.float32), is_causal=True) == "efficient"   # flash is fp16/bf16 only
    # flash needs sm80; efficient runs fp16 on older GPUs, and bf16 not before sm80
    assert attention_backend(*_qkv(torch.float16), capability=(7, 5)) == "efficient"
    assert attention_backend(*_qkv(torch.bfloat16), capability=(7, 5)) == "math"
    # efficient wants the head dim a multiple of 4 (fp32) or 8 (fp16/bf16) on sm80+
    assert attention_backend(*_qkv(torch.float32, d=6)) == "math"
    assert attention_backend(*_qkv(torch.float32, d=12)) == "efficient"
    assert attention_backend(*_qkv(torch.bfloat16, d=320)) == "efficient"           # flash: head dim <= 256
    # flash takes no mask, nor a causal mask on a non-square score matrix
    q, k, v = _qkv(torch.bfloat16)
    assert attention_backend(q, k, v, torch.empty(S, S, dtype=torch.bool, device="meta")) == "efficient"
    k2, v2 = (torch.empty(B, H, 2 * S, D, dtype=torch.bfloat16, device="meta") for _ in range(2))
    assert attention_backend(q, k2, v2, is_causal=True) == "efficient"
    assert attention_backend(q, k2, v2, is_causal=False) == "flash"
    # sm86-89 cannot run flash's backward for head dims over 192
    assert attention_backend(*_qkv(torch.bfloat16, d=256), capability=(8, 6)) == "efficient"
    assert attention_backend(*_qkv(torch.bfloat16, d=256), capability=(9, 0)) == "flash"
    # the enabled backends and torch's priority order decide among those that pass
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert attention_backend(*_qkv(torch.bfloat16)) == "cudnn"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert attention_backend(*_qkv(torch.bfloat16)) == "efficient"


# --------------------------------------------------------------------------------------------------
# What each backend saves, against torch's CUDA kernels
# --------------------------------------------------------------------------------------------------


def test_cpu_kernel_saves_its_own_statistics():
    """The baseline the substitution changes: the CPU's flash kernel saves q, k, v, out, lse (B, H, S)."""
    saved, grads, out = _saved(torch.float32, None)
    assert saved == sorted([((B, H, S, D), torch.float32)] * 4 + [((B, H, S), torch.float32)], key=str)
    assert grads == [(B, H, S, D)] * 3 and out == (B, H, S, D)


def test_efficient_saves_padded_logsumexp_and_seed_offset():
    ops = CudaOps()
    saved, grads, out = _saved(torch.float32, ops)
    lse_rows = math.ceil(S / 32) * 32  # attention.cu: logsumexp padded to the kernel's 32-row tiles
    assert saved == sorted([((B, H, S, D), torch.float32)] * 4 + [((B, H, lse_rows), torch.float32),
                                                                   ((), torch.int64), ((), torch.int64)], key=str)
    assert grads == [(B, H, S, D)] * 3 and out == (B, H, S, D)
    assert dict(ops.attention) == {"efficient": 1}


def test_flash_saves_logsumexp_and_rng_state():
    ops = CudaOps()
    saved, grads, out = _saved(torch.bfloat16, ops)
    # flash_api.cpp: softmax_lse (B, H, S) fp32; rng_state (2,) and an unused () uint64, both on the GPU
    assert saved == sorted([((B, H, S, D), torch.bfloat16)] * 4 + [((B, H, S), torch.float32),
                                                                    ((2,), torch.uint64), ((), torch.uint64)], key=str)
    assert grads == [(B, H, S, D)] * 3
    assert dict(ops.attention) == {"flash": 1}


def test_cudnn_saves_a_trailing_unit_dim():
    ops = CudaOps()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        saved, grads, _ = _saved(torch.bfloat16, ops)
    assert ((B, H, S, 1), torch.float32) in saved and ((B, H, S), torch.float32) not in saved
    assert grads == [(B, H, S, D)] * 3
    assert dict(ops.attention) == {"cudnn": 1}


def test_flash_pads_head_dim_to_eight():
    """The CUDA front end pads q, k, v to a head dim multiple of 8 for flash and slices the output."""
    ops = CudaOps()
    saved = []
    with compat.fake_tensor_mode(allow_non_fake_inputs=True), ops:
        q, k, v = (torch.randn(B, H, S, 20, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v)
        out.sum().backward()
    assert out.shape == (B, H, S, 20) and q.grad.shape == (B, H, S, 20)
    assert [tuple(t.shape) for t in saved[:4]] == [(B, H, S, 24)] * 4


def test_registration_is_undone_on_exit():
    with CudaOps():
        pass
    saved, _, _ = _saved(torch.float32, None)
    assert ((B, H, S), torch.float32) in saved and len(saved) == 5  # the CPU's kernel again


# --------------------------------------------------------------------------------------------------
# In the fake step: only for a CUDA target, and what it adds to the peak
# --------------------------------------------------------------------------------------------------

TINY = PRESETS["tiny"]


def _job(seq_len: int = 100, **train) -> JobConfig:
    t = TrainConfig(global_batch=2, seq_len=seq_len, **train)
    p = ParallelConfig().resolved(1)
    validate(TINY, p, t)
    return JobConfig(model=TINY, parallel=p, train=t)


def _step(job: JobConfig, target: str | None):
    rec = MemoryRecorder(rank=0, device="cpu", clock="sequence", source="predicted", allocator="cuda")
    built = {}
    info = run_fake_steps(job, 0, device="cpu", steps=2, mode_factory=lambda: rec, target=target,
                          on_built=lambda m, o: (rec.track(model=m, optimizer=o), built.update(opt=o)))
    return rec.timeline(), info, built["opt"]


def test_substitution_only_for_a_cuda_target():
    job = _job()
    tl_none, info_none, opt_none = _step(job, None)
    tl_cpu, info_cpu, _ = _step(job, "cpu")
    tl_cuda, info_cuda, opt_cuda = _step(job, "cuda")
    assert info_none.device_model == info_cpu.device_model == {"target": "cpu", "simulated_on": "cpu",
                                                               "cuda_ops": "none"}
    assert tl_none.peak(0).bytes == tl_cpu.peak(0).bytes
    dm = info_cuda.device_model
    assert dm["cuda_ops"] == "substituted" and dm["simulated_on"] == "cpu" and dm["target"] == "cuda"
    assert dm["attention"] == "efficient" and dm["attention_calls"] == {"efficient": 2 * TINY.n_layers}
    assert dm["embedding_backward"] == "triton index_put" and dm["optimizer"] == "fused"
    # the optimizer CUDA's optim_impl=auto builds: fused AdamW, not the CPU's loop
    assert opt_cuda.defaults["fused"] and not opt_none.defaults.get("fused")
    # kernels=torch keeps torch's embedding backward on CUDA too
    _, info_torch, _ = _step(_job(kernels="torch"), "cuda")
    assert info_torch.device_model["embedding_backward"] is None
    assert info_torch.device_model["attention"] == "efficient"


def test_backward_peak_holds_cuda_attention_statistics():
    """At the backward peak every layer's saved attention tensors are alive. On CUDA (fp32: efficient)
    each layer's logsumexp is (B, H, ceil32(S)) fp32 and its seed and offset are two 0-dim int64 GPU
    tensors (one 512-byte block each); the CPU kernel's is (B, H, S). Hand-computed difference::

        per layer   8192 (2 x 8 x 128 x 4) - 6656 (2 x 8 x 100 x 4 = 6400, in 512-byte blocks) + 2 x 512
    """
    job = _job(seq_len=100)
    tl_cpu, _, _ = _step(job, None)
    tl_cuda, _, _ = _step(job, "cuda")
    b, h, s = 2, TINY.n_heads, 100
    blocks = lambda n: -(-n // 512) * 512  # noqa: E731
    per_layer = blocks(b * h * math.ceil(s / 32) * 32 * 4) - blocks(b * h * s * 4) + 2 * 512
    p_cpu, p_cuda = tl_cpu.peak(0), tl_cuda.peak(0)
    assert p_cpu.phase == p_cuda.phase == "backward"
    assert p_cuda.bytes - p_cpu.bytes == TINY.n_layers * per_layer


def test_prediction_metadata_names_the_path():
    from workbench.prediction.memory import predict

    tl = predict("tiny", device="cuda", global_batch=2, seq_len=64, progress=False, nproc=1)
    dm = tl.meta["device_model"]
    expect_sim = "cuda" if torch.cuda.is_available() else "cpu"
    assert dm["simulated_on"] == expect_sim and dm["target"] == "cuda"
    assert dm["cuda_ops"] == ("native" if expect_sim == "cuda" else "substituted")
    tl_cpu = predict("tiny", device="cpu", global_batch=2, seq_len=64, progress=False, nproc=1)
    assert tl_cpu.meta["device_model"]["cuda_ops"] == "none"


def test_train_config_resolution():
    from workbench.prediction.cuda_ops import cuda_train_config

    t = TrainConfig()
    assert cuda_train_config(t).optim_impl == "fused"
    assert cuda_train_config(dataclasses.replace(t, optim_impl="loop")).optim_impl == "loop"
    assert CudaTarget(kernels="torch").triton_kernels is False
