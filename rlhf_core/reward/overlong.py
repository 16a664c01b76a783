"""DAPO's soft overlong punishment (arXiv 2503.14476, section 3.4), as an external reward of the rollout
worker: one column, `overlong`, added to the reward with weight 1 and logged as reward/overlong."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int, penalty: float) -> torch.Tensor:
    """The penalty of each response by its generated length.

    lengths: LongTensor [N] generated tokens. Returns FloatTensor [N]: 0 up to max_new_tokens - buffer_len
    tokens, then linear down to -penalty at max_new_tokens (-penalty beyond it)."""
    free = max_new_tokens - buffer_len
    over = (lengths.float() - free).clamp(min=0.0, max=float(buffer_len))
    return -penalty * over / buffer_len


class OverlongPenalty:
    """reward.overlong as an external reward: `weights` and `score(prompts, batch)`, the rollout worker's
    contract (rlhf_core.rollout.worker)."""

    weights = {"overlong": 1.0}

    def __init__(self, max_new_tokens: int, buffer_len: int, penalty: float):
        self.max_new_tokens, self.buffer_len, self.penalty = max_new_tokens, buffer_len, penalty

    def score(self, prompts, batch) -> dict[str, torch.Tensor]:
        lengths = batch.response_lengths
        return {"overlong": overlong_penalty(lengths, self.max_new_tokens, self.buffer_len, self.penalty)}
