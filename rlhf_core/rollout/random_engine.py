"""RandomEngine: uniform random tokens at a configurable rate. For load tests and pipeline benchmarks ONLY.

It stands in for a real engine where generation cost must be controlled exactly:
it learns nothing and its "policy" never changes, but it honours the engine interface, versions and
weight loads, so the runtime around it is exercised for real.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.rollout.base import SamplingParams, as_stop_ids, response_mask_from_eos
from rlhf_core.types import RolloutBatch


class RandomEngine:
    def __init__(
        self,
        vocab_size: int,
        stop_token_ids: int | Sequence[int],
        pad_token_id: int,
        tokens_per_s: float = 0.0,
        seed: int = 0,
        version: int = 0,
        device: str | torch.device = "cpu",
    ):
        self.vocab_size = vocab_size
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = pad_token_id
        self.tokens_per_s = tokens_per_s
        self.version = version
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.weights_loaded = 0

    def load_weights(self, state_dict, version: int) -> None:
        self.weights_loaded += 1
        self.version = int(version)

    def generate(
        self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams, between_steps=None
    ) -> RolloutBatch:
        """between_steps: ignored (weights are taken between calls; they change nothing here anyway)."""
        start = time.perf_counter()
        G, T = samples_per_prompt, sampling.max_new_tokens
        N = len(prompts) * G
        tokens = torch.randint(0, self.vocab_size, (N, T), generator=self.generator, device=self.device)
        mask = response_mask_from_eos(tokens, self.stop_token_ids)
        tokens = tokens.masked_fill(~mask, self.pad_token_id)
        logp = torch.full((N, T), -float(torch.log(torch.tensor(float(self.vocab_size)))), device=self.device)
        logp = logp.masked_fill(~mask, 0.0)
        batch = RolloutBatch(
            prompt_ids=prompts.prompt_ids.to(self.device).repeat_interleave(G, 0),
            prompt_mask=prompts.prompt_mask.to(self.device).repeat_interleave(G, 0),
            response_ids=tokens,
            response_mask=mask,
            behavior_logprobs=logp,
            response_lengths=mask.sum(-1),
            group_ids=torch.arange(len(prompts), device=self.device).repeat_interleave(G),
            policy_version=torch.full((N,), self.version, dtype=torch.long, device=self.device),
            prompt_uids=prompts.uids.to(self.device).repeat_interleave(G),
        )
        if self.tokens_per_s > 0:  # simulate generation cost: sleep until the budget for these tokens is spent
            budget = batch.num_tokens / self.tokens_per_s
            remaining = budget - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)
        return batch
