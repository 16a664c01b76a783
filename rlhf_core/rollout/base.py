"""The rollout-engine interface, sampling parameters and the stop-set helpers every engine shares."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.types import RolloutBatch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy decoding (behaviour logprobs are then the model's log-softmax at the
    argmax, temperature 1). The filters apply in vLLM's order: temperature, min-p, top-k, top-p (see
    `removed_tokens`)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @classmethod
    def from_config(cls, rollout_cfg) -> SamplingParams:
        return cls(
            rollout_cfg.max_new_tokens,
            rollout_cfg.temperature,
            rollout_cfg.top_p,
            rollout_cfg.top_k,
            getattr(rollout_cfg, "min_p", 0.0),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether sampling removes tokens (top-k, top-p or min-p), i.e. the sampled distribution is not the
        model's softmax at this temperature."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


class RolloutEngine(Protocol):
    """Generates completions and swaps weights in place. Implementations: HFEngine, VLLMEngine, RandomEngine.

    `between_steps` (partial rollouts): None, or a callable that returns None or (state_dict, version) to adopt;
    an engine that can adopt weights mid-generation (HF, vLLM) calls it between decode steps and loads what it
    returns; one that cannot (random, a shared fleet's adapter view) ignores it and takes weights between
    generate() calls only."""

    device: torch.device
    version: int

    def generate(
        self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams, between_steps=None
    ) -> RolloutBatch: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...


TOP_P_CHUNK_ELEMENTS = 1 << 26  # logits sorted at once by the top-p filter (~0.8 GB of sort temporaries)


@torch.no_grad()
def removed_tokens(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor | None:
    """Which tokens sampling removes, given temperature-scaled logits: True where a token is filtered out.

    logits: FloatTensor [..., V] already divided by the temperature. Returns BoolTensor [..., V], or None when
    `sampling` filters nothing. The filters follow vLLM's sampler, in its order: min-p (drop a token whose
    probability is below min_p x the largest), top-k (keep the k largest logits, ties at the k-th included),
    then top-p over what is left, renormalised (drop a token when the mass of the tokens before it, in
    descending order, already reaches top_p; the first token is always kept). min-p and top-k commute; top-p
    comes last. The set depends on the logits only: the engine (on the logits it samples from) and the
    trainer (on its current logits) call this same function. No gradient flows through the set.
    """
    if not sampling.truncates:
        return None
    V = logits.shape[-1]
    drop = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    if sampling.min_p > 0.0:  # p_i < min_p * p_max  <=>  z_i < z_max + log(min_p)
        drop |= logits < logits.amax(-1, keepdim=True) + math.log(sampling.min_p)
    if sampling.top_k and sampling.top_k < V:
        drop |= logits < torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
    if sampling.top_p < 1.0:
        # the sort's temporaries (values + int64 indices) are 3x the logits: over the trainer's [rows, L, V]
        # they are bounded by sorting TOP_P_CHUNK_ELEMENTS at a time (the result is the same)
        flat_logits, flat_drop = logits.reshape(-1, V), drop.view(-1, V)
        rows = max(1, TOP_P_CHUNK_ELEMENTS // V)
        for start in range(0, flat_logits.shape[0], rows):
            z = flat_logits[start : start + rows]
            d = flat_drop[start : start + rows]
            sorted_logits, order = torch.sort(z.masked_fill(d, float("-inf")), dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop_sorted = (probs.cumsum(-1) - probs) >= sampling.top_p
            d |= torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return drop


def processed_logits(logits: torch.Tensor, sampling: SamplingParams, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The logits actually sampled from: temperature, then min-p, top-k, top-p (filtered tokens at -inf).

    logits: FloatTensor [..., V]. keep: optional LongTensor [...] of one token id per position that stays in
    the support whatever the filters say (the trainer passes the tokens that were sampled, so that a token
    an older policy sampled keeps a finite log-probability under the current one; on-policy it is inside
    the set anyway). Returns FloatTensor [..., V] (float32), differentiable with respect to `logits` through
    the kept entries. Greedy decoding leaves the logits as they are.
    """
    logits = logits.float()
    if sampling.greedy:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    drop = removed_tokens(logits.detach(), sampling)
    if drop is None:
        return logits
    if keep is not None:
        drop = drop.scatter(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(drop, float("-inf"))


def sampling_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from: temperature, then min-p, top-k, top-p.

    logits: FloatTensor [..., V]. Returns FloatTensor [..., V] (filtered tokens at -inf). For greedy decoding
    these are the model's log-softmax (temperature 1, nothing filtered).
    """
    return torch.log_softmax(processed_logits(logits, sampling), dim=-1)


def as_stop_ids(stop_token_ids: int | Sequence[int]) -> list[int]:
    """A stop set as a non-empty list of ints (one int is a set of one)."""
    ids = [int(stop_token_ids)] if isinstance(stop_token_ids, int) else [int(i) for i in stop_token_ids]
    if not ids:
        raise ValueError("the stop set is empty: a response could never end")
    return ids


def response_mask_from_eos(tokens: torch.Tensor, stop_token_ids: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """True up to and including the first stop token of each row (all True where there is none).

    tokens: LongTensor [N, L]; stop_token_ids: an id, a list of ids or a LongTensor of them. Returns [N, L]."""
    stops = torch.as_tensor(stop_token_ids, dtype=tokens.dtype, device=tokens.device).reshape(-1)
    is_eos = torch.isin(tokens, stops).long()
    return (is_eos.cumsum(-1) - is_eos) == 0  # no EOS strictly before this position
