"""The learning-rate schedule: linear warmup, then constant or cosine."""

from __future__ import annotations

import math


def build_lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Multiplier of the peak lr at a step: linear warmup, then constant or cosine down to min_lr_ratio."""

    def fn(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn
