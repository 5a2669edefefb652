"""The model on one process: shapes, causality, deterministic init, rotary embeddings."""

from __future__ import annotations

import torch

from workbench.config import PRESETS, ModelConfig
from workbench.models import build_model
from workbench.models.llama import apply_rope, rope_tables


def test_forward_shape_and_param_count():
    cfg = PRESETS["tiny"]
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params
    logits = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.vocab_size)


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(PRESETS["tiny"], seed=1)
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 7) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_init_depends_only_on_seed():
    cfg = PRESETS["tiny"]
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(p, r), n


def test_meta_device_allocates_nothing():
    model = build_model(PRESETS["llama-70b"], device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PRESETS["llama-70b"].n_params


def test_rope_is_a_rotation():
    cos, sin = rope_tables(16, 32, 10000.0)
    x = torch.randn(2, 32, 4, 16)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(out[:, 0], x[:, 0])  # position 0 is not rotated


def test_gqa_and_tied_embeddings():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=96, vocab_size=100, tie_embeddings=True)
    model = build_model(cfg, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params
    assert model.layers["0"].attention.wk.weight.shape == (2 * 8, 64)
    assert model(torch.randint(0, 100, (1, 5))).shape == (1, 5, 100)


def test_a_built_tied_model_stays_tied():
    """``materialize`` runs ``to_empty``, which gives every module its own new Parameter (torch 2.13): the
    output layer of a tie_embeddings model trained as a second matrix with an init of its own. Every real
    run builds through it, and an HF checkpoint with tie_word_embeddings (``--init-from``) has no lm_head."""
    import dataclasses

    from workbench.config import PRESETS, ParallelConfig, TrainConfig
    from workbench.parallel.build import build_stages

    cfg = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    model = build_stages(cfg, ParallelConfig(), TrainConfig(seed=3), None, "cpu").modules[0]
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params
    torch.testing.assert_close(model.tok_embeddings.weight, build_model(cfg, seed=3).tok_embeddings.weight)
