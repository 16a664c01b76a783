"""Lookups in 1-D tables, and small constant tables copied to a device once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_CACHE: dict = {}


def lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for a 1-D table and non-negative idx of any shape (index_select: faster than take on CPU)."""
    return table.index_select(0, idx.reshape(-1)).view(idx.shape)


def cached(key, make: Callable[[], Any]):
    """The constant made by make() for `key` (which names the device), made the first time it is asked for."""
    c = _CACHE.get(key)
    if c is None:
        c = _CACHE[key] = make()
    return c
