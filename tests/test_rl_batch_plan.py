"""PPO batch planning: the configurations that broke the anchors, each derived exactly or refused in one line."""

from __future__ import annotations

import json
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.rl import BatchSize, parse_batch_size, plan_ppo_batches


def test_prompts_and_samples_are_not_confused():
    """rollout n multiplies prompts into samples (verl/OpenRLHF mixed them): 64 prompts x n=4 = 256 samples."""
    by_prompts = plan_ppo_batches(64, 4, "16 prompts", "4 samples/rank", world_size=4)
    by_samples = plan_ppo_batches(64, 4, "64 samples", "4 samples/rank", world_size=4)
    assert by_prompts.samples_per_rollout == 256
    assert by_prompts.mini_batch_samples == by_samples.mini_batch_samples == 64
    assert by_prompts.mini_batches_per_epoch == by_samples.mini_batches_per_epoch == 4
    assert by_prompts.mini_batch_prompts == 16.0


def test_global_and_per_rank_sizes_are_not_confused():
    """'8 samples/rank' over dp=4 is 32 global; a global micro-batch is split over the ranks."""
    a = plan_ppo_batches(32, 2, "8 samples/rank", "2 samples/rank", world_size=8, dp=4)
    b = plan_ppo_batches(32, 2, "32 samples", "8 samples", world_size=8, dp=4)
    assert a.mini_batch_samples == b.mini_batch_samples == 32 and a.mini_batch_samples_per_rank == 8
    assert a.micro_batch_samples_per_rank == b.micro_batch_samples_per_rank == 2 and a.grad_accum == b.grad_accum == 4
    assert a.ranks_per_dp_rank == 2  # the tp x pp ranks share their dp rank's batch


def test_an_inexact_gradient_accumulation_is_refused_not_clamped():
    """PaddleNLP warned and set gradient accumulation to 1; here it is one line with sizes that work."""
    with pytest.raises(ValueError) as err:
        plan_ppo_batches(64, 4, "256 samples", "3 samples/rank", world_size=4)
    msg = str(err.value)
    assert "\n" not in msg and "21.3333" in msg and "not an integer" in msg and "1 or 2 or 4 samples/rank" in msg


@pytest.mark.parametrize("mini", ["0 samples", "-4 samples", "0 prompts"])
def test_a_zero_mini_batch_is_refused(mini):
    """verl #552/#833: a zero mini-batch hung or produced NaN."""
    with pytest.raises(ValueError, match="must be at least 1"):
        plan_ppo_batches(8, 2, mini, "1 samples/rank", world_size=2)


def test_a_mini_batch_larger_than_the_rollout_gives_no_zero_step_count():
    with pytest.raises(ValueError, match=r"does not divide the 16 samples of a rollout.*use a mini-batch of"):
        plan_ppo_batches(8, 2, "32 samples", "1 samples/rank", world_size=2)


def test_lr_schedule_counts_optimizer_steps():
    """OpenRLHF #248: the schedule is rollouts x mini-batches x epochs optimizer steps, not rollouts."""
    p = plan_ppo_batches(128, 8, "256 samples", "4 samples/rank", world_size=8, ppo_epochs=2, total_prompts=12800)
    assert p.rollouts == 100 and p.mini_batches_per_epoch == 4 and p.optimizer_steps_per_rollout == 8
    assert p.lr_schedule_steps == 800
    with pytest.raises(ValueError, match="not a whole number of rollouts"):
        plan_ppo_batches(128, 8, "256 samples", "4 samples/rank", world_size=8, total_prompts=12801)


def test_whole_prompt_groups_on_every_rank():
    with pytest.raises(ValueError, match="each rank's 2 samples .* split the 4 samples of a prompt"):
        plan_ppo_batches(16, 4, "8 samples", "1 samples/rank", world_size=4, group_samples=True)
    p = plan_ppo_batches(16, 4, "16 samples", "2 samples/rank", world_size=4, group_samples=True)
    assert p.mini_batch_samples_per_rank == 4 and p.grad_accum == 2


def test_layout_and_size_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"dp=4 does not divide world_size=6.*\{1, 2, 3, 6\}"):
        plan_ppo_batches(8, 2, "8 samples", "1 samples/rank", world_size=6, dp=4)
    with pytest.raises(ValueError, match="unit 'tokens' is unknown"):
        parse_batch_size("8 tokens", "mini_batch")
    assert parse_batch_size("8/gpu", "x") == BatchSize(8, "samples", "rank")
    assert parse_batch_size(12, "x") == BatchSize(12, "samples", "global")


@settings(max_examples=200, deadline=None)
@given(P=st.integers(1, 64), n=st.integers(1, 8), dp=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2]),
       mb=st.integers(1, 256), micro=st.integers(1, 16), E=st.integers(1, 3), R=st.integers(1, 50))
def test_every_accepted_plan_conserves_samples(P, n, dp, tp, mb, micro, E, R):
    try:
        p = plan_ppo_batches(P, n, f"{mb} samples", f"{micro} samples/rank", world_size=dp * tp, dp=dp,
                             ppo_epochs=E, rollouts=R)
    except ValueError as e:
        assert "\n" not in str(e)
        return
    assert p.mini_batches_per_epoch * p.mini_batch_samples == p.samples_per_rollout == P * n
    assert p.grad_accum * p.micro_batch_samples_per_rank * p.dp == p.mini_batch_samples
    assert p.lr_schedule_steps == R * E * p.mini_batches_per_epoch
    for v in (p.mini_batches_per_epoch, p.grad_accum, p.micro_batch_samples_per_rank, p.optimizer_steps_per_rollout):
        assert isinstance(v, int) and v >= 1


def test_cli_prints_the_derivation_or_one_line(workbench_cli):
    args = [*workbench_cli, "rl", "batch-plan", "--prompts", "64", "-n", "4", "--micro-batch", "4 samples/rank",
            "--world-size", "8", "--dp", "4", "--ppo-epochs", "2", "--rollouts", "100"]
    ok = subprocess.run([*args, "--mini-batch", "64 prompts", "--json"], capture_output=True, text=True, timeout=60)
    doc = json.loads(ok.stdout)
    assert ok.returncode == 0 and doc["status"] == "ok" and doc["lr_schedule_steps"] == 200 and doc["grad_accum"] == 16
    bad = subprocess.run([*args, "--mini-batch", "96 samples"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: mini_batch=96 samples does not divide the 256 samples")


def test_view_draws_the_hierarchy_and_keeps_the_last_plan_on_a_bad_edit():
    from workbench.display import view_for
    from workbench.widgets.rl_batch_view import hierarchy

    big = plan_ppo_batches(1024, 16, "1024 samples", "1 samples/rank", world_size=64)
    h = hierarchy(big)
    assert len(h["ids"]) < 40  # 16 mini-batches x 64 ranks x 16 micro-batches, folded
    by_id = dict(zip(h["ids"], h["values"]))
    for i, parent in zip(h["ids"], h["parents"]):  # every level's boxes sum to their parent (samples)
        kids = [by_id[c] for c, p in zip(h["ids"], h["parents"]) if p == i]
        assert not kids or sum(kids) == by_id[i], i
    view = view_for(plan_ppo_batches(64, 4, "64 samples", "4 samples/rank", world_size=4))
    assert view.replan(mini_batch="96 samples") is None and "does not divide" in view.message.value
    assert view.plan.mini_batch_samples == 64  # the last good plan is still drawn
    assert view.replan(mini_batch="128 samples").mini_batches_per_epoch == 2
