"""Token-space matching primitives: answer patterns against generated responses, on their device.

Shapes: B = rows (completions), L = response length, K = answer alternatives per row,
Q = padded pattern length, M = marker / format alternatives.

Every function here is batched tensor code that runs on the device of `generated_ids`: no Python loop
over rows or positions (only over the pattern length Q or the number of alternatives, both static
shapes), no data-dependent shapes and no host round trip (`.item()`, `.tolist()`, `bool(tensor)`,
`nonzero()`, boolean indexing). Only `pack_patterns`, which turns Python lists into a `PackedPatterns`,
loops in Python; it runs once per prompt batch, not per scoring call.

Semantics shared by every reward: a row is read up to (excluding) its FIRST `eos_token_id`; tokens after
it are ignored; a row without EOS is read whole. A pattern "occurs" when all of its tokens lie before
that first EOS. An empty pattern (length 0) never matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

from rlhf_core.types import PackedPatterns

PatternsLike = Union[
    PackedPatterns,
    tuple,  # (tokens [B, Q], lengths [B]) or (tokens [B, K, Q], lengths [B, K])
    Sequence[torch.Tensor],  # one 1-D pattern per row
    Sequence[Sequence[torch.Tensor]],  # alternatives per row
]


# ----------------------------------------------------------------------------------------------------
# Packing (not the hot path)
# ----------------------------------------------------------------------------------------------------


def _as_pattern(p) -> torch.Tensor:
    """One pattern (a 1-D tensor or a sequence of ints) as a 1-D LongTensor, on its own device."""
    t = p if isinstance(p, torch.Tensor) else torch.tensor([int(x) for x in p], dtype=torch.long)
    if t.dim() != 1:
        raise ValueError(f"an answer pattern must be 1-D, got shape {tuple(t.shape)}")
    return t


def _as_alternatives(item) -> list[torch.Tensor]:
    """One row's patterns as a list of 1-D tensors: a row is one pattern or a list of alternatives."""
    if isinstance(item, torch.Tensor):
        return [_as_pattern(item)]
    items = list(item)
    if not items or all(isinstance(x, int) for x in items):
        return [_as_pattern(items)]
    return [_as_pattern(alt) for alt in items]


def pack_patterns(answer_patterns: PatternsLike, device: torch.device | str | None = None) -> PackedPatterns:
    """Pack per-row answer patterns into a `PackedPatterns` (tokens [B, K, Q], lengths [B, K]).

    answer_patterns: a `PackedPatterns` (returned as is, moved to `device` if given); a tuple
        (tokens [B, Q], lengths [B]) or (tokens [B, K, Q], lengths [B, K]); a list of B 1-D LongTensors
        (one pattern per row); or a list of B lists of 1-D LongTensors (alternatives; any may match).
        Lists of ints are accepted wherever a 1-D tensor is.
    device: where the packed tensors live; None keeps packed inputs where they are and puts lists on
        the device of their first tensor (CPU when there is none).

    K = max alternatives per row (at least 1), Q = max pattern length (at least 1); missing alternatives
    get length 0 and padding tokens are 0. This is the one function that loops in Python (over rows and
    alternatives): call it once per prompt batch (e.g. in the data layer), not per scoring call.
    """
    if isinstance(answer_patterns, PackedPatterns):
        return answer_patterns if device is None else answer_patterns.to(device)
    if (
        isinstance(answer_patterns, tuple)
        and len(answer_patterns) == 2
        and all(isinstance(t, torch.Tensor) for t in answer_patterns)
    ):
        tokens, lengths = answer_patterns
        if tokens.dim() == 2 and lengths.dim() == 1:
            tokens, lengths = tokens.unsqueeze(1), lengths.unsqueeze(1)
        if tokens.dim() != 3 or lengths.dim() != 2 or tokens.shape[:2] != lengths.shape:
            raise ValueError(
                "packed answer patterns must be (tokens [B, Q], lengths [B]) or "
                f"(tokens [B, K, Q], lengths [B, K]); got {tuple(tokens.shape)} and {tuple(lengths.shape)}"
            )
        packed = PackedPatterns(tokens.long(), lengths.long())
        return packed if device is None else packed.to(device)
    rows = [_as_alternatives(item) for item in answer_patterns]
    if device is None:
        device = next((p.device for alts in rows for p in alts), torch.device("cpu"))
    B = len(rows)
    K = max([len(alts) for alts in rows] + [1])
    Q = max([p.numel() for alts in rows for p in alts] + [1])
    # Lengths come from static shapes and tokens are copied tensor to tensor: packing never reads
    # token values back to the host, even for patterns already on an accelerator.
    tokens = torch.zeros(B, K, Q, dtype=torch.long, device=device)
    lengths = [[0] * K for _ in range(B)]
    for b, alts in enumerate(rows):
        for k, p in enumerate(alts):
            tokens[b, k, : p.numel()] = p.to(device)
            lengths[b][k] = p.numel()
    return PackedPatterns(tokens, torch.tensor(lengths, dtype=torch.long).reshape(B, K).to(device))


def _packed_on(answer_patterns: PatternsLike, device: torch.device) -> PackedPatterns:
    """Packed patterns on `device`. Already packed input is only moved (a no-op on the same device)."""
    packed = pack_patterns(answer_patterns)
    return packed.to(device) if packed.tokens.device != device else packed


# ----------------------------------------------------------------------------------------------------
# Hot-path primitives
# ----------------------------------------------------------------------------------------------------

# Why int32, XOR and in-place ops: on CPU, comparisons that produce bool tensors run several times
# slower than same-dtype integer ops (xor, and, or, shifts, amin/amax), int32 halves the memory traffic
# of int64, and every fresh multi-MB CPU buffer costs page faults. So windows are compared by
# OR-accumulating `window ^ pattern` (zero iff equal) into one buffer, tested with amin at the end.
# Token ids are read as non-negative int32 (sign bit cleared): real vocabularies are far below 2**31,
# and a negative padding id such as -100 then equals no real token. The formulation is device-agnostic.
_INT32_MAGNITUDE = 0x7FFFFFFF


def _as_token_int32(ids: torch.Tensor) -> torch.Tensor:
    """Token ids as non-negative int32 (same shape, always a new tensor: never aliases the caller's)."""
    return ids.to(torch.int32, copy=True).bitwise_and_(_INT32_MAGNITUDE)


def _first_eos_int32(ids32: torch.Tensor, eos_token_id: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the first EOS of each row (L when none), LongTensor [B].

    ids32: IntTensor [B, L] from _as_token_int32; scratch: optional IntTensor [B, L] to compute in.
    """
    L = ids32.shape[-1]
    eos = eos_token_id & _INT32_MAGNITUDE
    keyed = torch.bitwise_xor(ids32, eos, out=scratch) if scratch is not None else ids32 ^ eos
    # (x - 1) >> 31 is -1 exactly where x == 0 (x >= 0): keep L - position at EOS positions, 0 elsewhere;
    # the row max is then L - (first EOS), or 0 without EOS.
    keyed.sub_(1).bitwise_right_shift_(31)
    keyed &= torch.arange(L, 0, -1, dtype=torch.int32, device=ids32.device)
    return L - keyed.amax(dim=-1).long()


def valid_lengths(generated_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Tokens before the first EOS of each row (L when a row has none).

    generated_ids: LongTensor [B, L]. Returns LongTensor [B] in [0, L].
    """
    B, L = generated_ids.shape
    if L == 0:
        return torch.zeros(B, dtype=torch.long, device=generated_ids.device)
    ids32 = _as_token_int32(generated_ids)
    return _first_eos_int32(ids32, eos_token_id, scratch=ids32)


def _window_mismatch(
    ids32: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    n_valid: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-negative IntTensor [B, K, L] that is 0 exactly where `window_matches` is True.

    ids32: IntTensor [B, L] from _as_token_int32; tokens: [B, K, Q]; lengths: [B, K]; n_valid: [B];
    scratch: optional IntTensor [B, K, L] to compute in (its contents are overwritten).
    Loops over Q only: at pattern offset q, the row shifted left by q is XOR-ed with token q of every
    pattern (offsets past a pattern's length masked out) and OR-ed into the accumulator. Windows that
    would run past the row are never compared: they are already excluded by `last_start`.
    """
    B, L = ids32.shape
    Q = tokens.shape[2]
    device = ids32.device
    # A window may start at s only if it ends before the first EOS: s <= last_start; empty never does.
    last_start = torch.where(lengths > 0, n_valid.unsqueeze(1) - lengths, -1).to(torch.int32)  # [B, K]
    # (last_start - s) >> 31 is -1 exactly where s > last_start; & 1 makes those entries 1 (a mismatch).
    acc = last_start.unsqueeze(-1) - torch.arange(L, dtype=torch.int32, device=device)  # [B, K, L]
    acc.bitwise_right_shift_(31).bitwise_and_(1)
    if Q == 0:  # no pattern has a token
        return acc.fill_(1)
    tokens32 = _as_token_int32(tokens)
    # -1 keeps offset q of a pattern, 0 drops it (q >= its length).
    keep = -(torch.arange(Q, device=device) < lengths.unsqueeze(-1)).to(torch.int32)  # [B, K, Q]
    rows = ids32.unsqueeze(1)  # [B, 1, L]
    diff = torch.empty_like(acc) if scratch is None else scratch
    for q in range(min(Q, L)):
        n = L - q  # window starts s < n have their offset-q token inside the row
        d = torch.bitwise_xor(rows[:, :, q:], tokens32[:, :, q : q + 1], out=diff[:, :, :n])
        if q > 0:  # offset 0 lies in every non-empty pattern; empty ones are excluded by last_start
            d &= keep[:, :, q : q + 1]
        acc[:, :, :n] |= d
    return acc


def window_matches(
    generated_ids: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    """Where each row's patterns occur: start positions of complete matches before `n_valid`.

    generated_ids: LongTensor [B, L]; tokens: LongTensor [B, K, Q]; lengths: LongTensor [B, K];
    n_valid: LongTensor [B] (tokens before the first EOS, from `valid_lengths`).
    Returns BoolTensor [B, K, L]: True at s when generated_ids[b, s : s + lengths[b, k]] equals
    tokens[b, k, :lengths[b, k]], s + lengths[b, k] <= n_valid[b] and lengths[b, k] > 0.
    Nothing of size [B, K, L, Q] is materialised.
    """
    return _window_mismatch(_as_token_int32(generated_ids), tokens, lengths, n_valid) == 0


def tensor_native_reward(generated_ids: torch.Tensor, answer_patterns: PatternsLike, eos_token_id: int) -> torch.Tensor:
    """1.0 where one of the row's answer patterns occurs contiguously before the row's first EOS.

    generated_ids: LongTensor [B, L] response tokens.
    answer_patterns: per-row patterns in any form `pack_patterns` accepts; a `PackedPatterns` or a
        (tokens, lengths) tuple is used directly (moved to the device of `generated_ids` if elsewhere).
    eos_token_id: int.
    Returns FloatTensor [B] of 0.0 / 1.0. Tokens after the first EOS are ignored, a row without EOS
    counts whole, an empty pattern or one longer than the trimmed row scores 0. B = 0 and L = 0 work.
    """
    packed = _packed_on(answer_patterns, generated_ids.device)
    _check_rows(generated_ids, packed)
    B, L = generated_ids.shape
    if L == 0:
        return torch.zeros(B, device=generated_ids.device)
    K = packed.tokens.shape[1]
    if K == 0:
        return torch.zeros(B, device=generated_ids.device)
    # Three [B, L]-sized buffers in all (fresh CPU buffers cost page faults): the int32 row, the
    # accumulator, and one scratch shared by the EOS search and the window comparisons.
    ids32 = _as_token_int32(generated_ids)
    scratch = torch.empty(B, K, L, dtype=torch.int32, device=generated_ids.device)
    n_valid = _first_eos_int32(ids32, eos_token_id, scratch=scratch[:, 0])
    mismatch = _window_mismatch(ids32, packed.tokens, packed.lengths, n_valid, scratch)  # [B, K, L], >= 0
    return (mismatch.amin(dim=-1) == 0).any(dim=-1).float()


def _check_rows(generated_ids: torch.Tensor, packed: PackedPatterns) -> None:
    if generated_ids.dim() != 2:
        raise ValueError(f"generated_ids must be [B, L], got shape {tuple(generated_ids.shape)}")
    if packed.tokens.shape[0] != generated_ids.shape[0]:
        raise ValueError(f"{packed.tokens.shape[0]} answer-pattern rows for {generated_ids.shape[0]} responses")
