"""``workbench rl batch-plan``: PPO batch sizes derived with units, or one line naming the fix.

    workbench rl batch-plan --prompts 64 --samples-per-prompt 4 --mini-batch "256 samples" \\
        --micro-batch "4 samples/rank" --world-size 8 --dp 4 --ppo-epochs 2 --rollouts 100 [--json]
"""

from __future__ import annotations

import argparse

from workbench.cli_output import emit_json, error


def add_parser(sub: argparse._SubParsersAction) -> None:
    from workbench.config import MAX_BATCH, MAX_STEPS
    from workbench.settings import bounded, ranks

    p = sub.add_parser("rl", help="reinforcement learning: PPO batch sizing",
                       description="Reinforcement-learning helpers.")
    rl = p.add_subparsers(dest="rl_command", required=True, parser_class=type(p))
    c = rl.add_parser("batch-plan", help="derive a PPO run's mini-batches, gradient accumulation and LR-schedule "
                      "steps, or say which size to change",
                      description="Derive a PPO run's batch hierarchy with units (prompts vs samples, global vs "
                      "per rank). Every ratio must divide exactly; nothing is clamped.")
    c.add_argument("--prompts", type=bounded("int", "prompts", min=1, limit=MAX_BATCH), required=True, metavar="P",
                   help="prompts per rollout (global)")
    c.add_argument("--samples-per-prompt", "-n", type=bounded("int", "samples_per_prompt", min=1, limit=1 << 16),
                   required=True, metavar="N",
                   help="responses sampled per prompt (rollout n; required: prompts x n = samples)")
    c.add_argument("--mini-batch", required=True, metavar="SIZE",
                   help="per optimizer step: e.g. '256 samples', '64 prompts', '32 samples/rank'")
    c.add_argument("--micro-batch", required=True, metavar="SIZE",
                   help="per forward/backward on one rank: e.g. '4 samples/rank' (or global: '16 samples')")
    c.add_argument("--world-size", type=ranks("world_size"), required=True,
                   metavar="W",
                   help="all ranks of the training job")
    c.add_argument("--dp", type=ranks("dp"), default=None, metavar="D",
                   help="data-parallel degree (default: world size; the rest are tp x pp ranks)")
    c.add_argument("--ppo-epochs", type=bounded("int", "ppo_epochs", min=1, limit=10_000), default=1, metavar="E",
                   help="passes over each rollout (default 1)")
    c.add_argument("--rollouts", type=bounded("int", "rollouts", min=1, limit=MAX_STEPS), default=None, metavar="R",
                   help="rollouts in the run (for the LR schedule)")
    c.add_argument("--total-prompts", type=bounded("int", "total_prompts", min=1, limit=MAX_BATCH * MAX_STEPS),
                   default=None, metavar="T",
                   help="or: prompts the run trains on (a multiple of --prompts)")
    c.add_argument("--group-samples", action="store_true",
                   help="mini-batches and each rank's share hold whole prompt groups (GRPO-style advantages)")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(func=cmd_batch_plan)


def cmd_batch_plan(args: argparse.Namespace) -> int:
    from workbench.rl.batch_plan import plan_ppo_batches

    try:
        plan = plan_ppo_batches(args.prompts, args.samples_per_prompt, args.mini_batch, args.micro_batch,
                                world_size=args.world_size, dp=args.dp, ppo_epochs=args.ppo_epochs,
                                rollouts=args.rollouts, total_prompts=args.total_prompts,
                                group_samples=args.group_samples)
    except ValueError as e:
        return error(str(e), args.json)
    if args.json:
        emit_json({"status": "ok", **plan.to_dict()})
    else:
        print(plan)
    return 0
