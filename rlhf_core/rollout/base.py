"""The rollout-engine interface and sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.types import RolloutBatch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy decoding (behaviour logprobs are then the model's log-softmax at the
    argmax, temperature 1)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_config(cls, rollout_cfg) -> SamplingParams:
        return cls(rollout_cfg.max_new_tokens, rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RolloutEngine(Protocol):
    """Generates completions and swaps weights in place. Implementations: HFEngine, VLLMEngine, RandomEngine."""

    device: torch.device
    version: int

    def generate(self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams) -> RolloutBatch: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...


def processed_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The logits actually sampled from: temperature, then top-k, then top-p (filtered tokens at -inf).

    logits: FloatTensor [N, V]. Returns FloatTensor [N, V] (float32). Greedy decoding leaves them as they are.
    """
    logits = logits.float()
    if sampling.greedy:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token is always kept)
        drop_sorted = (probs.cumsum(-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from: temperature, then top-k, then top-p.

    logits: FloatTensor [N, V]. Returns FloatTensor [N, V] (filtered tokens at -inf). For greedy decoding
    these are the model's log-softmax (temperature 1, nothing filtered).
    """
    return torch.log_softmax(processed_logits(logits, sampling), dim=-1)
