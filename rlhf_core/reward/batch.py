"""The whole reward of a rollout batch, as a rollout worker's episode runners score it (`BatchReward`): the
tensor-native reward on the engine's device plus the external rewards (Python reward functions in their process
pool, a reward model), each by its weight."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.reward.components import prepare_patterns
from rlhf_core.types import RolloutBatch


class BatchReward:
    """`reward(rows, patterns, repeats, batch) -> (rewards [N], components)`: the rows of `batch` are completions of
    `rows` (prompts, row-aligned); `patterns` are the prompts' answer patterns, each repeated `repeats` times.

    External rewards each have `weights: dict[str, float]` and `score(prompts, batch) -> dict[str, FloatTensor[N]]`;
    Σ weight × score is added to the rewards (a row a score does not apply to, NaN, adds 0) and each name becomes a
    reward component after the tensor-native ones."""

    def __init__(self, reward_fn, external: Sequence = ()):
        self.reward_fn = reward_fn
        self.external = list(external)

    def __call__(self, rows: Sequence, patterns, repeats: int, batch: RolloutBatch):
        patterns = prepare_patterns(self.reward_fn, patterns)  # on the host, once per prompt batch
        return self.scored(rows, batch, patterns.to(batch.response_ids.device).repeat_interleave(repeats))

    def scored(self, rows: Sequence, batch: RolloutBatch, patterns):
        """(rewards [N], components) of `batch` with `patterns` prepared already, one per row (the evaluator's)."""
        rewards, components = self.reward_fn(batch.response_ids, patterns)
        if self.external:
            components = dict(components)
            for source in self.external:
                for name, values in source.score(rows, batch).items():
                    values = values.to(rewards.device, torch.float32)
                    weight = source.weights.get(name)
                    if weight:
                        rewards = rewards + weight * torch.nan_to_num(values, nan=0.0)
                    components[name] = values
        return rewards, components
