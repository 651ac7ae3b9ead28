"""Small, readable data-parallel wrappers over torch.distributed: naive, flat, overlapped and bucketed gradient all-reduce."""

__version__ = "0.1.0"
