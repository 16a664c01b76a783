"""Held-out evaluation: greedy decoding on prompts never trained on, scored by the run's own reward.

`eval/accuracy` is the fraction of held-out prompts whose greedy answer the reward calls correct: the
first answer-checking component configured (exact_match, answer_after_marker, contains), else a total
reward above 0. `eval/reward_mean` is the mean total reward of those answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from rlhf_core.data import Prompt, collate_prompts
from rlhf_core.rollout import SamplingParams

# Reward components that say whether the answer is right, in order of preference, for eval/accuracy.
ACCURACY_COMPONENTS = ("exact_match", "answer_after_marker", "contains")


def accuracy_from_components(total: torch.Tensor, components: dict[str, torch.Tensor]) -> torch.Tensor:
    """1/0 correctness per row [N]: the first answer-checking component configured, else total reward > 0."""
    for name in ACCURACY_COMPONENTS:
        if name in components:
            return (components[name] > 0).float()
    return (total > 0).float()


@torch.no_grad()
def evaluate(
    engine,
    prompts: Sequence[Prompt],
    reward_fn,
    pad_token_id: int,
    max_new_tokens: int,
    batch_size: int = 256,
    max_prompt_tokens: Optional[int] = None,
) -> dict:
    """Greedy decoding on `prompts` with `engine`: eval/accuracy and eval/reward_mean."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    correct, reward_sum, n = 0.0, 0.0, 0
    for s in range(0, len(prompts), batch_size):
        pb = collate_prompts(prompts[s : s + batch_size], pad_token_id, max_prompt_tokens)
        batch = engine.generate(pb, 1, greedy)
        total, components = reward_fn(batch.response_ids, pb.patterns.to(batch.response_ids.device))
        correct += float(accuracy_from_components(total, components).sum())
        reward_sum += float(total.sum())
        n += len(pb)
    return {"eval/accuracy": correct / max(1, n), "eval/reward_mean": reward_sum / max(1, n)}


@dataclass
class Evaluator:
    """Everything held-out evaluation needs, bound once: `evaluator()` scores the engine's current weights."""

    engine: object
    prompts: list[Prompt]
    reward_fn: object
    pad_token_id: int
    max_new_tokens: int
    max_prompt_tokens: Optional[int] = None

    def __call__(self) -> dict:
        return evaluate(
            self.engine,
            self.prompts,
            self.reward_fn,
            self.pad_token_id,
            self.max_new_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
        )
