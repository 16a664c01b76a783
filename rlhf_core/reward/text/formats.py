"""format: whether the format texts occur in order, non-overlapping, before the first stop: in windows of the
blocks that hold a token able to end each text (`format_windows`, where every text's last byte is rare), or
over every token (`format_tokens`). No bytes are made: each text's byte automaton is read per token."""

from __future__ import annotations

import torch

from rlhf_core.reward.text.tables import lookup
from rlhf_core.reward.text.vocab import VocabBytes
from rlhf_core.reward.text.windows import (
    FORMAT0,
    MARKER_BLOCK_TOKENS,
    before_stop,
    block_windows,
    pick_blocks,
    table_rows,
    word_mask,
)

FORMAT_BLOCKS = 4
"""The format search reads, for each text, the first FORMAT_BLOCKS blocks of MARKER_BLOCK_TOKENS tokens from the
previous text's end that hold a token able to end the text (when every text qualifies: see FORMAT_WINDOW_MAX)."""
FORMAT_WINDOW_MAX = (2, 0.05)
"""Format texts are searched in windows when there are at most 2 of them and, for each, at most 5% of the
vocabulary can end an occurrence (a rare last byte, as '#' or '>'); otherwise every token is read (slower)."""

_FORMAT_WINDOW_NONE = 1 << 40  # format_windows: "no end" for a (token * stride + offset), and the first text's -start
_FORMAT_TOKENS_NONE = 1 << 62  # format_tokens: "no end" for a byte position


def format_tokens(vb: VocabBytes, index: torch.Tensor, n_valid: torch.Tensor, automata) -> torch.Tensor:
    """Whether the format texts occur in order, non-overlapping, before the first stop. -> FloatTensor [N].

    index: IntTensor [N, L] id + 1 (0: byte-less), from `scan`; automata: per text (next_state, first_end,
    last_end, m) from `automaton`. No bytes are made: for every token, the automaton state before it is
    recomputed from the m - 1 tokens before it (m - 1 shifted lookups), the first / last occurrence ending in it
    is looked up, and its byte position is the token's start (a cumsum of byte lengths) plus that offset. Text
    i is then the earliest occurrence starting at or after the end of text i - 1 (of each token's first and
    last occurrence: a token holding three or more occurrences offers only those two).
    """
    N, L = index.shape
    if not automata:
        return torch.ones(N, device=index.device)
    if L == 0:
        return torch.zeros(N, device=index.device)
    big = _FORMAT_TOKENS_NONE
    lens = lookup(vb.lengths1, index)
    start = lens.cumsum(dim=1) - lens
    live = torch.arange(L, device=index.device) < n_valid.unsqueeze(1)
    prev_end = torch.zeros(N, 1, dtype=torch.long, device=index.device)
    for next_state, first_end, last_end, m in automata:
        state = torch.zeros_like(index)
        for d in range(m - 1, 0, -1):  # the tokens at i - (m - 1) .. i - 1, in order, from state 0
            t = torch.nn.functional.pad(index[:, : max(L - d, 0)], (min(d, L), 0))
            state = lookup(next_state, t * m + state)
        row = index * m + state
        ends = []
        for table in (first_end, last_end):
            e = lookup(table, row)
            at = start + e
            ends.append(torch.where((e >= 0) & (at - m >= prev_end) & live, at, big))
        prev_end = torch.minimum(ends[0], ends[1]).amin(dim=1, keepdim=True)
    return (prev_end < big).squeeze(1).float()


def _format_blocks(codes: torch.Tensor, i: int, block: int) -> torch.Tensor:
    """BoolTensor [N, Lp / block]: blocks holding a token that may end format text i (WHOLE, or CAN after an ADV
    token), on int64 words of 8 codes; the first token of a word counts its predecessor as ADV (a superset)."""
    can = FORMAT0 << 3 * i
    N = codes.shape[0]
    w = codes.view(torch.int64)
    prev_adv = ((w << 8) | (can << 2)) & word_mask(can << 2)  # each byte: the ADV bit of the token before it
    cand = (w & (prev_adv >> 2) & word_mask(can)) | ((w & word_mask(can << 1)) >> 1)  # CAN bits only: >= 0
    return cand.view(N, codes.shape[1] // block, block // 8).amax(dim=-1) != 0


def format_windows(
    vb: VocabBytes,
    index: torch.Tensor,
    codes: torch.Tensor,
    n_valid: torch.Tensor,
    automata,
    blocks: int = FORMAT_BLOCKS,
    block: int = MARKER_BLOCK_TOKENS,
) -> torch.Tensor:
    """`format_tokens` on windows: whether the format texts occur in order, non-overlapping, before the first
    stop. -> FloatTensor [N].

    index, codes, n_valid: from `scan` (codes carry text i's CAN / WHOLE / ADV bits, see FORMAT0). For
    text i, the first `blocks` blocks of `block` tokens that hold such a token, start before the first stop
    and end at or after the token where text i - 1 ended are read: for each token there, the automaton state
    before it is recomputed from the m - 1 tokens before it, and its first / last occurrence is kept when at
    least m bytes lie between the previous text's end and the occurrence's end (the byte lengths of those
    m - 1 tokens). An occurrence's end is (token, byte offset in it), compared as token * stride + offset.
    """
    N, L = index.shape
    device = index.device
    if not automata:
        return torch.ones(N, device=device)
    if L == 0:
        return torch.zeros(N, device=device)
    big = _FORMAT_WINDOW_NONE
    stride = vb.max_len + 1
    p0 = torch.full((N, 1), -big, dtype=torch.long, device=device)  # token of the previous text's end
    e0 = torch.zeros(N, 1, dtype=torch.long, device=device)  # and the byte offset in it just past that end
    bstart = torch.arange(codes.shape[1] // block, device=device) * block
    live = bstart < n_valid.unsqueeze(1)
    for i, (next_state, first_end, last_end, m) in enumerate(automata):
        first, final = i == 0, i == len(automata) - 1
        has = _format_blocks(codes, i, block) & live
        if not first:
            has &= bstart + (block - 1) >= p0
        chosen = pick_blocks(has, blocks, last=False)  # [N, k], -1 = none (last)
        k = chosen.shape[1]
        # each chosen block with the m - 1 tokens before it (as in last_marker): [N, k, m - 1 + block] of id + 1
        # (0 before the row); token p - j of every position p of a block is the slice m - 1 - j ..
        t = block_windows(index, chosen, block, m - 1)
        row = table_rows(t * m, next_state, m)  # [N, k, block]
        if first and final:  # one text: whether it occurs (a token's last occurrence ends there if any does)
            return ((lookup(last_end, row) >= 0) & before_stop(chosen, n_valid, block)).flatten(1).any(dim=1).float()
        row = row.reshape(N, k * block)
        p = (chosen.unsqueeze(-1) * block + torch.arange(block, device=device)).flatten(1)  # [N, P]
        ok = (p >= 0) & (p < n_valid.unsqueeze(1))
        if not first:
            ok &= p >= p0
        # the bytes between the previous text's end and token p (for d < m): tokens p - 1 .. p - d, less e0
        lens = lookup(vb.lengths1, t[:, :, : m - 1 + block - 1])
        d = p - p0
        between = -e0.expand(N, k * block)
        for j in range(1, m):
            between = between + lens[:, :, m - 1 - j : m - 1 - j + block].reshape(N, k * block) * (d >= j)
        best = torch.full((N, 1), big, dtype=torch.long, device=device)
        for table in (first_end, last_end):
            e = lookup(table, row)
            good = ok & (e >= 0) & ((d >= m) | (e + between >= m))
            best = torch.minimum(best, torch.where(good, p * stride + e, big).amin(dim=1, keepdim=True))
        found = best < big
        p0 = torch.where(found, best // stride, big)
        e0 = best % stride
    return (p0 < big).squeeze(1).float()
