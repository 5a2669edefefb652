"""FLOPs per token, the GPU peak table and MFU (workbench.train.flops): hand-computed, no GPU needed."""

from __future__ import annotations

import dataclasses

import pytest

from workbench.config import PRESETS, ModelConfig, TrainConfig
from workbench.train import flops
from workbench.train.flops import (flops_per_token, flops_per_token_6n, mfu, peak_flops_per_s, peak_name,
                                   precision_of)

# The issue's model: hidden 2048, 16 layers, GQA 16/8, ffn 5632, vocab 32000, untied.
LLAMA_886M = ModelConfig("llama-886m", dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=5632,
                         vocab_size=32000, max_seq_len=2048)


def test_tiny_preset_by_hand():
    tiny = PRESETS["tiny"]  # dim 128, 5 layers, 8 heads / 4 kv heads (head_dim 16), ffn 384, vocab 256
    attn = 128 * 128 * 2 + 128 * 64 * 2  # wq, wo + wk, wv
    ffn = 3 * 128 * 384
    assert (attn, ffn) == (49_152, 147_456)
    matmul = 5 * (attn + ffn) + 256 * 128  # + the output head; the embedding is a lookup
    assert flops.matmul_params(tiny) == matmul == 1_015_808
    assert flops_per_token(tiny, 64) == 6 * 1_015_808 + 12 * 5 * 128 * 64 == 6_586_368
    assert tiny.n_params == 1_049_984
    assert flops_per_token_6n(tiny) == 6 * 1_049_984
    # the attention term grows with the sequence, the 6N rule does not see it
    assert flops_per_token(tiny, 128) - flops_per_token(tiny, 64) == 12 * 5 * 128 * 64


def test_886m_llama_reproduces_the_issue_table():
    m = LLAMA_886M
    assert m.n_params == 886_114_304
    per_layer = (2 * 2048 * 2048 + 2 * 2048 * 1024) + 3 * 2048 * 5632
    assert flops.matmul_params(m) == 16 * per_layer + 32000 * 2048 == 820_510_720
    assert flops_per_token(m, 2048) == 6 * 820_510_720 + 12 * 16 * 2048 * 2048 == 5_728_370_688
    assert flops_per_token_6n(m) == 5_316_685_824
    h100 = peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16")
    assert h100 == pytest.approx(989.4e12)
    # The issue's table, MFU by 6N: 31k -> 0.17, 55.6k -> 0.30, 87.8k -> 0.47 tokens/s on one H100 SXM.
    for tokens_per_s, table in ((31_000, 0.17), (55_600, 0.30), (87_800, 0.47)):
        assert round(mfu(tokens_per_s, flops_per_token_6n(m), h100), 2) == table
    # the per-matmul count is ~8% above 6N at seq_len 2048
    assert mfu(31_000, flops_per_token(m, 2048), h100) == pytest.approx(0.1795, abs=1e-4)
    assert flops.tflops_per_s(31_000, flops_per_token_6n(m)) == pytest.approx(164.82, abs=0.01)


def test_tied_head_counts_once_as_a_matmul():
    tiny = PRESETS["tiny"]
    tied = dataclasses.replace(tiny, tie_embeddings=True)
    assert tied.n_params == tiny.n_params - 256 * 128  # one shared weight...
    assert flops.matmul_params(tied) == flops.matmul_params(tiny)  # ...still one matmul per token


def test_mixture_of_experts_counts_the_active_experts_and_the_router():
    moe = PRESETS["tiny-moe"]  # dim 128, 4 layers, ffn 256, 4 experts, top 2
    attn = 128 * 128 * 2 + 128 * 64 * 2
    active = 2 * 3 * 128 * 256 + 128 * 4  # top_k experts + the router
    assert flops.matmul_params(moe) == 4 * (attn + active) + 256 * 128 == 1_017_856
    assert flops_per_token(moe, 64) == 6 * 1_017_856 + 12 * 4 * 128 * 64
    # 6N counts every expert
    every = 4 * (attn + 4 * 3 * 128 * 256 + 128 * 4 + 2 * 128) + 2 * 256 * 128 + 128
    assert moe.n_params == every and flops_per_token_6n(moe) == 6 * every
    top1 = dataclasses.replace(moe, top_k=1)
    assert flops.matmul_params(moe) - flops.matmul_params(top1) == 4 * 3 * 128 * 256


@pytest.mark.parametrize("name, row, bf16", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA L40", "L40", 181.05),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA A10G", "A10G", 125.0),
    ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
])
def test_peak_table_by_device_name(name, row, bf16):
    assert peak_name(name) == row
    assert peak_flops_per_s(name, "bf16") == pytest.approx(bf16 * 1e12)


def test_peak_precisions_and_unknown_names():
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_flops_per_s(h100, "tf32") == pytest.approx(494.7e12)
    assert peak_flops_per_s(h100, "fp32") == pytest.approx(66.9e12)
    assert peak_flops_per_s("NVIDIA A100-PCIE-40GB", "tf32") == pytest.approx(156e12)
    # names that only look alike do not match a row
    for other in ("NVIDIA RTX A1000 Laptop GPU", "NVIDIA GeForce RTX 4090 D", "Tesla T4", "AMD Instinct MI300X"):
        assert peak_name(other) is None, other
        assert peak_flops_per_s(other, "bf16") is None
    with pytest.raises(ValueError, match="precision='fp16' is not one of"):
        peak_flops_per_s(h100, "fp16")


def test_cpu_has_no_peak_unless_overridden():
    import torch

    for cpu in ("cpu", torch.device("cpu"), None):
        assert peak_flops_per_s(cpu, "fp32") is None
        assert peak_name(cpu) is None
    assert mfu(10_000, 1e9, None) is None
    # the override is TFLOP/s per rank and wins over the table, on any device
    assert peak_flops_per_s("cpu", "fp32", override_tflops=2.5) == 2.5e12
    assert peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16", override_tflops=500) == 500e12
    assert mfu(10_000, 1e6, 2.5e12) == pytest.approx(0.004)  # 1e10 FLOP/s of 2.5e12
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="must be a positive number of TFLOP/s"):
            peak_flops_per_s("cpu", "bf16", override_tflops=bad)
    if not torch.cuda.is_available():  # "cuda" on a machine without one: no name, no peak
        assert flops.gpu_name("cuda") is None and peak_flops_per_s("cuda:0", "bf16") is None


def test_precision_of_a_run():
    assert precision_of(TrainConfig(mixed_precision="bf16"), "cuda") == "bf16"
    assert precision_of(TrainConfig(mixed_precision="bf16"), "cpu") == "bf16"
    assert precision_of(TrainConfig(dtype="bfloat16"), "cuda") == "bf16"
    assert precision_of(TrainConfig(), "cuda") == "tf32"  # tf32 is on by default
    assert precision_of(TrainConfig(tf32=False), "cuda") == "fp32"
    assert precision_of(TrainConfig(), "cpu") == "fp32"  # no TF32 on a CPU


def test_flops_per_token_rejects_a_bad_sequence_length():
    with pytest.raises(ValueError, match="seq_len=0 must be a positive integer"):
        flops_per_token(PRESETS["tiny"], 0)
