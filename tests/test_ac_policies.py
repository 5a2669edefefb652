"""Activation checkpointing policies made explicit (issue 32, part 5): ``--ac none|full|selective|op``.

``selective`` is ours, layer-level: every ``ac_every``-th block checkpointed whole. ``op`` is torchtitan's
op-level save list in every block: matmul outputs but every second, attention outputs (flash, efficient,
cuDNN, and the CPU's flash kernel) and reduce-scatter outputs are saved, the rest recomputed. Checked
here: what ``op`` recomputes (kernels counted in backward), that it keeps less than no AC and more than
full AC, that real CPU training with it (1 process, and 2 gloo ranks under FSDP2 and under TP + SP)
matches training without it within the parity tolerances of tests/test_parity.py, that the fake step
runs it and its prediction matches the measured CPU peak, and that plans and predictions name the policy.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import workbench
from helpers import launch_tiny, rank0_metrics
from workbench.config import PRESETS, TrainConfig
from workbench.memory import compare, load, predict
from workbench.memory.recorder import MemoryRecorder
from workbench.models import build_model
from workbench.parallel.checkpointing import AC_POLICIES, ac_policy, apply_ac, checkpointed_blocks, op_save_list

TINY = PRESETS["tiny"]
LOSS_TOL, LOSS0_TOL, GNORM0_RTOL = 1e-3, 1e-5, 1e-4  # as in tests/test_parity.py
STEPS, SEED, TIMEOUT_S = 5, 7, 150


def _tokens(b=4, s=32, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (b, s + 1), generator=g)


def _loss(model, d):
    logits = model(d[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), d[:, 1:].flatten())


# --------------------------------------------------------------------------------------------------
# The policies, named
# --------------------------------------------------------------------------------------------------


def test_every_policy_is_a_setting_with_a_name():
    assert set(AC_POLICIES) == {"none", "full", "selective", "op"}
    for mode in AC_POLICIES:
        TrainConfig(activation_checkpointing=mode)
    assert ac_policy("selective", 3) == "selective (layer-level): every 3-th block checkpointed whole"
    assert ac_policy("op").startswith("op (torchtitan's op-level save list")
    assert checkpointed_blocks(5, "op") == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"activation_checkpointing='some'.*'op'"):
        ac_policy("some")
    ops = {str(op) for op in op_save_list()}
    assert {"aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "_c10d_functional.reduce_scatter_tensor.default"} <= ops


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the kernels that run (below a checkpoint's own mode: what it recomputes, not what it hands
    back from its cache), per phase."""

    def __init__(self):
        super().__init__()
        self.backward: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._current_graph_task_id() != -1:
            name = str(func.overloadpacket)
            self.backward[name] = self.backward.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_kernels(mode: str) -> dict[str, int]:
    model = apply_ac(build_model(TINY, seed=7), mode)
    d = _tokens()
    with _Kernels() as k:
        _loss(model, d).backward()
    return k.backward


def test_op_policy_recomputes_every_second_matmul_and_no_attention():
    """A block runs 7 matmuls (wq, wk, wv, wo, w1, w3, w2) and one attention. Full AC reruns them in
    backward up to the last one backward needs (non-reentrant checkpointing stops early: w2's output is
    not saved, so 6 matmuls and the attention); the op-level policy saves the 1st, 3rd, 5th and 7th matmul
    and the attention, so it reruns 3 matmuls and no attention; without AC nothing is rerun."""
    none, full, op = (_backward_kernels(m) for m in ("none", "full", "op"))
    blocks = TINY.n_layers
    flash = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert full["aten.mm"] - none["aten.mm"] == 6 * blocks
    assert op["aten.mm"] - none["aten.mm"] == 3 * blocks
    assert full.get(flash, 0) == blocks and op.get(flash, 0) == none.get(flash, 0) == 0


def _peak_bytes(mode: str) -> int:
    model = apply_ac(build_model(TINY, seed=7), mode)
    d = _tokens(8, 64)
    rec = MemoryRecorder(rank=0)
    with rec:
        rec.track(model=model)
        _loss(model, d).backward()
    return rec.peak_bytes


def test_op_policy_keeps_between_full_and_none():
    peaks = {mode: _peak_bytes(mode) for mode in ("none", "op", "full")}
    assert peaks["full"] < peaks["op"] < peaks["none"], peaks


@pytest.mark.parametrize("mixed_precision", ["none", "bf16"])
def test_op_policy_is_bitwise_equal_on_one_process(mixed_precision):
    """What the policy recomputes is recomputed by the same kernels on the same inputs: loss and every
    gradient equal bit for bit."""
    from workbench.parallel.precision import compute_context

    base = build_model(TINY, seed=7)
    d = _tokens()
    out = {}
    for mode in ("none", "op"):
        model = apply_ac(copy.deepcopy(base), mode)
        with compute_context(model, mixed_precision, "cpu"):
            loss = _loss(model, d)
        loss.backward()
        out[mode] = (loss.item(), [p.grad for p in model.parameters()])
    assert out["op"][0] == out["none"][0]
    assert all(torch.equal(a, b) for a, b in zip(out["op"][1], out["none"][1]))


# --------------------------------------------------------------------------------------------------
# Real training (torchrun + gloo): the op policy trains as no AC does
# --------------------------------------------------------------------------------------------------


def _run(tmp_path_factory, name, **kw):
    return launch_tiny(tmp_path_factory, name, STEPS, SEED, TIMEOUT_S, **kw)


_rank0 = rank0_metrics


def _assert_matches(run, reference):
    a, b = _rank0(run), _rank0(reference)
    diff = (a["loss"] - b["loss"]).abs()
    assert diff.max() <= LOSS_TOL and diff.loc[0] <= LOSS0_TOL, diff.tolist()
    g0, r0 = a["grad_norm"].loc[0], b["grad_norm"].loc[0]  # backward: the step-0 gradient norm
    assert abs(g0 - r0) <= GNORM0_RTOL * r0
    assert a["loss"].iloc[-1] < a["loss"].iloc[0]


@pytest.fixture(scope="module")
def no_ac(tmp_path_factory):
    return _run(tmp_path_factory, "none_1", nproc=1)


@pytest.mark.multirank
@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_op_policy_trains_like_no_ac_on_one_process(no_ac, tmp_path_factory):
    op = _run(tmp_path_factory, "op_1", nproc=1, activation_checkpointing="op")
    _assert_matches(op, no_ac)


@pytest.mark.multirank
@pytest.mark.timeout(3 * TIMEOUT_S + 30)
@pytest.mark.parametrize("layout", [dict(nproc=2, dp_shard=2), dict(nproc=2, dp_shard=1, tp=2, sequence_parallel=True)],
                         ids=["fsdp2", "tp2_sp"])
def test_op_policy_trains_like_no_ac_on_two_ranks(layout, no_ac, tmp_path_factory):
    """Two gloo ranks: FSDP2 (the recomputation inside the all-gathered block) and TP + SP (DTensor
    matmuls, and the sequence-parallel reduce-scatters the policy saves) against the 1-process run
    without AC."""
    op = _run(tmp_path_factory, "op_2", activation_checkpointing="op", **layout)
    _assert_matches(op, no_ac)


# --------------------------------------------------------------------------------------------------
# The fake step and the prediction
# --------------------------------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_op_policy_prediction_matches_the_measured_cpu_peak_and_names_the_policy(tmp_path):
    settings = dict(nproc=2, dp_shard=2, activation_checkpointing="op", steps=3, global_batch=8, seq_len=64)
    run = workbench.launch("tiny", out=tmp_path / "run", memory=True, **settings).wait(TIMEOUT_S)
    predicted = predict(run.job, progress=False)
    assert predicted.meta["ac_policy"] == ac_policy("op")
    table = compare(load(run.run_dir), predicted).to_frame()
    assert (table["error"].abs() <= 0.02).all(), table
    none = predict(run.job.model, progress=False, nproc=2, dp_shard=2,
                   train=dict(steps=3, global_batch=8, seq_len=64))
    full = predict(run.job.model, progress=False, nproc=2, dp_shard=2, activation_checkpointing="full",
                   train=dict(steps=3, global_batch=8, seq_len=64))
    assert none.meta["ac_policy"] == ac_policy("none")
    assert full.peak(0).bytes < predicted.peak(0).bytes < none.peak(0).bytes
