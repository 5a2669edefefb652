"""Mixed precision: compute in bfloat16, keep fp32 master weights, reduce gradients and step Adam in fp32.

Two engines implement one recipe, chosen by how the model is parallelized:

* FSDP2 layouts (dp_shard > 1, HSDP): ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
  The sharded fp32 parameters are all-gathered as bf16 (half the bytes on the wire), forward and
  backward run in bf16, and gradients are cast to fp32 before the reduce-scatter.
* everything else (1 process, DDP, ZeRO-1, TP only): ``torch.autocast(device, bf16)`` around forward.
  Parameters stay fp32; matmuls cast their operands to bf16 on the fly, and gradients arrive in fp32.

The two differ in one detail: under FSDP's policy every parameter is bf16, so the residual stream is
bf16; under autocast the embedding and norms stay fp32. Measured on ``tiny`` (2026-11-21): the two
recipes agree within 1.8e-3 in loss on one forward/backward; over 5 training steps bf16 stays within
2.9e-2 of the fp32 run, and 2-rank bf16 layouts within 2.9e-2 of 1-process bf16, about what bf16's 8
mantissa bits allow once a clipped gradient spike amplifies them (``tests/test_precision_ac_zero.py``). The optimizer only ever sees fp32 parameters, so its state is
fp32 in both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy


def fsdp_mp_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """The FSDP2 policy for ``mixed_precision`` ("none" keeps FSDP's default: compute in param dtype)."""
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def compute_context(model: nn.Module, mixed_precision: str, device_type: str) -> AbstractContextManager:
    """What to run forward under: autocast where FSDP2's policy does not already cast."""
    if mixed_precision == "bf16" and not isinstance(model, FSDPModule):
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


def set_tf32(enabled: bool) -> None:
    """Let float32 matmuls and convolutions on CUDA use TF32 tensor cores (``enabled``) or not.

    torch 2.9 replaced the ``allow_tf32`` flags by ``fp32_precision`` ("tf32"/"ieee") and warns when the
    two are mixed, so the newer one is used where it exists.
    """
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        conv.conv.fp32_precision = "tf32" if enabled else "ieee"
    else:  # torch < 2.9
        matmul.allow_tf32 = enabled
        conv.allow_tf32 = enabled


def tf32_enabled() -> bool:
    """Whether float32 matmuls on CUDA may use TF32 now."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)
