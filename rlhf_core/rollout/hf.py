"""HFEngine: batched, left-padded generation with a KV cache on any transformers causal LM.

Behaviour logprobs come from the generation's own logits (no second forward pass), under the
distribution actually sampled from (temperature, min-p, top-k, top-p applied and renormalised:
`rollout.base.processed_logits`, which the trainer applies too).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.lora import is_lora, load_adapter_state_dict
from rlhf_core.rollout.base import SamplingParams, processed_logits
from rlhf_core.types import RolloutBatch


class HFEngine:
    """Generate with a Hugging Face model held in this process."""

    def __init__(self, model, stop_token_ids: int | Sequence[int], pad_token_id: int, seed: int = 0, version: int = 0):
        self.model = model
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = int(pad_token_id)
        self.device = next(model.parameters()).device
        self.version = version
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # transformers 5 renamed the KV-cache argument from `past_key_values` to `cache`
        # (a peft model's forward passes keyword arguments through to its base model's)
        base = model.get_base_model() if is_lora(model) else model
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the prompt pass needs logits at the last position only (saves N x P x V of work, as generate() does)
        self._last_logits_only = (
            {"logits_to_keep": 1}
            if "logits_to_keep" in params
            else {"num_logits_to_keep": 1}
            if "num_logits_to_keep" in params
            else {}
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights into the model in place (no reallocation) and adopt their version. A LoRA model
        takes adapter tensors (rlhf_core.lora names) and keeps its base weights."""
        if state_dict is not None and is_lora(self.model):
            load_adapter_state_dict(self.model, state_dict)
        elif state_dict is not None:
            # remove_duplicate=False: a full state_dict names tied weights twice (lm_head + embeddings)
            params = dict(self.model.named_parameters(remove_duplicate=False))
            params.update(dict(self.model.named_buffers(remove_duplicate=False)))
            missing = [k for k in state_dict if k not in params]
            if missing:
                raise KeyError(f"weights for unknown parameters {missing[:5]} (and {max(0, len(missing) - 5)} more)")
            with torch.no_grad():
                for name, tensor in state_dict.items():
                    params[name].copy_(tensor, non_blocking=True)
        self.version = int(version)

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams) -> RolloutBatch:
        G = samples_per_prompt
        dev = self.device
        prompt_ids = prompts.prompt_ids.to(dev).repeat_interleave(G, 0)
        prompt_mask = prompts.prompt_mask.to(dev).repeat_interleave(G, 0)
        N, P = prompt_ids.shape
        T = sampling.max_new_tokens
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)
        was_training = self.model.training
        self.model.eval()

        # One attention mask for prompt + every response position, allocated once; step t sees a prefix
        # view of it (no per-step torch.cat). Generated positions are all attended to: a finished row's
        # padding after EOS is never read, as its tokens are discarded.
        attn = torch.ones((N, P + T), dtype=torch.long, device=dev)
        attn[:, :P] = prompt_mask
        positions = (attn[:, :P].cumsum(-1) - 1).clamp_(min=0)
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=attn[:, :P],
            position_ids=positions,
            use_cache=True,
            **self._last_logits_only,
        )
        past = self._cache_of(out)
        next_logits = out.logits[:, -1, :]
        next_pos = positions[:, -1:] + 1

        tokens = torch.full((N, T), self.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((N, T), dtype=torch.float32, device=dev)
        finished = torch.zeros(N, dtype=torch.bool, device=dev)
        # Stopping early when every row has ended needs a device->host sync; on an accelerator it is only
        # checked every few steps so that the host can queue kernels ahead.
        check_every = 1 if dev.type == "cpu" else 8
        for t in range(T):
            z = processed_logits(next_logits, sampling)
            if sampling.greedy:
                tok = z.argmax(-1)
                tok_logp = z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
            else:
                # one softmax pass serves sampling and the logprob (log of the N sampled probabilities):
                # the same per-step work as transformers' own sampler; filtered tokens have p = 0 exactly
                probs = torch.softmax(z, dim=-1)
                tok = torch.multinomial(probs, 1, generator=self.generator)
                tok_logp = probs.gather(-1, tok).log_().squeeze(-1)
                tok = tok.squeeze(-1)
            tokens[:, t] = tok.masked_fill(finished, self.pad_token_id)
            logps[:, t] = tok_logp.masked_fill(finished, 0.0)
            finished |= torch.isin(tok, stops)
            if t == T - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):
                break
            out = self.model(
                input_ids=tokens[:, t : t + 1],
                attention_mask=attn[:, : P + t + 1],
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_kw: past},
            )
            past = self._cache_of(out)
            next_logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        if was_training:
            self.model.train()

        response_mask = response_mask_from_eos(tokens, stops)
        lengths = response_mask.sum(-1)
        steps = max(1, int(lengths.max())) if N else 0  # columns past the longest response are all padding
        tokens, logps, response_mask = tokens[:, :steps], logps[:, :steps], response_mask[:, :steps]
        # rows that finished early have pad after EOS already; make the mask authoritative
        tokens = tokens.masked_fill(~response_mask, self.pad_token_id)
        logps = logps.masked_fill(~response_mask, 0.0)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=tokens,
            response_mask=response_mask,
            behavior_logprobs=logps,
            response_lengths=lengths,
            group_ids=torch.arange(len(prompts), device=dev).repeat_interleave(G),
            policy_version=torch.full((N,), self.version, dtype=torch.long, device=dev),
            prompt_uids=prompts.uids.to(dev).repeat_interleave(G),
        )

    @staticmethod
    def _cache_of(out):
        # transformers 5 returns the KV cache as `cache` (`past_key_values` is a deprecated alias there)
        cache = getattr(out, "cache", None) if "cache" in out else None
        return cache if cache is not None else out.past_key_values


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
