"""Mixed precision, activation checkpointing and ZeRO stages: config, unit numerics, multi-rank parity.

Measured on 2026-11-21 (2-core CPU, torch 2.13, ``tiny``, seed 7, 5 steps, synthetic data):

* ZeRO 0/1/2/3 on dp_shard=2 vs 1 process (fp32): worst loss difference 8.9e-5 for every stage, within
  the tolerances of tests/test_parity.py (1e-3; step 0 within 1e-5; step-0 grad norm 1e-4 relative).
* bf16 mixed precision vs the 1-process bf16 run (autocast): dp_shard=2 (FSDP2 policy) 1.3e-2,
  tp=2 (autocast) 2.9e-2 worst loss difference; step 0 within 1e-4. The 1-process bf16 run itself is
  2.9e-2 from fp32. So two bf16 runs that sum in different orders drift apart as far as bf16 is from
  fp32: bf16 keeps 8 mantissa bits (relative resolution 2^-8 = 3.9e-3), and Adam's g/sqrt(v) plus
  the clipped grad-norm spike at step 2 (13 > grad_clip) amplify last-bit differences. Tolerances:
  BF16_TOL = 5e-2 (~1% of a loss of ~5) over 5 steps, 1e-3 at step 0 and 1e-2 relative on the step-0
  grad norm, where nothing has been amplified yet and a wrong reduction would be off by far more.
  The two engines are not the cause: FSDP's policy (bf16 residual stream) vs autocast (fp32 residual
  stream) differ less (1.3e-2) than autocast vs autocast under tp=2 (2.9e-2); in one process on
  random tokens they agree within 1.8e-3 (test_fsdp_policy_and_autocast_agree).
* bf16 vs fp32, 1 process: 2.9e-2 worst loss difference (tolerance 5e-2): the same model trains.
* Activation bytes saved for backward, ``tiny`` at batch 8 x seq 64 (pack-hook count, unique
  storages, parameters excluded): none 29.8 MB, selective (blocks 0, 2, 4 of 5) 13.2 MB, full 2.1 MB.
  The count sees what autograd saves; a checkpointed block's input is held by the checkpoint itself
  (5 x 256 KB here), not through a pack hook, so full AC really holds ~3.4 MB: still ~9x less.
* AC on vs off: bitwise-equal losses, 1 process (fp32 and bf16) and dp_shard=2.
* DDP over TP's DTensor parameters fails in torch 2.13 ("aten.cat.default got mixed torch.Tensor and
  DTensor"), so validate() rejects zero=0/1 with tp > 1.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import launch_tiny, rank0_metrics
from workbench.cli import main as cli_main
from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig
from workbench.models import build_model
from workbench.parallel.apply import parallelize
from workbench.parallel.checkpointing import apply_ac, checkpointed_blocks
from workbench.parallel.data import apply_fsdp
from workbench.parallel.precision import compute_context, fsdp_mp_policy
from workbench.train.launcher import build_job
from workbench.train.trainer import clip_grads_

TINY = PRESETS["tiny"]


# --------------------------------------------------------------------------------------------------
# Config and CLI
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(nproc=1, mixed_precision="fp16"), r"mixed_precision='fp16' is unknown; choose one of \['none', 'bf16'\]"),
        (dict(nproc=1, mixed_precision="bf16", dtype="bfloat16"), r"keeps float32 master weights, but dtype='bfloat16'; set dtype='float32'"),
        (dict(nproc=1, activation_checkpointing="some"), r"activation_checkpointing='some' is unknown"),
        (dict(nproc=1, ac_every=0), r"ac_every=0 must be a positive integer"),
        (dict(nproc=1, zero=4), r"zero=4 is unknown; choose a ZeRO stage in \[0, 1, 2, 3\]"),
        (dict(nproc=4, dp_shard=2, tp=2, zero=1), r"zero=1 \(DDP\) cannot replicate tensor-parallel DTensor parameters \(tp=2\); use zero=2 or zero=3"),
        (dict(nproc=4, dp_replicate=2, dp_shard=2, zero=0), r"zero=0 applies to dp_shard .* use dp_replicate=1 dp_shard=4, or zero=2/3"),
    ],
)
def test_bad_settings_are_one_clear_error(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        build_job("tiny", **kwargs)
    assert "\n" not in str(info.value)


def test_settings_reach_the_job_and_round_trip():
    job = build_job("tiny", nproc=2, dp_shard=2, zero=1, mixed_precision="bf16",
                    activation_checkpointing="selective", ac_every=3)
    assert job.parallel.zero == 1
    assert (job.train.mixed_precision, job.train.activation_checkpointing, job.train.ac_every) == ("bf16", "selective", 3)
    assert JobConfig.from_dict(job.to_dict()) == job
    assert ParallelConfig().zero == 3 and TrainConfig().mixed_precision == "none"
    # zero is about dp_shard: with nothing to shard (1 process, dp_replicate+tp) any stage is accepted
    build_job("tiny", nproc=1, zero=0)
    build_job("tiny", nproc=4, dp_replicate=2, tp=2, zero=1)


def test_cli_rejects_a_bad_combination_before_starting(capsys):
    code = cli_main(["train", "tiny", "--nproc", "4", "--dp-shard", "2", "--tp", "2", "--zero", "0", "--json"])
    assert code == 2
    assert "zero=0 (DDP) cannot replicate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["train", "tiny", "--ac", "half"])


# --------------------------------------------------------------------------------------------------
# Activation checkpointing (one process)
# --------------------------------------------------------------------------------------------------


def _batches(n, b=8, s=64, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY.vocab_size, (b, s + 1), generator=g) for _ in range(n)]


def _train(model, batches, mixed_precision="none", grad_dtypes: set | None = None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    losses = []
    for d in batches:
        with compute_context(model, mixed_precision, "cpu"):
            logits = model(d[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), d[:, 1:].flatten())
        loss.backward()
        if grad_dtypes is not None:
            grad_dtypes.update(p.grad.dtype for p in model.parameters())
        clip_grads_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt


def test_checkpointed_blocks():
    assert checkpointed_blocks(5, "none") == []
    assert checkpointed_blocks(5, "full") == [0, 1, 2, 3, 4]
    assert checkpointed_blocks(5, "selective", 2) == [0, 2, 4]
    assert checkpointed_blocks(5, "selective", 3) == [0, 3]


@pytest.mark.parametrize("mixed_precision", ["none", "bf16"])
def test_ac_is_bitwise_equal_on_one_process(mixed_precision):
    """Non-reentrant checkpointing reruns the same kernels on the same inputs (autocast state is
    restored for the recomputation), and CPU kernels are deterministic: losses and weights are equal
    bit for bit, not merely close."""
    batches = _batches(3)
    base = build_model(TINY, seed=7)
    ref_losses, _ = _train(copy.deepcopy(base), batches, mixed_precision)
    for mode in ("full", "selective"):
        model = apply_ac(copy.deepcopy(base), mode, 2)
        losses, _ = _train(model, batches, mixed_precision)
        assert losses == ref_losses, f"{mode}: {losses} != {ref_losses}"
    # The wrapper hides its prefix from state_dict: checkpoints keep the plain model's keys.
    assert list(apply_ac(copy.deepcopy(base), "full").state_dict()) == list(base.state_dict())


def _saved_activation_bytes(model, tokens) -> int:
    """Bytes autograd saves for backward during one forward (unique storages, parameters excluded)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().mean()
    loss.backward()
    return sum(seen.values())


def test_ac_saves_fewer_activation_bytes():
    tokens = _batches(1)[0][:, :-1]
    base = build_model(TINY, seed=7)
    measured = {mode: _saved_activation_bytes(apply_ac(copy.deepcopy(base), mode, 2), tokens)
                for mode in ("none", "selective", "full")}
    print("saved activation bytes:", measured)
    assert measured["full"] < measured["selective"] < measured["none"]
    assert measured["full"] < measured["none"] / 5


# --------------------------------------------------------------------------------------------------
# Mixed precision: master weights stay fp32 (real 1-rank gloo group for FSDP2)
# --------------------------------------------------------------------------------------------------


def _watch_compute_dtypes(model) -> set:
    """The dtype each Linear's weight has while it computes (under autocast: the cast operand's)."""
    seen = set()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    return seen


def _assert_fp32_master_state(model, opt):
    for p in model.parameters():
        assert p.dtype == torch.float32
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


def test_fsdp_policy_computes_bf16_with_fp32_master_weights(one_rank_mesh):
    model = apply_fsdp(build_model(TINY, seed=7), one_rank_mesh, mp_policy=fsdp_mp_policy("bf16"))
    seen, grads = _watch_compute_dtypes(model), set()
    _, opt = _train(model, _batches(1), "bf16", grads)
    assert seen == {torch.bfloat16} and grads == {torch.float32}
    _assert_fp32_master_state(model, opt)


def test_autocast_computes_bf16_with_fp32_master_weights():
    model = build_model(TINY, seed=7)
    seen, grads = _watch_compute_dtypes(model), set()
    _, opt = _train(model, _batches(1), "bf16", grads)
    assert seen == {torch.bfloat16} and grads == {torch.float32}
    _assert_fp32_master_state(model, opt)


def test_fsdp_policy_and_autocast_agree(one_rank_mesh):
    """The two engines of the bf16 recipe train the same model: within 5e-3 of each other over 5 steps
    (measured 1.8e-3), and each within 5e-2 of fp32 (measured 2.5e-3 on random tokens)."""
    batches = _batches(5)
    fp32, _ = _train(build_model(TINY, seed=7), batches)
    autocast, _ = _train(build_model(TINY, seed=7), batches, "bf16")
    fsdp_model = apply_fsdp(build_model(TINY, seed=7), one_rank_mesh, mp_policy=fsdp_mp_policy("bf16"))
    fsdp, _ = _train(fsdp_model, batches, "bf16")
    assert autocast != fp32 and fsdp != fp32  # bf16 compute really happened
    assert max(abs(a - b) for a, b in zip(autocast, fsdp)) <= 5e-3
    for run in (autocast, fsdp):
        assert max(abs(a - b) for a, b in zip(run, fp32)) <= 5e-2


def test_parallelize_single_process_applies_ac():
    model = parallelize(build_model(TINY, seed=0), ParallelConfig(dp_shard=1), None,
                        TrainConfig(activation_checkpointing="selective", ac_every=2))
    wrapped = [k for k, m in model.layers.items() if type(m).__name__ == "CheckpointWrapper"]
    assert wrapped == ["0", "2", "4"]


# --------------------------------------------------------------------------------------------------
# Multi-rank parity (real torchrun + gloo)
# --------------------------------------------------------------------------------------------------

STEPS, SEED = 5, 7
LOSS_TOL, LOSS0_TOL, GNORM0_RTOL = 1e-3, 1e-5, 1e-4  # as in tests/test_parity.py
BF16_TOL, BF16_LOSS0_TOL, BF16_GNORM0_RTOL, BF16_VS_FP32_TOL = 5e-2, 1e-3, 1e-2, 5e-2
TIMEOUT_S = 150


def _run(tmp_path_factory, name, **kw):
    return launch_tiny(tmp_path_factory, name, STEPS, SEED, TIMEOUT_S, **kw)


_rank0 = rank0_metrics


def _start(run):
    return next(e for e in run._all_events() if e["type"] == "start" and e["rank"] == 0)


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory):
    return _run(tmp_path_factory, "ref_fp32", nproc=1)


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    return _run(tmp_path_factory, "ref_bf16", nproc=1, mixed_precision="bf16")


@pytest.mark.multirank
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stage_matches_single_process(zero, fp32_reference, tmp_path_factory):
    run = _run(tmp_path_factory, f"zero{zero}", nproc=2, dp_shard=2, zero=zero)
    assert _start(run)["zero"] == zero
    ref, df = _rank0(fp32_reference), run.metrics
    assert (df.groupby("rank").size() == STEPS).all()
    assert df.groupby("step")["loss"].nunique().max() == 1
    g = _rank0(run)
    diff = (g["loss"] - ref["loss"]).abs()
    print(f"zero={zero}: max loss diff {diff.max():.2e}")
    assert diff.max() <= LOSS_TOL and diff.loc[0] <= LOSS0_TOL
    g0, r0 = g["grad_norm"].loc[0], ref["grad_norm"].loc[0]
    assert abs(g0 - r0) <= GNORM0_RTOL * r0
    # Clipping is active (grad norms > grad_clip=1.0) at later steps, so this also checks that
    # ZeroRedundancyOptimizer steps the clipped gradients.
    assert (g["grad_norm"].iloc[1:] > 1.0).any()


@pytest.mark.multirank
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("name, layout", [("dp_shard2", dict(nproc=2, dp_shard=2)), ("tp2", dict(nproc=2, tp=2))])
def test_bf16_matches_single_process_bf16(name, layout, bf16_reference, fp32_reference, tmp_path_factory):
    run = _run(tmp_path_factory, f"bf16_{name}", mixed_precision="bf16", **layout)
    start = _start(run)
    assert (start["mixed_precision"], start["param_dtype"]) == ("bf16", "float32")
    ref, g = _rank0(bf16_reference), _rank0(run)
    diff = (g["loss"] - ref["loss"]).abs()
    print(f"bf16 {name}: max loss diff vs 1-process bf16 {diff.max():.2e}")
    assert diff.max() <= BF16_TOL and diff.loc[0] <= BF16_LOSS0_TOL
    g0, r0 = g["grad_norm"].loc[0], ref["grad_norm"].loc[0]
    assert abs(g0 - r0) <= BF16_GNORM0_RTOL * r0
    fp32 = _rank0(fp32_reference)["loss"]
    vs_fp32 = (ref["loss"] - fp32).abs().max()
    print(f"bf16 vs fp32, 1 process: max loss diff {vs_fp32:.2e}")
    assert 0 < vs_fp32 <= BF16_VS_FP32_TOL
    assert g["loss"].iloc[-1] < g["loss"].iloc[0]


@pytest.mark.multirank
@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_ac_is_bitwise_equal_on_two_ranks(tmp_path_factory):
    """dp_shard=2 (FSDP2, reshard after forward): the recomputation all-gathers the same shards again
    and reruns the same CPU kernels, so the losses are bitwise equal with and without AC."""
    kw = dict(nproc=2, dp_shard=2)
    plain = _run(tmp_path_factory, "ac_none", **kw)
    full = _run(tmp_path_factory, "ac_full", activation_checkpointing="full", **kw)
    assert _start(full)["activation_checkpointing"] == "full"
    assert plain.metrics["loss"].tolist() == full.metrics["loss"].tolist()
