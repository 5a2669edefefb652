"""PPO batch planning: the configurations that broke the anchors, each derived exactly or refused in one line.

Each anchor test states a concrete configuration twice: the accepted plan with every derived count, and the
nearby mistake refused with one line that names the fix. Pure Python (no torch, no processes) except the
view test, which imports the widget layer.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.rl import BatchSize, parse_batch_size, plan_ppo_batches

FIX_WORDS = ("use ", "give ", "write ", "choose ")


def refused(*args, **kwargs) -> str:
    """The planner's one-line refusal of this configuration (fails the test if it was accepted)."""
    with pytest.raises(ValueError) as err:
        plan_ppo_batches(*args, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg and any(w in msg for w in FIX_WORDS), msg
    return msg


def test_prompts_and_samples_are_not_confused():
    """OpenRLHF-style run: 256 prompts x n=16 = 4096 samples; a train batch of 128 *samples* is 32 optimizer
    steps per rollout, where 128 *prompts* (2048 samples) would be 2: a factor n apart."""
    p = plan_ppo_batches(256, 16, "128 samples", "2 samples/rank", world_size=8)
    assert (p.samples_per_rollout, p.mini_batch_samples, p.mini_batches_per_epoch) == (4096, 128, 32)
    assert (p.mini_batch_samples_per_rank, p.micro_batch_samples_per_rank, p.grad_accum) == (16, 2, 8)
    assert p.mini_batch_prompts == 8
    q = plan_ppo_batches(256, 16, "128 prompts", "2 samples/rank", world_size=8)
    assert (q.mini_batch_samples, q.mini_batches_per_epoch, q.grad_accum) == (2048, 2, 128)
    # a bare number is exactly the ambiguity: refused, naming both readings
    assert refused(256, 16, "128", "2 samples/rank", world_size=8) == (
        "mini_batch='128' has no unit, and prompts and samples differ by a factor n; "
        "write '128 samples' or '128 prompts'")
    # verl's mini-batch is in prompts: 48 prompts x 4 = 192 samples, which does not divide a 256-sample rollout
    assert refused(64, 4, "48 prompts", "4 samples/rank", world_size=4) == (
        "mini_batch=48 prompts (192 samples) does not divide the 256 samples of a rollout (= 64 prompts x 4); "
        "PPO would drop or repeat the remainder: use a mini-batch of 64, 128 or 256 samples (global), "
        "or change prompts_per_rollout")


def test_global_and_per_rank_sizes_are_not_confused():
    """verl rewrites its global mini-batch into a per-GPU one in place: 256 samples global over dp=8 is 32 per
    rank; tp=2 ranks share their dp rank's batch and do not divide it again."""
    g = plan_ppo_batches(256, 4, "256 samples", "8 samples/rank", world_size=16, dp=8)
    r = plan_ppo_batches(256, 4, "32 samples/rank", "64 samples", world_size=16, dp=8)
    for p in (g, r):
        assert (p.samples_per_rollout, p.mini_batch_samples, p.mini_batches_per_epoch) == (1024, 256, 4)
        assert (p.ranks_per_dp_rank, p.mini_batch_samples_per_rank, p.micro_batch_samples_per_rank) == (2, 32, 8)
        assert p.grad_accum == 4
    # the per-rank number read as global... is the global number read as per rank: 256 x 8 = 2048 > 1024
    assert refused(256, 4, "256 samples/rank", "8 samples/rank", world_size=16, dp=8).startswith(
        "mini_batch=256 samples/rank (2048 samples) is larger than the 1024 samples of a rollout")
    # a global micro-batch must split evenly over the dp ranks
    assert refused(256, 4, "256 samples", "12 samples", world_size=16, dp=8) == (
        "micro_batch=12 samples (12 samples, global) does not split over dp=8 ranks; give it per rank, "
        "e.g. '1 samples/rank', or a multiple of 8")


def test_an_inexact_gradient_accumulation_is_refused_not_clamped():
    """PaddleNLP warned and set gradient accumulation to 1; here 64 samples per rank in micro-batches of 3 is
    refused, and a micro-batch of 4 gives 16 (not 1)."""
    ok = plan_ppo_batches(64, 4, "256 samples", "4 samples/rank", world_size=4)
    assert (ok.mini_batch_samples_per_rank, ok.grad_accum, ok.optimizer_steps_per_rollout) == (64, 16, 1)
    assert refused(64, 4, "256 samples", "3 samples/rank", world_size=4) == (
        "micro_batch=3 samples/rank does not divide the mini-batch's 64 samples per rank (= 256 / 4); gradient "
        "accumulation would be 21.3333, not an integer (some tools clamp it silently to 1): use a micro-batch "
        "of 1, 2 or 4 samples/rank")
    # a micro-batch larger than the rank's share would be accumulation 0.5, which max(1, .) would hide
    assert "gradient accumulation would be 0.5" in refused(64, 4, "256 samples", "128 samples/rank", world_size=4)


def test_a_zero_mini_batch_is_refused():
    """verl #552: 2 prompts x n=1 // 8 GPUs normalised to a 0 mini-batch and split() looped forever."""
    assert refused(16, 1, "2 prompts", "1 samples/rank", world_size=8) == (
        "mini_batch=2 prompts (2 samples) does not split over dp=8 ranks; use a mini-batch of 8 or 16 samples "
        "(a multiple of 8 dividing 16)")
    ok = plan_ppo_batches(16, 1, "8 prompts", "1 samples/rank", world_size=8)
    assert (ok.mini_batch_samples_per_rank, ok.grad_accum, ok.mini_batches_per_epoch) == (1, 1, 2)
    # a mini-batch larger than the rollout would be zero mini-batches, i.e. zero optimizer steps
    assert refused(8, 2, "32 samples", "1 samples/rank", world_size=2).startswith(
        "mini_batch=32 samples is larger than the 16 samples of a rollout (= 8 prompts x 2): there would be 0 "
        "mini-batches, no optimizer step; use a mini-batch of 4, 8 or 16 samples")


@pytest.mark.parametrize("change", [
    {"mini_batch": "0 samples"}, {"mini_batch": "-4 samples"}, {"mini_batch": "0 prompts/rank"},
    {"micro_batch": "0 samples/rank"}, {"prompts_per_rollout": 0}, {"samples_per_prompt": 0},
    {"world_size": 0}, {"dp": 0}, {"ppo_epochs": 0}, {"rollouts": 0}, {"total_prompts": -8}])
def test_every_zero_or_negative_input_is_refused(change):
    args = {"prompts_per_rollout": 8, "samples_per_prompt": 2, "mini_batch": "8 samples",
            "micro_batch": "1 samples/rank", "world_size": 2, **change}
    msg = str(pytest.raises(ValueError, plan_ppo_batches, **args).value)
    assert "\n" not in msg and ("at least 1" in msg or "positive integer" in msg), msg


def test_lr_schedule_counts_optimizer_steps():
    """OpenRLHF #248: the schedule is rollouts x mini-batches x epochs optimizer steps. 8192 prompts in
    rollouts of 256 x n=16, mini-batches of 128 samples, 2 epochs: 32 x 32 x 2 = 2048, not 32 (rollouts)
    and not 262144 (samples)."""
    p = plan_ppo_batches(256, 16, "128 samples", "2 samples/rank", world_size=8, ppo_epochs=2, total_prompts=8192)
    assert (p.rollouts, p.mini_batches_per_epoch, p.optimizer_steps_per_rollout) == (32, 32, 64)
    assert p.lr_schedule_steps == 2048
    assert p.to_dict() == plan_ppo_batches(256, 16, "128 samples", "2 samples/rank", world_size=8, ppo_epochs=2,
                                           rollouts=32).to_dict() | {"derivation": p.derivation}
    assert refused(256, 16, "128 samples", "2 samples/rank", world_size=8, total_prompts=8000) == (
        "total_prompts=8000 is not a whole number of rollouts of 256 prompts (31.25); use 7936 or 8192")
    assert "disagrees" in refused(256, 16, "128 samples", "2 samples/rank", world_size=8, total_prompts=8192,
                                  rollouts=30)
    assert plan_ppo_batches(256, 16, "128 samples", "2 samples/rank", world_size=8).lr_schedule_steps is None


def test_whole_prompt_groups_on_every_rank():
    """GRPO normalises advantages per prompt group: with group_samples a rank's share holds whole groups."""
    p = plan_ppo_batches(16, 4, "16 samples", "2 samples/rank", world_size=4, group_samples=True)
    assert (p.mini_batch_samples_per_rank, p.grad_accum, p.mini_batch_prompts) == (4, 2, 4)
    assert plan_ppo_batches(16, 4, "8 samples", "1 samples/rank", world_size=4).mini_batch_prompts == 2
    assert refused(16, 4, "8 samples", "1 samples/rank", world_size=4, group_samples=True) == (
        "group_samples: each rank's 2 samples of mini_batch=8 samples split the 4 samples of a prompt; use a "
        "mini-batch of 16, 32 or 64 samples (a multiple of 4 x 4 ranks)")
    # 6 prompts cannot give 4 ranks whole groups whatever the mini-batch: the fix is the prompt count
    assert plan_ppo_batches(6, 4, "8 samples", "1 samples/rank", world_size=4).mini_batch_samples_per_rank == 2
    assert refused(6, 4, "8 samples", "1 samples/rank", world_size=4, group_samples=True) == (
        "group_samples: 6 prompts per rollout do not split into whole prompt groups over dp=4 ranks; use "
        "prompts_per_rollout a multiple of 4 (e.g. 8)")


def test_layout_and_size_errors_name_the_fix():
    assert refused(8, 2, "8 samples", "1 samples/rank", world_size=6, dp=4) == (
        "dp=4 does not divide world_size=6; the other parallel degrees (tp x pp) must make up world_size / dp: "
        "choose dp in {1, 2, 3, 6}")
    assert refused(3, 1, "3 samples", "1 samples/rank", world_size=6, dp=2) == (  # suggested dp divide world_size
        "samples per rollout 3 (= 3 prompts x 1) do not split over dp=2 ranks; use prompts_per_rollout a "
        "multiple of 2 (e.g. 4) or dp = 1 or 3")
    for spec, fix in [("8 tokens", "unit 'tokens' is unknown; use prompts or samples"),
                      ("8/gpu", "write '8 samples/rank' or '8 prompts/rank'"), (8, "write '8 samples' or '8 prompts'"),
                      ("8 samples/node", "scope 'node' is unknown"), ("eight", "is not a batch size")]:
        with pytest.raises(ValueError, match=fix):
            parse_batch_size(spec, "mini_batch")
    assert parse_batch_size("8 samples/gpu", "x") == BatchSize(8, "samples", "rank")
    assert parse_batch_size("2 prompts per rank", "x") == BatchSize(2, "prompts", "rank")
    assert parse_batch_size(" 12 sequences ", "x") == BatchSize(12, "samples", "global")


def test_plan_exports_its_derivation_with_units():
    p = plan_ppo_batches(64, 4, "64 prompts", "4 samples/rank", world_size=8, dp=4, ppo_epochs=2, rollouts=100)
    assert json.loads(p.to_json()) == p.to_dict()
    rows = p.to_frame().set_index("quantity")
    assert rows.loc["samples per rollout", "how"] == "64 prompts x 4 samples"
    assert tuple(rows.loc["gradient accumulation", ["value", "unit"]]) == (16, "micro-batches")
    assert tuple(rows.loc["LR schedule steps", ["value", "unit"]]) == (200, "steps")
    text = str(p)
    assert "256 samples" in text and "100 rollouts x 2 optimizer steps" in text
    assert "<td>micro-batches</td>" in p._repr_html_() and "given as &#x27;4 samples/rank&#x27;" in p._repr_html_()


def _size(draw, samples: int, n: int, dp: int) -> str:
    """Draw one spelling of a size of ``samples`` (global) among those that are whole numbers."""
    forms = [f"{samples} samples", f"{samples // dp} samples/rank"]
    if samples % n == 0:
        forms.append(f"{samples // n} prompts")
    if (samples // dp) % n == 0:
        forms.append(f"{samples // dp // n} prompts/rank")
    return draw(st.sampled_from(forms))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 8), dp=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2]),
       m=st.integers(1, 8), A=st.integers(1, 8), K=st.integers(1, 6), E=st.integers(1, 3), R=st.integers(1, 50))
def test_a_consistent_configuration_is_accepted_in_any_spelling(data, n, dp, tp, m, A, K, E, R):
    """Built from its answer (mini-batch = dp x A x m, rollout = K mini-batches of prompts): however the sizes
    are spelled (prompts or samples, global or per rank) the planner finds the same counts."""
    M = dp * A * m
    P = K * M  # then the rollout holds K x n mini-batches
    plan = plan_ppo_batches(P, n, _size(data.draw, M, n, dp), _size(data.draw, m * dp, n, dp),
                            world_size=dp * tp, dp=dp, ppo_epochs=E, rollouts=R)
    assert (plan.mini_batch_samples, plan.mini_batches_per_epoch, plan.grad_accum) == (M, K * n, A)
    assert (plan.micro_batch_samples_per_rank, plan.ranks_per_dp_rank) == (m, tp)
    assert plan.lr_schedule_steps == R * K * n * E


@settings(max_examples=200, deadline=None)
@given(P=st.integers(1, 64), n=st.integers(1, 8), dp=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2]),
       mb=st.integers(1, 256), mb_unit=st.sampled_from(["samples", "prompts", "samples/rank", "prompts/rank"]),
       micro=st.integers(1, 16), micro_unit=st.sampled_from(["samples/rank", "samples", "prompts/rank"]),
       E=st.integers(1, 3), R=st.integers(1, 50), group=st.booleans())
def test_every_accepted_plan_conserves_samples(P, n, dp, tp, mb, mb_unit, micro, micro_unit, E, R, group):
    try:
        p = plan_ppo_batches(P, n, f"{mb} {mb_unit}", f"{micro} {micro_unit}", world_size=dp * tp, dp=dp,
                             ppo_epochs=E, rollouts=R, group_samples=group)
    except ValueError as e:
        assert "\n" not in str(e) and any(w in str(e) for w in FIX_WORDS), str(e)
        return
    assert p.mini_batches_per_epoch * p.mini_batch_samples == p.samples_per_rollout == P * n
    assert p.mini_batch_samples_per_rank * p.dp == p.mini_batch_samples
    assert p.grad_accum * p.micro_batch_samples_per_rank * p.dp == p.mini_batch_samples
    assert p.mini_batch_samples == mb * (n if "prompts" in mb_unit else 1) * (dp if "rank" in mb_unit else 1)
    assert p.optimizer_steps_per_rollout == p.mini_batches_per_epoch * E and p.lr_schedule_steps == R * E * p.mini_batches_per_epoch
    if group:
        assert p.mini_batch_samples_per_rank % n == 0
    for v in (p.samples_per_rollout, p.rollout_samples_per_rank, p.mini_batch_samples, p.mini_batches_per_epoch,
              p.mini_batch_samples_per_rank, p.micro_batch_samples_per_rank, p.grad_accum,
              p.optimizer_steps_per_rollout, p.lr_schedule_steps):
        assert isinstance(v, int) and v >= 1


def _cli(capsys, *extra: str) -> tuple[int, str, str]:
    from workbench.cli import main

    code = main(["rl", "batch-plan", "--prompts", "64", "-n", "4", "--micro-batch", "4 samples/rank",
                 "--world-size", "8", "--dp", "4", "--ppo-epochs", "2", "--rollouts", "100", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_derivation_or_one_line(capsys):
    code, out, err = _cli(capsys, "--mini-batch", "64 prompts")
    assert code == 0 and err == ""
    assert "gradient accumulation" in out and "100 rollouts x 2 optimizer steps" in out
    code, out, _ = _cli(capsys, "--mini-batch", "64 prompts", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["status"] == "ok" and doc["lr_schedule_steps"] == 200 and doc["grad_accum"] == 16
    code, out, err = _cli(capsys, "--mini-batch", "96 samples")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: mini_batch=96 samples does not divide the 256 samples of a rollout")
    code, out, err = _cli(capsys, "--mini-batch", "96 samples", "--json")
    assert code == 2 and err == "" and json.loads(out)["status"] == "error"
    with pytest.raises(SystemExit) as exit_:  # rollout n is required: prompts x n = samples
        from workbench.cli import main
        main(["rl", "batch-plan", "--prompts", "64", "--mini-batch", "64 samples", "--micro-batch",
              "4 samples/rank", "--world-size", "8"])
    assert exit_.value.code == 2 and "--samples-per-prompt" in capsys.readouterr().err


def test_view_draws_the_hierarchy_and_keeps_the_last_plan_on_a_bad_edit():
    from workbench.display import view_for
    from workbench.widgets.rl_batch_view import hierarchy

    big = plan_ppo_batches(1024, 16, "1024 samples", "1 samples/rank", world_size=64)
    h = hierarchy(big)
    assert len(h["ids"]) < 40  # 16 mini-batches x 64 ranks x 16 micro-batches, folded
    by_id = dict(zip(h["ids"], h["values"]))
    for i in h["ids"]:  # every level's boxes sum to their parent (samples)
        kids = [by_id[c] for c, p in zip(h["ids"], h["parents"]) if p == i]
        assert not kids or sum(kids) == by_id[i], i
    view = view_for(plan_ppo_batches(64, 4, "64 samples", "4 samples/rank", world_size=4))
    assert view.replan(mini_batch="96 samples") is None and "does not divide" in view.message.value
    assert view.plan.mini_batch_samples == 64  # the last good plan is still drawn
    assert view.replan(mini_batch="128 samples").mini_batches_per_epoch == 2
    assert view.plan.lr_schedule_steps is None  # rollouts 0 in the form: no schedule asked for
    assert view.replan(rollouts=10).lr_schedule_steps == 20
    assert view.replan(group=True, mini_batch="8 samples") is None and "group_samples" in view.message.value
