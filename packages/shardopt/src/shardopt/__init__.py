"""Optimizer-state sharding (ZeRO stage 1) for any torch.optim.Optimizer."""

from shardopt.optimizer import ShardedOptimizer, StateOnRank, balanced_owners

__all__ = ["ShardedOptimizer", "StateOnRank", "balanced_owners"]
__version__ = "0.1.0"
