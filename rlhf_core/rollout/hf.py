"""HFEngine: batched, left-padded generation with a KV cache on any transformers causal LM.

Behaviour logprobs come from the generation's own logits (no second forward pass), under the
distribution actually sampled from (temperature, min-p, top-k, top-p applied and renormalised:
`rollout.base.processed_logits`, which the trainer applies too).

Two ways to generate a call's rows:
- continuous batching (`continuous_batching=True`, the default): at most `max_active_rows` rows decode at
  once; a row that ends (a stop id or max_new_tokens) leaves the batch (its KV-cache rows are dropped) and a
  waiting row joins (its prompt is prefilled and its cache rows are appended, left-padded to the batch's
  cache width). Generation never waits for the longest row of a batch.
- batch at a time (`continuous_batching=False`): every row is computed until the longest one ends.

Partial rollouts: `generate(..., between_steps=fn)` calls fn() between decode steps; when it returns
(state_dict, version) the engine loads those weights and recomputes the active rows' KV cache under them
(a prefill of prompt + tokens so far), so every later token is sampled from exactly that version's
distribution; `RolloutBatch.token_versions` records the version that produced each token.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.model.lora import is_lora, load_adapter_state_dict
from rlhf_core.model.policy import eval_mode
from rlhf_core.rollout.base import (
    SamplingParams,
    as_stop_ids,
    processed_logits,
    response_mask_from_eos,
    sampling_logprobs,
)
from rlhf_core.rollout.hf_rows import (
    NO_CACHE_SURGERY,
    _ActiveRows,
    _layers_kv,
    _NoCacheSurgery,
    _supports_cache_surgery,
)
from rlhf_core.types import RolloutBatch

# between_steps(): None, or (state_dict or None, version) to adopt before the next decode step
WeightsHook = Callable[[], Optional[tuple]]


class HFEngine:
    """Generate with a Hugging Face model held in this process."""

    def __init__(
        self,
        model,
        stop_token_ids: int | Sequence[int],
        pad_token_id: int,
        seed: int = 0,
        version: int = 0,
        continuous_batching: bool = True,
        max_active_rows: Optional[int] = None,
    ):
        self.model = model
        self.continuous_batching = bool(continuous_batching)
        # rows decoding at once in continuous batching; None: every row of the call
        self.max_active_rows = None if max_active_rows is None else int(max_active_rows)
        if self.max_active_rows is not None and self.max_active_rows < 1:
            raise ValueError(f"rollout.engine_kwargs.max_active_rows must be at least 1, got {max_active_rows}")
        self.weight_updates = 0  # weights adopted between decode steps (partial rollouts)
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = int(pad_token_id)
        self.device = next(model.parameters()).device
        self.version = version
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # a peft model with several adapters (a shared fleet): the adapter of each sample row of the current
        # generate() call, passed to every forward as peft's `adapter_names` (mixed-adapter batches); None: the
        # active adapter for every row
        self.adapter_names: Optional[list[str]] = None
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

    def set_adapter(self, adapter: str) -> None:
        """The adapter of a peft model with several (a shared fleet) that calls without `adapter_names` use."""
        self.model.set_adapter(adapter)

    def load_adapter(self, adapter: str, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy one named adapter's tensors (rlhf_core.model.lora names) into the model in place."""
        load_adapter_state_dict(self.model, state_dict, adapter)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights into the model in place (no reallocation) and adopt their version. A LoRA model
        takes adapter tensors (rlhf_core.model.lora names) and keeps its base weights."""
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

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def probe_sample(self, ids: torch.Tensor, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The sync probe (rlhf_core.rollout.probe): one token sampled at temperature 1 after each of the last k
        prefixes of ids [B, T], with its log-prob: (tokens [B, k], log-probs [B, k]). A generator of its own
        (`seed`): the engine's sampling stream is not touched."""
        from rlhf_core.rollout.probe import sample_at_prefixes

        with eval_mode(self.model):
            T = ids.shape[1]
            logits = self.model(input_ids=ids[:, : T - 1].to(self.device)).logits[:, T - 1 - k :]
        return sample_at_prefixes(logits, seed)

    @torch.no_grad()
    def top_logprobs(self, prompt: list[int], ids: list[int], sampling: SamplingParams, k: int) -> list[list[tuple]]:
        """The k most likely tokens and their log-probs [(id, logprob), ...] at each position of the completion
        `ids` of `prompt`, under the distribution `sampling` samples from (one forward pass over prompt + ids)."""
        with eval_mode(self.model):
            x = torch.tensor([list(prompt) + list(ids)], device=self.device)
            logits = self.model(input_ids=x).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(ids)]
        values, index = sampling_logprobs(logits, sampling).topk(k, dim=-1)
        return [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]

    @torch.no_grad()
    def generate(
        self,
        prompts: PromptBatch,
        samples_per_prompt: int,
        sampling: SamplingParams,
        between_steps: Optional[WeightsHook] = None,
    ) -> RolloutBatch:
        """G completions per prompt (rows of one prompt contiguous), in eval mode. between_steps: see the module
        docstring (partial rollouts; it implies the continuous path, whose KV cache can be recomputed per row).
        Both paths decode the same rows (`_rows_of`) into (tokens, log-probs, versions) [N, T], made a batch by
        `_finish`."""
        G = samples_per_prompt
        prompt_ids, prompt_mask, stops = self._rows_of(prompts, G)
        decoded = None
        with eval_mode(self.model):
            if (self.continuous_batching or between_steps is not None) and _supports_cache_surgery(self.model):
                try:
                    decoded = self._decode_continuous(prompt_ids, prompt_mask, stops, sampling, between_steps)
                except _NoCacheSurgery as e:  # found at the first prefill, before anything is sampled
                    self.model._atrlhf_cache_surgery = False
                    warnings.warn(NO_CACHE_SURGERY.format(e), RuntimeWarning, stacklevel=2)
            tokens, logps, versions = decoded or self._decode_batch(prompt_ids, prompt_mask, stops, sampling)
        return self._finish(prompts, G, prompt_ids, prompt_mask, tokens, logps, versions, stops)

    def _decode_batch(self, prompt_ids, prompt_mask, stops, sampling: SamplingParams) -> tuple:
        """Every row computed until the longest one ends."""
        dev = self.device
        N, P = prompt_ids.shape
        T = sampling.max_new_tokens

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
            **self._adapters(),
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
            tok, tok_logp = self._sample(next_logits, sampling)
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
                **self._adapters(),
            )
            past = self._cache_of(out)
            next_logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        return tokens, logps, torch.full(tokens.shape, self.version, dtype=torch.long, device=dev)

    def _decode_continuous(self, prompt_ids, prompt_mask, stops, sampling: SamplingParams, between_steps) -> tuple:
        """At most max_active_rows rows decoding at once, a row leaving as it ends and a waiting one joining;
        between_steps' weights adopted between decode steps."""
        dev = self.device
        N = prompt_ids.shape[0]
        T = sampling.max_new_tokens
        limit = min(N, self.max_active_rows or N)
        # one extra column: a row that has ended writes there until it leaves the batch (no host sync per step)
        tokens = torch.full((N, T + 1), self.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((N, T + 1), dtype=torch.float32, device=dev)
        versions = torch.full((N, T + 1), self.version, dtype=torch.long, device=dev)
        prompt_lens = prompt_mask.sum(-1)
        rows = _ActiveRows(dev)
        waiting = 0  # rows [waiting, N) have not started; they start in order
        # with an accelerator, ended rows are looked for every few steps (a device -> host sync)
        check_every = 1 if dev.type == "cpu" else 8
        step = 0
        while True:
            if rows.size < limit and waiting < N:
                joiners = torch.arange(waiting, min(N, waiting + limit - rows.size), device=dev)
                waiting += len(joiners)
                zeros = torch.zeros_like(joiners)
                self._join(rows, joiners, zeros, zeros.bool(), prompt_ids, prompt_mask, prompt_lens, tokens)
            if rows.size == 0:
                break
            if between_steps is not None:
                update = between_steps()
                if update is not None:
                    self.load_weights(update[0], update[1])
                    self.weight_updates += 1
                    # every active row's cache was computed under the old weights: recompute it under the new
                    rows.keep(~rows.ended)
                    sample, count, ended = rows.take_all()
                    self._join(rows, sample, count, ended, prompt_ids, prompt_mask, prompt_lens, tokens)
                    if rows.size == 0:
                        continue
            tok, tok_logp = self._sample(self._decode(rows), sampling)
            col = rows.count.masked_fill(rows.ended, T)
            tokens.index_put_((rows.sample, col), tok)
            logps.index_put_((rows.sample, col), tok_logp)
            versions.index_put_((rows.sample, col), torch.full_like(col, self.version))
            rows.count += (~rows.ended).long()
            rows.ended |= torch.isin(tok, stops) | (rows.count >= T)
            rows.next_token = tok
            rows.next_pos = rows.next_pos + 1
            step += 1
            if step % check_every == 0 and bool(rows.ended.any()):
                rows.keep(~rows.ended)
        return tokens[:, :T], logps[:, :T], versions[:, :T]

    def _rows_of(self, prompts: PromptBatch, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both generation paths' rows: each prompt's ids and mask G times (rows of one prompt contiguous) on the
        device, and the stop token ids there."""
        dev = self.device
        prompt_ids = prompts.prompt_ids.to(dev).repeat_interleave(G, 0)
        prompt_mask = prompts.prompt_mask.to(dev).repeat_interleave(G, 0)
        return prompt_ids, prompt_mask, torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [N], its log-prob [N]) of each row from its next-token logits, under the sampling settings. One
        softmax pass serves sampling and the log-prob (the log of the sampled probability): the same per-step work
        as transformers' own sampler; filtered tokens have p = 0 exactly."""
        z = processed_logits(logits, sampling)
        if sampling.greedy:
            tok = z.argmax(-1)
            return tok, z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        probs = torch.softmax(z, dim=-1)
        tok = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return tok, probs.gather(-1, tok[:, None]).log_().squeeze(-1)

    def _finish(self, prompts, G, prompt_ids, prompt_mask, tokens, logps, versions, stops) -> RolloutBatch:
        """The batch both generation paths return: responses cut to the longest one, the mask authoritative (pad
        and log-prob 0 after the stop), each row's policy_version the oldest weights that produced one of its
        tokens (padding carries that version too)."""
        dev = self.device
        response_mask = response_mask_from_eos(tokens, stops)
        lengths = response_mask.sum(-1)
        steps = max(1, int(lengths.max())) if len(tokens) else 0  # columns past the longest are all padding
        tokens, logps, response_mask = tokens[:, :steps], logps[:, :steps], response_mask[:, :steps]
        tokens = tokens.masked_fill(~response_mask, self.pad_token_id)
        logps = logps.masked_fill(~response_mask, 0.0)
        versions = versions[:, :steps]
        policy_version = torch.full((len(tokens),), self.version, dtype=torch.long, device=dev)
        if steps:  # no rows: no tokens to be older than this version
            oldest = versions.masked_fill(~response_mask, torch.iinfo(torch.long).max).amin(-1)
            policy_version = torch.where(lengths > 0, oldest, policy_version)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=tokens,
            response_mask=response_mask,
            behavior_logprobs=logps,
            response_lengths=lengths,
            group_ids=torch.arange(len(prompts), device=dev).repeat_interleave(G),
            policy_version=policy_version,
            prompt_uids=prompts.uids.to(dev).repeat_interleave(G),
            token_versions=torch.where(response_mask, versions, policy_version[:, None]),
        )

    def _join(self, rows, samples, count, ended, prompt_ids, prompt_mask, prompt_lens, tokens) -> None:
        """Prefill rows `samples` (LongTensor [j]): each row's prompt and the `count` tokens it has generated so
        far, all but the last token, which is the input of the next decode step; then add them to `rows`.
        A new row has count 0 (its last prompt token is the next input); a row whose cache is recomputed under
        new weights has its tokens so far."""
        if len(samples) == 0:
            return
        P = prompt_ids.shape[1]
        C = int(count.max())
        # each row's real tokens are contiguous (a suffix of its prompt row, then a prefix of its tokens):
        # right-align them in one left-padded [j, width] block
        seq_ids = torch.cat([prompt_ids[samples], tokens[samples, :C]], 1)
        lens = prompt_lens[samples] + count
        width = int(lens.max())
        start = P - prompt_lens[samples]  # first real column of each row in seq_ids
        offset = torch.arange(width, device=self.device)[None, :] - (width - lens)[:, None]  # < 0: padding
        src = (start[:, None] + offset).clamp_(min=0, max=seq_ids.shape[1] - 1)
        ids = seq_ids.gather(1, src).masked_fill_(offset < 0, self.pad_token_id)
        mask = (offset >= 0).long()
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = None
        if width > 1:
            out = self.model(
                input_ids=ids[:, :-1],
                attention_mask=mask[:, :-1],
                position_ids=positions[:, :-1],
                use_cache=True,
                **self._last_logits_only,
                **self._adapters(samples),
            )
            cache = _layers_kv(self._cache_of(out))
        rows.add(samples, cache, mask[:, :-1], ids[:, -1], lens - 1, count, ended)

    def _decode(self, rows) -> torch.Tensor:
        """One decode step of every active row: its next input token in, the next token's logits [B, V] out."""
        attn = torch.cat([rows.mask, torch.ones_like(rows.mask[:, :1])], 1)
        out = self.model(
            input_ids=rows.next_token[:, None],
            attention_mask=attn,
            position_ids=rows.next_pos[:, None],
            use_cache=True,
            **{self._cache_kw: rows.cache},
            **self._adapters(rows.sample),
        )
        rows.cache = self._cache_of(out)
        rows.mask = attn
        return out.logits[:, -1, :]

    def _adapters(self, samples: Optional[torch.Tensor] = None) -> dict:
        """peft's `adapter_names` for a forward of sample rows `samples` (default: every row), where the call is a
        mixed-adapter batch (`adapter_names`); else no argument."""
        if self.adapter_names is None:
            return {}
        if samples is None:
            return {"adapter_names": self.adapter_names}
        return {"adapter_names": [self.adapter_names[i] for i in samples.tolist()]}

    @staticmethod
    def _cache_of(out):
        # transformers 5 returns the KV cache as `cache` (`past_key_values` is a deprecated alias there)
        cache = getattr(out, "cache", None) if "cache" in out else None
        return cache if cache is not None else out.past_key_values
