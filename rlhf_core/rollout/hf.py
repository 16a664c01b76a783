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
from rlhf_core.rollout.base import SamplingParams, as_stop_ids, processed_logits, response_mask_from_eos
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

    def generate(
        self,
        prompts: PromptBatch,
        samples_per_prompt: int,
        sampling: SamplingParams,
        between_steps: Optional[WeightsHook] = None,
    ) -> RolloutBatch:
        """G completions per prompt (rows of one prompt contiguous). between_steps: see the module docstring
        (partial rollouts; it implies the continuous path, whose KV cache can be recomputed per row)."""
        if (self.continuous_batching or between_steps is not None) and _supports_cache_surgery(self.model):
            was_training = self.model.training
            try:
                return self._generate_continuous(prompts, samples_per_prompt, sampling, between_steps)
            except _NoCacheSurgery as e:  # found at the first prefill, before anything is sampled
                self.model.train(was_training)
                self.model._atrlhf_cache_surgery = False
                warnings.warn(NO_CACHE_SURGERY.format(e), RuntimeWarning, stacklevel=2)
        return self._generate_batch(prompts, samples_per_prompt, sampling)

    @torch.no_grad()
    def _generate_batch(self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams) -> RolloutBatch:
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
            token_versions=torch.full(tokens.shape, self.version, dtype=torch.long, device=dev),
        )

    @torch.no_grad()
    def _generate_continuous(
        self,
        prompts: PromptBatch,
        samples_per_prompt: int,
        sampling: SamplingParams,
        between_steps: Optional[WeightsHook] = None,
    ) -> RolloutBatch:
        G = samples_per_prompt
        dev = self.device
        prompt_ids = prompts.prompt_ids.to(dev).repeat_interleave(G, 0)
        prompt_mask = prompts.prompt_mask.to(dev).repeat_interleave(G, 0)
        N, P = prompt_ids.shape
        T = sampling.max_new_tokens
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)
        limit = min(N, self.max_active_rows or N)
        was_training = self.model.training
        self.model.eval()
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
            logits = self._decode(rows)
            z = processed_logits(logits, sampling)
            if sampling.greedy:
                tok = z.argmax(-1)
                tok_logp = z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
            else:
                probs = torch.softmax(z, dim=-1)
                tok = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
                tok_logp = probs.gather(-1, tok[:, None]).log_().squeeze(-1)
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
        if was_training:
            self.model.train()
        tokens, logps, versions = tokens[:, :T], logps[:, :T], versions[:, :T]
        response_mask = response_mask_from_eos(tokens, stops)
        lengths = response_mask.sum(-1)
        steps = max(1, int(lengths.max())) if N else 0
        tokens, logps, response_mask = tokens[:, :steps], logps[:, :steps], response_mask[:, :steps]
        tokens = tokens.masked_fill(~response_mask, self.pad_token_id)
        logps = logps.masked_fill(~response_mask, 0.0)
        versions = versions[:, :steps]
        # the oldest weights that produced a token of the row; padding carries that version too
        oldest = versions.masked_fill(~response_mask, torch.iinfo(torch.long).max).amin(-1)
        policy_version = torch.where(lengths > 0, oldest, self.version) if steps else oldest
        versions = torch.where(response_mask, versions, policy_version[:, None])
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
            token_versions=versions,
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
        )
        rows.cache = self._cache_of(out)
        rows.mask = attn
        return out.logits[:, -1, :]

    @staticmethod
    def _cache_of(out):
        # transformers 5 returns the KV cache as `cache` (`past_key_values` is a deprecated alias there)
        cache = getattr(out, "cache", None) if "cache" in out else None
        return cache if cache is not None else out.past_key_values


NO_CACHE_SURGERY = (
    "this model's KV cache ({}) is not a DynamicCache of full-attention layers, whose rows can be edited: generating "
    "batch at a time, so rollout.engine_kwargs.continuous_batching has no effect, and partial rollouts "
    "(rollout.partial_rollout) adopt new weights only between generation calls (a multi-turn trajectory's between "
    "its turns), never within one"
)


class _NoCacheSurgery(Exception):
    """The model's KV cache is not one whose rows can be dropped and appended (continuous batching)."""


def _supports_cache_surgery(model) -> bool:
    """Whether continuous batching may be used: False once a model's cache turned out not to be a plain
    DynamicCache of full-attention layers (sliding windows, recurrent state)."""
    return getattr(model, "_atrlhf_cache_surgery", True)


def _layers_kv(cache):
    """The cache object, checked to be a DynamicCache whose every layer is a plain DynamicLayer."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or not all(type(layer) is DynamicLayer for layer in layers):
        raise _NoCacheSurgery(type(cache).__name__)
    return cache


class _ActiveRows:
    """The rows decoding together: which sample each is, its tokens so far, its next input token and position,
    its KV-cache rows and their attention mask [B, S] (each row's cache is left-padded to the common width S)."""

    def __init__(self, device: torch.device):
        empty = torch.zeros(0, dtype=torch.long, device=device)
        self.sample, self.count, self.next_token, self.next_pos = empty, empty, empty, empty
        self.ended = torch.zeros(0, dtype=torch.bool, device=device)
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.cache = None

    @property
    def size(self) -> int:
        return self.sample.shape[0]

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the rows where `keep` is True (BoolTensor [B]); drop cache columns no remaining row attends to."""
        idx = keep.nonzero().squeeze(-1)
        for name in ("sample", "count", "next_token", "next_pos", "ended", "mask"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        if self.size == 0:
            self.mask, self.cache = self.mask[:, :0], None
            return
        used = self.mask.any(0)
        first = int(used.long().argmax()) if bool(used.any()) else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
                layer.values = layer.values.index_select(0, idx)[:, :, first:]

    def take_all(self):
        """Remove every row; returns (sample, count, ended) of the rows removed."""
        taken = (self.sample, self.count, self.ended)
        self.keep(torch.zeros_like(self.ended))
        return taken

    def add(self, samples, cache, cache_mask, next_token, next_pos, count, ended) -> None:
        """Append rows whose prefill produced `cache` (or None: nothing prefilled) with mask [j, W]."""
        S, W = self.mask.shape[1], cache_mask.shape[1]
        width = max(S, W)
        own = self.cache if S > 0 and self.size > 0 else None
        new = cache if W > 0 else None
        if own is not None or new is not None:
            merged = own if own is not None else new
            ref = (own if own is not None else new).layers
            for i, layer in enumerate(merged.layers):
                ks, vs = [], []
                for c, n in ((own, self.size), (new, len(samples))):
                    if n == 0:
                        continue
                    k0, v0 = ref[i].keys, ref[i].values
                    if c is None:
                        k = k0.new_zeros((n, k0.shape[1], width, k0.shape[3]))
                        v = v0.new_zeros((n, v0.shape[1], width, v0.shape[3]))
                    else:
                        k, v = c.layers[i].keys, c.layers[i].values
                        if k.shape[2] < width:
                            pad = width - k.shape[2]
                            k = torch.cat([k.new_zeros((*k.shape[:2], pad, k.shape[3])), k], 2)
                            v = torch.cat([v.new_zeros((*v.shape[:2], pad, v.shape[3])), v], 2)
                    ks.append(k)
                    vs.append(v)
                layer.keys = torch.cat(ks, 0) if len(ks) > 1 else ks[0]
                layer.values = torch.cat(vs, 0) if len(vs) > 1 else vs[0]
            self.cache = merged
        else:
            self.cache = None
        pad_own = self.mask.new_zeros((self.size, width - S))
        pad_new = cache_mask.new_zeros((len(samples), width - W))
        self.mask = torch.cat([torch.cat([pad_own, self.mask], 1), torch.cat([pad_new, cache_mask.long()], 1)], 0)
        self.sample = torch.cat([self.sample, samples])
        self.count = torch.cat([self.count, count])
        self.ended = torch.cat([self.ended, ended])
        self.next_token = torch.cat([self.next_token, next_token])
        self.next_pos = torch.cat([self.next_pos, next_pos])
