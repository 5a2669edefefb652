"""The CPU recorder counts every category and phase exactly, against byte counts worked out by hand.

The tiny preset (dim D=128, 5 blocks, 8 heads of 16, 4 kv heads, ffn F=384, vocab V=256), batch B=2 of
S=16 tokens, one process, AdamW. Where each number comes from is written beside it.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from workbench.config import PRESETS
from workbench.memory import marks
from workbench.memory.recorder import MemoryRecorder
from workbench.memory.timeline import MemoryTimeline
from workbench.models.llama import build_model

CFG = PRESETS["tiny"]
B, S = 2, 16
D, FF, V, H, L = CFG.dim, CFG.ffn_hidden, CFG.vocab_size, CFG.n_heads, CFG.n_layers
F32 = 4


def _param_counts() -> tuple[int, int, int]:
    """(parameters, buffers, parameter tensors) of the tiny preset, from its shapes."""
    hd, kv = D // H, CFG.n_kv_heads
    block = D * H * hd + 2 * D * kv * hd + H * hd * D + 3 * D * FF + 2 * D  # wq wk wv wo, w1 w2 w3, 2 norms
    params = V * D + L * block + D + D * V  # embedding, blocks, final norm, output
    buffers = 2 * CFG.max_seq_len * (hd // 2)  # rope cos and sin tables
    tensors = 1 + L * 9 + 1 + 1
    return params, buffers, tensors


def _activations_no_ac() -> int:
    """Bytes autograd saves for backward in one forward of the tiny model (no checkpointing)."""
    bsd = B * S * D * F32
    per_block = (
        2 * bsd                        # the two residual sums (h, and the block's output): saved by the next norm
        + 2 * (2 * bsd + B * S * F32)  # each RMSNorm: normed x and normed*w (saved by the matmuls), rsqrt
        + bsd                          # rotated q (the stack in apply_rope), saved by attention
        + 2 * bsd                      # k and v after repeat_interleave (n_rep copies: as big as q)
        + bsd + B * H * S * F32        # attention's output and its logsumexp
        + 4 * B * S * FF * F32         # w1 x, w3 x, silu(w1 x), silu(w1 x) * w3 x
    )
    rest = (
        bsd                            # the embedding output (saved by the first norm)
        + 2 * B * S * 8                # the int64 tokens (embedding) and targets (the loss)
        + 2 * bsd + B * S * F32        # the final RMSNorm
        + B * S * V * F32              # log_softmax's output, saved by the loss
        + F32                          # the loss's total weight
    )
    return L * per_block + rest


def _one_step(rec: MemoryRecorder, *, ac: bool = False, steps: int = 1):
    torch.manual_seed(0)
    with marks.phase("build"):
        model = build_model(CFG, seed=0)
    if ac:
        from workbench.parallel.checkpointing import apply_ac

        apply_ac(model, "full")
    rec.track(model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    seen: dict[str, object] = {}
    for step in range(steps):
        marks.set_step(step)
        x = torch.randint(0, V, (B, S))
        y = torch.randint(0, V, (B, S))
        with marks.phase("forward"):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        seen[f"after_forward_{step}"] = rec.timeline()
        with marks.phase("backward"):
            loss.backward()
        del loss, x, y
        with marks.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    marks.set_step(-1)
    return model, opt, seen


def _last(tl: MemoryTimeline) -> dict[str, int]:
    return tl.category_bytes(tl.ranks[0]).iloc[-1].to_dict()


def test_parameters_gradients_optimizer_state_and_activations_match_hand_counts():
    params, buffers, tensors = _param_counts()
    assert params == CFG.n_params
    rec = MemoryRecorder(0)
    with rec:
        model, opt, seen = _one_step(rec)
    tl = rec.timeline()
    fwd = _last(seen["after_forward_0"])
    assert fwd["parameter"] == (params + buffers) * F32
    assert fwd["activation"] == _activations_no_ac()
    assert fwd["gradient"] == 0 and fwd["optimizer"] == 0
    end = _last(tl)
    # AdamW: exp_avg and exp_avg_sq per parameter, and a float32 step counter per tensor
    assert end["optimizer"] == 2 * params * F32 + tensors * F32
    assert end["activation"] == 0 and end["gradient"] == 0  # freed by backward and zero_grad
    # gradients peak at the optimizer step: one per parameter, all alive at once
    cats = tl.category_bytes(0)
    in_opt = (tl.frame["phase"] == "optimizer").to_numpy()
    assert cats["gradient"][in_opt].max() == params * F32
    assert cats["gradient"].max() == params * F32
    # phases: the build makes the parameters, backward makes the gradients
    grads = tl.frame[(tl.frame["category"] == "gradient") & (tl.frame["delta_bytes"] > 0)]
    assert set(grads["phase"].astype(str)) == {"backward"}
    built = tl.frame[(tl.frame["category"] == "parameter") & (tl.frame["delta_bytes"] > 0)]
    assert set(built["phase"].astype(str)) == {"build"}
    opt_rows = tl.frame[(tl.frame["category"] == "optimizer") & (tl.frame["delta_bytes"] > 0)]
    assert set(opt_rows["phase"].astype(str)) == {"optimizer"}
    # activations are attributed to the modules that made them
    act = tl.frame[(tl.frame["category"] == "activation") & (tl.frame["delta_bytes"] > 0)]
    ffn = act[act["module"].astype(str).str.startswith("layers.0.feed_forward")]
    assert ffn["delta_bytes"].sum() == 4 * B * S * FF * F32


def test_activation_checkpointing_keeps_only_block_inputs():
    rec2 = MemoryRecorder(0)
    with rec2:
        _, _, seen = _one_step(rec2, ac=True)
    act = _last(seen["after_forward_0"])["activation"]
    bsd = B * S * D * F32
    rest = bsd + 2 * B * S * 8 + 2 * bsd + B * S * F32 + B * S * V * F32 + F32
    # each checkpointed block keeps only its input (the first block's is the embedding output, in
    # ``rest``), and the final norm saves the last block's output: L more block-sized tensors
    assert act == rest + L * bsd


def test_temporaries_other_and_checkpoint_staging():
    rec = MemoryRecorder(0)
    with rec:
        marks.set_step(0)
        data = torch.ones(1000)  # outside any phase: other
        with marks.phase("forward"):
            a = data * 2          # 4000 B temporary
            b = a + 1             # 4000 B temporary, alive with a: peak 8000 + 4000 (data)
            del a
            c = b.sum()           # 4 B
        with marks.phase("checkpoint"):
            staged = b.clone()    # a staging copy: checkpoint
        del b, c
        gc.collect()
        marks.set_step(-1)
    tl = rec.timeline()
    peak = tl.peak(0)
    assert peak.bytes == 4000 + 4000 + 4000 + 4  # data, b, c, staged
    assert peak.by_category == {"other": 4000, "temporary": 4004, "checkpoint": 4000}
    first = tl.frame.iloc[0]
    assert first["category"] == "other" and first["phase"] == "other" and first["delta_bytes"] == 4000
    assert int(tl.frame["total_bytes"].iloc[-1]) == 8000  # data and staged still alive
    del staged, data


def test_resized_storages_are_followed():
    rec = MemoryRecorder(0)
    with rec:
        t = torch.empty(256)
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(512)
    tl = rec.timeline()
    assert tl.frame["delta_bytes"].tolist() == [1024, -1024, 512]
    assert tl.peak(0).bytes == 1024


def test_timeline_saves_and_loads_without_pickle(tmp_path):
    rec = MemoryRecorder(3)
    with rec:
        _one_step(rec)
    tl = rec.timeline()
    tl.save(tmp_path / "memory")
    back = MemoryTimeline.load(tmp_path)  # a run directory holding memory/
    assert back.ranks == [3]
    assert back.peak(3) == tl.peak(3)
    assert back.frame["module"].astype(str).tolist() == tl.frame["module"].astype(str).tolist()
    (tmp_path / "memory" / "rank3.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="damaged"):
        MemoryTimeline.load(tmp_path / "memory")
