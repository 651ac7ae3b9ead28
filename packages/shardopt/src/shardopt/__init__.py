"""Optimizer-state sharding (ZeRO stage 1) for any torch.optim.Optimizer."""

__version__ = "0.1.0"
