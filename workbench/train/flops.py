"""Model FLOPs per token, GPU peak FLOP/s, and MFU (model FLOPs utilization).

Training one token costs a forward (2 FLOPs per multiply-add) and a backward (twice the forward)::

    flops_per_token    = 6 * P_matmul + 12 * n_layers * dim * seq_len
    flops_per_token_6n = 6 * N

``P_matmul`` counts the weights that take part in a matrix multiply: every ``nn.Linear`` of the blocks
and the output head (the head once, tied or not), but not the embedding, whose forward is a row lookup.
For a mixture of experts only the ``top_k`` experts a token visits count, plus the router. The second
term is attention's two matmuls (``Q K^T`` and ``A V``) over the whole sequence, as torchtitan counts
them: no halving for the causal mask. ``6N`` (``N = ModelConfig.n_params``) is the rougher convention
of the Chinchilla and PaLM papers.

    MFU = tokens/s per rank * flops_per_token / peak FLOP/s of one device

The peaks are dense (no 2:4 sparsity) tensor-core figures from vendor data sheets, per precision:
``bf16`` (bf16 inputs, fp32 accumulation), ``tf32`` (fp32 matmuls on tensor cores) and ``fp32`` (no
tensor cores). A GPU missing from the table, or a CPU, has no peak: pass ``override_tflops``
(``--peak-tflops``) for those. Nothing here imports torch until a device has to be asked its name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.config import ModelConfig, TrainConfig

__all__ = [
    "PRECISIONS", "PEAKS", "PeakRow", "flops_per_token", "flops_per_token_6n", "matmul_params", "gpu_name",
    "peak_row", "peak_name", "peak_flops_per_s", "precision_of", "mfu", "tflops_per_s",
]

PRECISIONS = ("bf16", "tf32", "fp32")


# --------------------------------------------------------------------------------------------------
# FLOPs of the model
# --------------------------------------------------------------------------------------------------


def matmul_params(model: "ModelConfig") -> int:
    """Weights one token multiplies through: the blocks' Linear weights (for a mixture of experts the
    ``top_k`` experts it is routed to, plus the router) and the output head. Not the embedding."""
    kv = model.n_kv_heads * model.head_dim
    attn = 2 * model.dim * model.dim + 2 * model.dim * kv  # wq, wo; wk, wv
    ffn = 3 * model.dim * model.ffn_hidden  # w1, w2, w3
    if model.n_experts:
        ffn = model.top_k * ffn + model.dim * model.n_experts  # the active experts + the router
    head = model.vocab_size * model.dim  # a tied head is still one matmul per token
    return model.n_layers * (attn + ffn) + head


def flops_per_token(model: "ModelConfig", seq_len: int) -> float:
    """Training FLOPs per token: ``6 * matmul_params + 12 * n_layers * dim * seq_len`` (torchtitan's count)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer (tokens per sequence)")
    return float(6 * matmul_params(model) + 12 * model.n_layers * model.dim * seq_len)


def flops_per_token_6n(model: "ModelConfig") -> float:
    """Training FLOPs per token by the ``6 N`` rule (N = every parameter, embedding included)."""
    return float(6 * model.n_params)


# --------------------------------------------------------------------------------------------------
# Peak FLOP/s of a device
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakRow:
    """One GPU's dense peak TFLOP/s per precision. ``pattern`` is searched in the CUDA device name
    (``torch.cuda.get_device_name``), case-insensitively; the first matching row of :data:`PEAKS` wins."""

    name: str
    pattern: str
    bf16: float
    tf32: float
    fp32: float

    def tflops(self, precision: str) -> float:
        return getattr(self, _check_precision(precision))


# Most specific first: "H100 NVL" before "H100", "GH200" before "H200", "L40S" before "L40" before "L4".
# Data sheets quote tensor-core rates "with sparsity"; the dense rate is half of that.
PEAKS: tuple[PeakRow, ...] = (
    # NVIDIA H100 data sheet, H100 NVL column (per GPU): BF16 1,671*, TF32 835*, FP32 60 TFLOPS
    # (* with sparsity). torchtitan's table has the same 835 dense bf16.
    PeakRow("H100 NVL", r"\bH100\b.*\bNVL\b", 835.5, 417.5, 60.0),
    # NVIDIA H100 data sheet, H100 PCIe: BF16 1,513*, TF32 756*, FP32 51 TFLOPS; the H100 architecture
    # whitepaper gives 756 / 378 / 51.2 dense. PCIe boards report "H100 PCIe" (their memory is HBM2e).
    PeakRow("H100 PCIe", r"\bH100\b.*\b(PCIe|HBM2e)\b", 756.0, 378.0, 51.2),
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100 SXM5: BF16 989.4, TF32 494.7, FP32 66.9
    # dense (data sheet: 1,979* / 989* / 67). SXM boards report "H100 80GB HBM3".
    PeakRow("H100 SXM", r"\bH100\b", 989.4, 494.7, 66.9),
    # NVIDIA GH200 data sheet: BF16 990 | 1,979*, TF32 494 | 989*, FP32 67 TFLOPS: the H100 SXM's rates.
    PeakRow("GH200", r"\bGH200\b", 989.4, 494.7, 66.9),
    # NVIDIA H200 data sheet, H200 NVL: BF16 1,671*, TF32 835*, FP32 60 TFLOPS.
    PeakRow("H200 NVL", r"\bH200\b.*\bNVL\b", 835.5, 417.5, 60.0),
    # NVIDIA H200 data sheet, H200 SXM: BF16 1,979*, TF32 989*, FP32 67 TFLOPS: the H100 SXM's die and clocks.
    PeakRow("H200 SXM", r"\bH200\b", 989.4, 494.7, 66.9),
    # NVIDIA A100 data sheet (SXM and PCIe alike): BF16 312 | 624*, TF32 156 | 312*, FP32 19.5 TFLOPS.
    PeakRow("A100", r"\bA100\b", 312.0, 156.0, 19.5),
    # NVIDIA L40S data sheet: BF16 362.05 | 733*, TF32 183 | 366*, FP32 91.6 TFLOPS.
    PeakRow("L40S", r"\bL40S\b", 362.05, 183.0, 91.6),
    # NVIDIA L40 data sheet: BF16 181.05 | 362.1*, TF32 90.5 | 181*, FP32 90.5 TFLOPS.
    PeakRow("L40", r"\bL40\b", 181.05, 90.5, 90.5),
    # NVIDIA L4 data sheet: BF16 242*, TF32 120*, FP32 30.3 TFLOPS.
    PeakRow("L4", r"\bL4\b", 121.0, 60.0, 30.3),
    # AWS's A10G has no NVIDIA data sheet; these are the A10's (BF16 125 | 250*, TF32 62.5 | 125*, FP32
    # 31.2 TFLOPS), as Lightning's throughput table also takes them. Third-party listings put the A10G's
    # tensor rate lower, so pass --peak-tflops where its MFU must be exact.
    PeakRow("A10G", r"\bA10G\b", 125.0, 62.5, 31.2),
    PeakRow("A10", r"\bA10\b", 125.0, 62.5, 31.2),  # NVIDIA A10 data sheet, as above
    # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: FP32 82.6; BF16 tensor with FP32
    # accumulate 165.2 (330.4*); TF32 82.6 (165.2*) TFLOPS. GeForce runs fp32-accumulate at half rate.
    PeakRow("RTX 4090", r"RTX 4090(?! ?D\b)", 165.2, 82.6, 82.6),
)

# A device spec ("cuda", "cuda:1", "cpu") rather than a GPU's name.
_DEVICE_SPEC = re.compile(r"^(cpu|cuda|meta|mps|xpu|hip)(:\d+)?$")


def _check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}; use precision_of(train, device_type)")
    return precision


def gpu_name(device: Any) -> str | None:
    """The CUDA device name of ``device`` (a ``torch.device``, ``"cuda:0"``), or ``device`` itself when it
    is already a name (``"NVIDIA H100 80GB HBM3"``). None for a CPU or another non-CUDA device, and for
    ``"cuda"`` on a machine without one."""
    if device is None:
        return None
    if isinstance(device, str) and not _DEVICE_SPEC.match(device.strip().lower()):
        return device
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(dev)


def peak_row(device: Any) -> PeakRow | None:
    """The row of :data:`PEAKS` that ``device`` (a device or a GPU's name) matches, or None."""
    name = gpu_name(device)
    if not name:
        return None
    for row in PEAKS:
        if re.search(row.pattern, name, flags=re.IGNORECASE):
            return row
    return None


def peak_name(device: Any) -> str | None:
    """Which table row ``device`` matched (``"H100 SXM"``), for reports; None where none did."""
    row = peak_row(device)
    return row.name if row is not None else None


def peak_flops_per_s(device: Any, precision: str, override_tflops: float | None = None) -> float | None:
    """Dense peak FLOP/s of one ``device`` at ``precision`` (``bf16``, ``tf32``, ``fp32``).

    ``override_tflops`` (TFLOP/s per rank, ``--peak-tflops``) wins over the table, on any device. Without
    it a CPU, or a GPU the table does not know, has no peak: None.
    """
    _check_precision(precision)
    if override_tflops is not None:
        if isinstance(override_tflops, bool) or not override_tflops > 0:
            raise ValueError(f"peak_tflops={override_tflops!r} must be a positive number of TFLOP/s per rank, "
                             "e.g. 989.4 for an H100 SXM in bf16")
        return float(override_tflops) * 1e12
    row = peak_row(device)
    return row.tflops(precision) * 1e12 if row is not None else None


def precision_of(train: "TrainConfig", device_type: str) -> str:
    """The precision the matmuls of a run with ``train`` execute in on ``device_type``: ``bf16`` (mixed
    precision bf16, or bfloat16 weights), ``tf32`` (float32 on CUDA with ``train.tf32``), else ``fp32``."""
    if train.mixed_precision == "bf16" or train.dtype == "bfloat16":
        return "bf16"
    if device_type == "cuda" and train.tf32:
        return "tf32"
    return "fp32"


# --------------------------------------------------------------------------------------------------
# Utilization
# --------------------------------------------------------------------------------------------------


def tflops_per_s(tokens_per_s_per_rank: float, flops_per_token: float) -> float:
    """Achieved model TFLOP/s of one rank."""
    return tokens_per_s_per_rank * flops_per_token / 1e12


def mfu(tokens_per_s_per_rank: float | None, flops_per_token: float,
        peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over the device's peak; None without a peak."""
    if tokens_per_s_per_rank is None or peak_flops_per_s is None or peak_flops_per_s <= 0:
        return None
    return tokens_per_s_per_rank * flops_per_token / peak_flops_per_s
