"""Tensor descriptors for the host to build, built only when a launch needs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class Tiles(NamedTuple):
    """A descriptor moving `block` tiles of `tensor`, which build(tensor, block) makes: on a launch through
    Triton's JIT, or, launched directly, once per address (_launcher.LaunchArgs)."""

    tensor: torch.Tensor
    block: tuple[int, ...]
    build: Callable[[torch.Tensor, tuple[int, ...]], Any]

    def descriptor(self) -> Any:
        return self.build(self.tensor, self.block)
