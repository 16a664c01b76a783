"""Tensor batch types that flow between rollout, buffer and trainer.

Shapes use N = number of completions (prompts x samples_per_prompt), P = padded prompt length,
L = padded response length, K = answer alternatives per row, Q = padded answer-pattern length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch


@dataclass
class PackedPatterns:
    """Answer patterns for a batch, packed for the reward hot path.

    tokens:  LongTensor [N, K, Q] pattern token ids, padded with any value past `lengths`.
    lengths: LongTensor [N, K] number of valid tokens of each alternative; 0 = no such alternative.
    text_hints: what a text-matching reward read of the answers on the host when they were packed
             (`ComposedReward.prepare`); kept by `to` and `repeat_interleave`, which move and repeat the values
             that are row data (with a `follow` method: the answers' text, used only with the tensors it was
             made or moved for) with the rows. None: nothing read.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    text_hints: Optional[dict] = None  # host facts of the answers' text, by reward (`ComposedReward.prepare`)

    def to(self, device: torch.device | str) -> PackedPatterns:
        return self._with(lambda t: t.to(device))

    def repeat_interleave(self, repeats: int) -> PackedPatterns:
        return self._with(lambda t: t.repeat_interleave(repeats, 0))

    def _with(self, fn) -> PackedPatterns:
        """fn applied to the rows: tokens, lengths, and the text_hints values that are row data (those with a
        `follow(fn, tokens, lengths)` method: the answers' text, which then belongs to the new tensors)."""
        tokens, lengths = fn(self.tokens), fn(self.lengths)
        hints = self.text_hints
        if hints:
            hints = {k: (v.follow(fn, tokens, lengths) if hasattr(v, "follow") else v) for k, v in hints.items()}
        return PackedPatterns(tokens, lengths, hints)

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass
class RolloutBatch:
    """What a rollout engine returns for one generation call.

    prompt_ids:        LongTensor [N, P] prompt tokens, LEFT-padded with pad_token_id.
    prompt_mask:       BoolTensor [N, P] True on real prompt tokens.
    response_ids:      LongTensor [N, L] generated tokens, RIGHT-padded with pad_token_id after EOS.
    response_mask:     BoolTensor [N, L] True on generated tokens (the first EOS included).
    behavior_logprobs: FloatTensor [N, L] log-probability of each generated token under the distribution
                       it was sampled from (temperature/top-p/top-k applied); 0 where masked.
    response_lengths:  LongTensor [N] number of generated tokens (= response_mask.sum(-1)).
    group_ids:         LongTensor [N] index of the prompt (within the call) each completion answers;
                       completions of one prompt are contiguous.
    policy_version:    LongTensor [N] version of the weights that generated each row: with partial rollouts
                       (weights adopted mid-generation) the oldest version among the row's tokens.
    rewards:           FloatTensor [N] or None until scored.
    prompt_uids:       LongTensor [N] globally unique prompt id (data position) of each row.
    reward_components: FloatTensor [N, C] or None: each row's unweighted reward components, one column per
                       configured component in the order of `reward.components` (set by the rollout
                       worker; the trainer logs their means as reward/<component>).
    loss_mask:         BoolTensor [N, L] or None: the tokens trained on, where they are not all of
                       response_mask (multi-turn trajectories: the model's tokens, not the observations
                       between them, which response_mask still covers as attended context).
    token_versions:    LongTensor [N, L] or None: the version of the weights that produced each response token
                       (padding: the row's policy_version). None: every token is of the row's policy_version.
    truncated:         BoolTensor [N] or None: rows known to be cut before their end (multi-turn: by
                       env.max_turns or env.max_total_tokens), which algorithm.mask_truncated masks besides
                       the rows cut at rollout.max_new_tokens. None: none known.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    response_lengths: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor
    rewards: Optional[torch.Tensor] = None
    prompt_uids: Optional[torch.Tensor] = None
    reward_components: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    token_versions: Optional[torch.Tensor] = None
    truncated: Optional[torch.Tensor] = None

    @property
    def trained_mask(self) -> torch.Tensor:
        """The tokens the loss covers: loss_mask where set, else response_mask."""
        return self.loss_mask if self.loss_mask is not None else self.response_mask

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.response_lengths.sum())

    def versions_per_token(self) -> torch.Tensor:
        """LongTensor [N, L]: token_versions, or each row's policy_version repeated where there are none."""
        if self.token_versions is not None:
            return self.token_versions
        return self.policy_version[:, None].expand_as(self.response_ids)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """Rows `index` (a LongTensor) of every per-row tensor."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).index_select(0, index)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


@dataclass
class Experience:
    """One scored prompt group as stored in the replay buffer: G completions of one prompt.

    The unit the runtime moves is a group (the rows of a RolloutBatch that share a group id), so that
    batches stay tensors end to end; the trainer computes group advantages for a whole batch at once.
    Buffers read `policy_version`, `prompt_id` and `reward` (the group's mean reward) from it.
    """

    batch: RolloutBatch
    prompt_id: int
    policy_version: int

    @property
    def reward(self) -> float:
        return float(self.batch.rewards.mean()) if self.batch.rewards is not None else 0.0

    def __len__(self) -> int:
        return len(self.batch)


def pad_to(t: torch.Tensor, length: int, value: float | int, left: bool = False) -> torch.Tensor:
    """Pad the last dim of a [N, X] tensor to `length` with `value`, on the right (or left)."""
    extra = length - t.shape[-1]
    if extra <= 0:
        return t
    pad = torch.full((*t.shape[:-1], extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t] if left else [t, pad], dim=-1)


def cat_rollouts(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Concatenate rollout batches row-wise, re-padding prompts (left) and responses (right)."""
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_ids.shape[1] for b in batches)
    L = max(b.response_ids.shape[1] for b in batches)
    offset, group_ids = 0, []
    for b in batches:
        group_ids.append(b.group_ids + offset)
        offset += int(b.group_ids.max()) + 1 if len(b) else 0

    def cat(name: str, fn):
        vals = [getattr(b, name) for b in batches]
        if any(v is None for v in vals):
            return None
        return torch.cat([fn(v) for v in vals], 0)

    return RolloutBatch(
        prompt_ids=cat("prompt_ids", lambda t: pad_to(t, P, pad_token_id, left=True)),
        prompt_mask=cat("prompt_mask", lambda t: pad_to(t, P, False, left=True)),
        response_ids=cat("response_ids", lambda t: pad_to(t, L, pad_token_id)),
        response_mask=cat("response_mask", lambda t: pad_to(t, L, False)),
        behavior_logprobs=cat("behavior_logprobs", lambda t: pad_to(t, L, 0.0)),
        response_lengths=cat("response_lengths", lambda t: t),
        group_ids=torch.cat(group_ids, 0),
        policy_version=cat("policy_version", lambda t: t),
        rewards=cat("rewards", lambda t: t),
        prompt_uids=cat("prompt_uids", lambda t: t),
        reward_components=cat("reward_components", lambda t: t),
        loss_mask=_cat_loss_masks(batches, L),
        token_versions=(
            torch.cat([pad_to(b.versions_per_token(), L, 0) for b in batches], 0)
            if any(b.token_versions is not None for b in batches)
            else None
        ),
        truncated=(
            torch.cat([b.truncated if b.truncated is not None else b.response_lengths < 0 for b in batches], 0)
            if any(b.truncated is not None for b in batches)
            else None
        ),
    )


def _cat_loss_masks(batches: list[RolloutBatch], length: int) -> Optional[torch.Tensor]:
    """The batches' loss masks (response_mask for a batch without one), padded; None when none has one."""
    if all(b.loss_mask is None for b in batches):
        return None
    return torch.cat([pad_to(b.trained_mask, length, False) for b in batches], 0)
