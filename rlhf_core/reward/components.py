"""Reward components in token space, the registry that names them, and their weighted composition.

Shapes: N = rows, L = response length, K = answer alternatives, Q = padded pattern length.
Every component is a pure function of tensors on the responses' device with the hot-path rules of
`tensor_native` (no loop over rows or positions, no host round trip). Rows are read up to their first
EOS (`valid_lengths`); an empty pattern never matches.

Config selects components by name (`RewardConfig.components`, name -> weight); `build_reward_fn`
binds the tokenizer-derived arguments once and returns a `ComposedReward`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlhf_core.reward.answer_forms import answer_variants
from rlhf_core.reward.answers import continuation_token_ids, whitespace_token_ids
from rlhf_core.reward.tensor_native import (
    PatternsLike,
    _check_rows,
    _packed_on,
    pack_patterns,
    tensor_native_reward,
    valid_lengths,
    window_matches,
)
from rlhf_core.reward.text import TextMatcher
from rlhf_core.types import PackedPatterns

if TYPE_CHECKING:  # config imports this package lazily; no runtime import the other way
    from rlhf_core.config import RewardConfig


def _matches_at(
    response_ids: torch.Tensor, packed: PackedPatterns, start: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    """Whether each alternative occurs starting exactly at `start`, ending before the first EOS.

    response_ids: LongTensor [N, L]; packed: tokens [N, K, Q], lengths [N, K]; start: LongTensor [N]
    in [0, L]; n_valid: LongTensor [N]. Returns BoolTensor [N, K].
    Gathers the Q tokens from `start` (O(N*K*Q), not O(N*K*L)).
    """
    N, L = response_ids.shape
    tokens, lengths = packed.tokens, packed.lengths
    Q = tokens.shape[2]
    ends_ok = (lengths > 0) & (start.unsqueeze(1) + lengths <= n_valid.unsqueeze(1))  # [N, K]
    if Q == 0:
        return torch.zeros_like(ends_ok)
    padded = torch.nn.functional.pad(response_ids, (0, Q))  # [N, L + Q]
    offsets = start.unsqueeze(1) + torch.arange(Q, device=response_ids.device)  # [N, Q], <= L + Q - 1
    window = padded.gather(1, offsets).unsqueeze(1)  # [N, 1, Q]
    beyond = torch.arange(Q, device=response_ids.device) >= lengths.unsqueeze(-1)  # [N, K, Q]
    return ((window == tokens.to(window.dtype)) | beyond).all(dim=-1) & ends_ok


def _is_member(values: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Elementwise membership of `values` (any shape) in the 1-D set `members`, as a BoolTensor.

    A binary search in the sorted set (torch.isin may fall back to a data-dependent unique for large sets).
    """
    if members.numel() == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    members = members.to(device=values.device, dtype=values.dtype).sort().values
    found = torch.searchsorted(members, values.contiguous()).clamp_(max=members.numel() - 1)
    return members[found] == values


def exact_match_reward(response_ids: torch.Tensor, patterns: PatternsLike, eos_token_id: int) -> torch.Tensor:
    """1.0 where the response up to its first EOS is exactly one of the row's answer alternatives.

    response_ids: LongTensor [N, L]; patterns: any form `pack_patterns` accepts; eos_token_id: int.
    Returns FloatTensor [N]. No extra token may precede EOS ("7 7 <eos>" does not match "7"); a row
    without EOS must equal the alternative over its whole length L; an empty alternative never matches.
    """
    packed = _packed_on(patterns, response_ids.device)
    _check_rows(response_ids, packed)
    N = response_ids.shape[0]
    n_valid = valid_lengths(response_ids, eos_token_id)
    start = torch.zeros(N, dtype=torch.long, device=response_ids.device)
    hit = _matches_at(response_ids, packed, start, n_valid) & (packed.lengths == n_valid.unsqueeze(1))
    return hit.any(dim=-1).float()


def pack_shared(alternatives, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences shared by all rows (e.g. marker tokenisations) as (tokens [M, Q], lengths [M]).

    alternatives: a 1-D LongTensor, a list of them, or an already packed (tokens, lengths) tuple (only
    moved). `ComposedReward` packs its constants once per device, so its scoring call packs nothing.
    """
    if isinstance(alternatives, tuple) and len(alternatives) == 2 and alternatives[0].dim() == 2:
        tokens, lengths = alternatives
        return (tokens, lengths) if device is None else (tokens.to(device), lengths.to(device))
    if isinstance(alternatives, torch.Tensor):
        alternatives = [alternatives]
    packed = pack_patterns([list(alternatives)], device=device)  # one "row" of M alternatives
    return packed.tokens[0], packed.lengths[0]


def _shared_hits(
    response_ids: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    """window_matches of the same M sequences in every row: BoolTensor [N, M, L]."""
    N = response_ids.shape[0]
    return window_matches(
        response_ids, tokens.unsqueeze(0).expand(N, -1, -1), lengths.unsqueeze(0).expand(N, -1), n_valid
    )


def answer_after_marker_reward(
    response_ids: torch.Tensor,
    patterns: PatternsLike,
    eos_token_id: int,
    marker_ids: torch.Tensor | Sequence[torch.Tensor],
    continuation_ids: torch.Tensor,
    whitespace_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """1.0 where an answer alternative starts right after the LAST marker and is not continued.

    response_ids: LongTensor [N, L]; patterns: any form `pack_patterns` accepts; eos_token_id: int;
    marker_ids: LongTensor [Qm], or a list of alternative tokenisations of the marker, or those packed
        by `pack_shared`; the occurrence of any of them that ENDS latest before the first EOS counts;
    continuation_ids: LongTensor [C] tokens that may not directly follow the answer (digits, '.', ','),
        so that answer "42" does not match "421";
    whitespace_ids: optional LongTensor [W] whitespace-only tokens; when given, the answer may also
        start after a run of them following the marker ("#### 42" with a separate space token).
    Returns FloatTensor [N]. No marker before EOS -> 0. The answer must end before the first EOS and be
    followed by EOS, the end of the row, or a token outside `continuation_ids`.
    """
    packed = _packed_on(patterns, response_ids.device)
    _check_rows(response_ids, packed)
    N, L = response_ids.shape
    device = response_ids.device
    if L == 0:
        return torch.zeros(N, device=device)
    n_valid = valid_lengths(response_ids, eos_token_id)
    positions = torch.arange(L, device=device)

    marker_tokens, marker_lengths = pack_shared(marker_ids, device)
    if marker_tokens.shape[0] == 0:  # no marker tokenisation at all: nothing can follow one
        return torch.zeros(N, device=device)
    marker_hits = _shared_hits(response_ids, marker_tokens, marker_lengths, n_valid)  # [N, M, L]
    marker_ends = positions + marker_lengths.unsqueeze(-1)  # [M, L]
    last_end = torch.where(marker_hits, marker_ends, -1).flatten(1).amax(dim=-1)  # [N], -1 = no marker
    has_marker = last_end >= 0
    starts = [last_end.clamp(min=0)]
    if whitespace_ids is not None and whitespace_ids.numel() > 0:
        is_space = _is_member(response_ids, whitespace_ids) & (positions < n_valid.unsqueeze(1))
        # next_non_space[t] = first t' >= t that is not a whitespace token (L if none): reverse cummin.
        candidate = torch.where(is_space, L, positions)
        next_non_space = candidate.flip(-1).cummin(dim=-1).values.flip(-1)
        next_non_space = torch.cat([next_non_space, next_non_space.new_full((N, 1), L)], dim=1)  # [N, L + 1]
        starts.append(next_non_space.gather(1, starts[0].unsqueeze(1)).squeeze(1))

    hit = torch.zeros(N, dtype=torch.bool, device=device)
    for start in starts:  # at most two candidate start positions per row
        at = _matches_at(response_ids, packed, start, n_valid)  # [N, K]
        follower_pos = start.unsqueeze(1) + packed.lengths  # [N, K]
        follower = response_ids.gather(1, follower_pos.clamp(max=L - 1))
        not_continued = (follower_pos >= n_valid.unsqueeze(1)) | ~_is_member(follower, continuation_ids)
        hit |= (at & not_continued).any(dim=-1)
    return (hit & has_marker).float()


def format_reward(response_ids: torch.Tensor, eos_token_id: int, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 where the required token sequences occur in order before the first EOS.

    response_ids: LongTensor [N, L]; eos_token_id: int; sequences: list of 1-D LongTensors.
    Returns FloatTensor [N]. Occurrences may not overlap: each starts at or after the end of the
    previous one (greedy earliest occurrence, which finds an ordering whenever one exists). Empty
    sequences are always satisfied; no sequences at all -> 1.0 everywhere.
    """
    N, L = response_ids.shape
    device = response_ids.device
    sequences = [s for s in sequences if s.numel() > 0]
    if not sequences:
        return torch.ones(N, device=device)
    if L == 0:
        return torch.zeros(N, device=device)
    n_valid = valid_lengths(response_ids, eos_token_id)
    positions = torch.arange(L, device=device)
    prev_end = torch.zeros(N, dtype=torch.long, device=device)
    for seq in sequences:  # loop over the required sequences, not rows
        n = seq.numel()  # a static length: no host copy of lengths
        lengths = torch.full((1,), n, dtype=torch.long, device=device)
        hits = _shared_hits(response_ids, seq.to(device).reshape(1, n), lengths, n_valid)[:, 0]  # [N, L]
        allowed = hits & (positions >= prev_end.unsqueeze(1))
        first = torch.where(allowed, positions, L + 1).amin(dim=-1)  # L + 1 = not found
        prev_end = first + n  # > L once a sequence is missing, so every later one fails too
    return (prev_end <= L).float()


def length_penalty(
    response_ids: torch.Tensor, eos_token_id: int, target: int, max_length: int | None = None
) -> torch.Tensor:
    """Linear penalty for responses longer than `target` tokens.

    response_ids: LongTensor [N, L]; eos_token_id: int; target: int >= 0;
    max_length: the length at which the penalty reaches -1 (default L = response_ids.shape[1]; pass
        max_new_tokens so that the scale does not depend on how a batch was padded).
    Returns FloatTensor [N] in [-1, 0]: with len = tokens up to and including the first EOS (L if
    none), 0 when len <= target, else -(len - target) / max(1, max_length - target), clipped at -1.
    """
    N, L = response_ids.shape
    max_length = L if max_length is None else max_length
    length = (valid_lengths(response_ids, eos_token_id) + 1).clamp(max=L)
    over = (length - target).clamp(min=0).float()
    return -(over / max(1, max_length - target)).clamp(max=1.0)


REWARD_COMPONENTS: dict[str, Callable[..., torch.Tensor]] = {
    "exact_match": exact_match_reward,
    "contains": tensor_native_reward,
    "answer_after_marker": answer_after_marker_reward,
    "format": format_reward,
    "length_penalty": length_penalty,
}
"""Reward components by name (config `reward.components`). Components that `build_reward_fn` does not
know how to bind are called as fn(response_ids, patterns, eos_token_id)."""


@dataclass
class ComposedReward:
    """A weighted sum of reward components with their tokenizer-derived arguments bound.

    Call with response_ids LongTensor [N, L] and patterns `PackedPatterns` [N, K, Q]; returns
    (total FloatTensor [N], {component name: FloatTensor [N] unweighted}). Patterns on another device
    than the responses are moved there once per call (`.to`); the rollout path keeps them together.
    Build-time constants (marker, continuation, whitespace, format tokens) are copied to a device the
    first time it is seen and cached.

    With `text` (a `TextMatcher`, the default of `build_reward_fn`: reward.match = 'text'), exact_match,
    contains, answer_after_marker and format compare TEXT: responses and answers become bytes on the
    device through the tokenizer's byte table, so any tokenization of the same text scores the same and
    numbers are normalised (`rlhf_core.reward.text`, docs/rewards.md). Without it they compare tokens.
    """

    weights: dict[str, float]
    eos_token_id: int
    stop_token_ids: list[int]
    marker_ids: list[torch.Tensor]
    continuation_ids: torch.Tensor
    whitespace_ids: torch.Tensor
    format_sequences: list[torch.Tensor]
    length_target: int
    max_new_tokens: int
    _on_device: dict = field(default_factory=dict, repr=False)
    text: TextMatcher | None = None

    def _canonical_stops(self, response_ids: torch.Tensor) -> torch.Tensor:
        """Every stop token replaced by eos_token_id (one batched op), so that every component ends a row at
        its first stop token, whichever of the stop set it is."""
        others = [i for i in self.stop_token_ids if i != self.eos_token_id]
        if not others:
            return response_ids
        stops = self._constants(response_ids.device)["other_stops"]
        return torch.where(_is_member(response_ids, stops), self.eos_token_id, response_ids)

    def _constants(self, device: torch.device) -> dict:
        if device not in self._on_device:
            self._on_device[device] = dict(
                other_stops=torch.tensor([i for i in self.stop_token_ids if i != self.eos_token_id], device=device),
                marker_ids=pack_shared(self.marker_ids, device),
                continuation_ids=self.continuation_ids.to(device),
                whitespace_ids=self.whitespace_ids.to(device),
                sequences=[s.to(device) for s in self.format_sequences],
            )
        return self._on_device[device]

    def component(self, name: str, response_ids: torch.Tensor, patterns: PackedPatterns) -> torch.Tensor:
        """One unweighted component, FloatTensor [N]."""
        c = self._constants(response_ids.device)
        eos = self.eos_token_id
        if name == "answer_after_marker":
            return answer_after_marker_reward(
                response_ids, patterns, eos, c["marker_ids"], c["continuation_ids"], c["whitespace_ids"]
            )
        if name == "format":
            return format_reward(response_ids, eos, c["sequences"])
        if name == "length_penalty":
            return length_penalty(response_ids, eos, self.length_target, self.max_new_tokens)
        return REWARD_COMPONENTS[name](response_ids, patterns, eos)

    def _text_parts(self, response_ids: torch.Tensor, patterns: PackedPatterns) -> dict[str, torch.Tensor]:
        """All components, the matching ones on text: answers and the first stop computed once."""
        text = self.text
        N, L = response_ids.shape
        rows = text.rows(response_ids, self.stop_token_ids)  # one vocabulary lookup: codes and the first stop
        n_valid = rows.n_valid
        answers = text.answers(response_ids, patterns) if self._reads_answers() else None
        parts, other_ids = {}, None
        for name in self.weights:
            if name == "answer_after_marker":
                parts[name] = text.answer_after_marker(rows, answers)
            elif name == "exact_match":
                parts[name] = text.exact_match(rows, answers)
            elif name == "contains":
                parts[name] = text.contains(rows, answers)
            elif name == "format":
                parts[name] = text.format(rows)
            elif name == "length_penalty":
                length = (n_valid + 1).clamp(max=L)
                over = (length - self.length_target).clamp(min=0).float()
                parts[name] = -(over / max(1, self.max_new_tokens - self.length_target)).clamp(max=1.0)
            else:  # other components: ids outside the tokenizer read as a byte-less token, as before
                if other_ids is None:
                    no_bytes = text.vocab.lengths.numel() - 1
                    other_ids = torch.where((response_ids < 0) | (response_ids > no_bytes), no_bytes, response_ids)
                parts[name] = self.component(name, other_ids, patterns)
        return parts

    def _reads_answers(self) -> bool:
        """Whether a configured text component compares with the answers (format and length_penalty do not)."""
        return bool({"exact_match", "contains", "answer_after_marker"} & set(self.weights))

    def prepare(self, patterns: PatternsLike) -> PackedPatterns:
        """The packed patterns, with what the text components read of the answers on the host attached (their
        byte width, whether any is a number / a text, the most distinct texts of a row: `AnswerHints`): call where
        patterns are packed, once per prompt batch,
        before they go to the device. Prepared answers are read in windows as wide as the longest answer (plus
        ANSWER_WINDOW_BYTES), unprepared ones up to a static bound: scores differ only where more than that
        many bytes lie between the marker and the number (docs/rewards.md)."""
        packed = pack_patterns(patterns)
        if self.text is None or not self._reads_answers():
            return packed
        return self.text.prepare(packed)

    def __call__(
        self, response_ids: torch.Tensor, patterns: PatternsLike
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        patterns = _packed_on(patterns, response_ids.device)
        if self.text is not None:  # reads each row up to its first stop id itself
            parts = self._text_parts(response_ids, patterns)
        else:
            response_ids = self._canonical_stops(response_ids)
            parts = {name: self.component(name, response_ids, patterns) for name in self.weights}
        total = torch.zeros(response_ids.shape[0], device=response_ids.device)
        for name, weight in self.weights.items():
            total = total + weight * parts[name]
        return total, parts


def prepare_patterns(reward_fn, patterns: PackedPatterns) -> PackedPatterns:
    """`reward_fn.prepare(patterns)` where the reward has one (a `ComposedReward`), else the patterns as they are."""
    prepare = getattr(reward_fn, "prepare", None)
    return prepare(patterns) if prepare is not None else patterns


def build_reward_fn(
    cfg: RewardConfig, tokenizer, stop_token_ids: int | Sequence[int], max_new_tokens: int
) -> ComposedReward:
    """The configured reward: tokenizes marker, continuation chars and format texts once, here.

    cfg: RewardConfig (components name -> weight, marker, continuation_chars, format_sequences,
        length_target; 0 = max_new_tokens); tokenizer: a Hugging Face tokenizer (encode + get_vocab);
    stop_token_ids: the ids at which a response ends (an int is a set of one; a row is read up to its first
    stop token, whichever it is); max_new_tokens: response length budget (scale of the length penalty).
    The marker is matched in every tokenisation `answer_variants` gives (as is, stripped, leading space).
    """
    unknown = sorted(set(cfg.components) - set(REWARD_COMPONENTS))
    if unknown:
        raise ValueError(f"unknown reward component(s) {unknown}; known: {sorted(REWARD_COMPONENTS)}")
    stops = [int(stop_token_ids)] if isinstance(stop_token_ids, int) else [int(i) for i in stop_token_ids]
    if not stops:
        raise ValueError("the stop set is empty: a response could never end")
    marker_ids = [torch.tensor(ids, dtype=torch.long) for ids in answer_variants(tokenizer, cfg.marker)]
    if "answer_after_marker" in cfg.components and not marker_ids:
        raise ValueError(f"reward.marker {cfg.marker!r} tokenizes to no tokens")
    format_sequences = []
    for text in cfg.format_sequences:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"reward.format_sequences entry {text!r} tokenizes to no tokens")
        format_sequences.append(torch.tensor(ids, dtype=torch.long))
    return ComposedReward(
        weights=dict(cfg.components),
        eos_token_id=stops[0],
        stop_token_ids=stops,
        marker_ids=marker_ids,
        continuation_ids=continuation_token_ids(tokenizer, cfg.continuation_chars),
        whitespace_ids=whitespace_token_ids(tokenizer),
        format_sequences=format_sequences,
        length_target=cfg.length_target or max_new_tokens,
        max_new_tokens=max_new_tokens,
        text=TextMatcher.build(tokenizer, cfg.marker, cfg.format_sequences)
        if getattr(cfg, "match", "text") == "text"
        else None,
    )
