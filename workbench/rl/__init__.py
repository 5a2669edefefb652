"""Reinforcement-learning helpers: PPO batch sizing (:mod:`workbench.rl.batch_plan`)."""

from workbench.rl.batch_plan import BatchSize, PPOBatchPlan, parse_batch_size, plan_ppo_batches

__all__ = ["BatchSize", "PPOBatchPlan", "parse_batch_size", "plan_ppo_batches"]
