"""Optimizer-state sharding (ZeRO stage 1) for per-parameter torch.optim optimizers."""

from shardopt.optimizer import ShardedOptimizer, StateOnRank, balanced_owners

__all__ = ["ShardedOptimizer", "StateOnRank", "balanced_owners"]
__version__ = "0.2.0"
