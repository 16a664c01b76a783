"""The one call into a rollout engine, from every runner (single-turn, an environment's turns, the agent endpoint's
batches): kept out of base.py, whose sampling helpers the engines themselves call."""

from __future__ import annotations

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.rollout.base import SamplingParams


def generate(engine, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams, between_steps=None):
    """engine.generate, passing `between_steps` only when there is one (an engine written before it was part of the
    protocol still generates whenever partial rollouts are off)."""
    if between_steps is None:
        return engine.generate(prompts, samples_per_prompt, sampling)
    return engine.generate(prompts, samples_per_prompt, sampling, between_steps=between_steps)
