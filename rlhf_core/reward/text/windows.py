"""Windows: the one pass over all tokens of a batch (`scan`: each token's code bits and each row's first
stop), rows cut into blocks of MARKER_BLOCK_TOKENS tokens, the blocks that hold a candidate token picked
(`pick_blocks`) and gathered with the tokens before them (`block_windows`), and the last marker found in them
(`last_marker`). Everything after the scan reads only such windows, of fixed size."""

from __future__ import annotations

import torch

from rlhf_core.reward.text.tables import cached, lookup
from rlhf_core.reward.text.vocab import VocabBytes

MARKER_BLOCK_TOKENS = 16
MARKER_BLOCKS = 4
"""The marker search cuts a row into blocks of MARKER_BLOCK_TOKENS tokens and reads the last MARKER_BLOCKS
blocks that hold a token able to end a marker occurrence (a token containing '#' for '####'): a marker
followed by that many more blocks with such tokens is not found."""


CAN_END, STOP, FORMAT0 = 1, 2, 4
"""Bits of the per-token codes of `scan`: the token can end a marker occurrence, is a stop, format text 0's bits
(format text i: FORMAT0 << 3 * i)."""
# For format text i, three bits from FORMAT0 << 3 * i: CAN (the token ends an occurrence from some state),
# WHOLE (from state 0), ADV (the token can leave a state >= 1, or has no bytes). A token can end an occurrence
# only if WHOLE, or CAN and the token before it is ADV: a pair test on int64 words of 8 codes.


def word_mask(bit: int, size: int = 8) -> int:
    """`bit` in each of the `size` bytes of an int64 (8) / int32 (4) word (as a signed integer)."""
    w = int.from_bytes(bytes([bit]) * size, "little")
    return w - (1 << 8 * size) if w >= 1 << (8 * size - 1) else w


def scan(codes_table: torch.Tensor, ids: torch.Tensor, block: int = MARKER_BLOCK_TOKENS, scratch=None):
    """The one [N, L] pass over the tokens: each id's code (uint8 bits CAN_END, STOP) by one vocabulary
    lookup. codes_table: uint8 [V + 1], entry 0 for ids outside [0, V) (the byte-less last id's code), entry
    v + 1 for id v. Returns (codes uint8 [N, Lp] (Lp = L rounded up to a multiple of `block`, padding 0),
    n_valid LongTensor [N]: the first stop of each row, L when none, index int32 [N, L]: id + 1, 0 outside the
    vocabulary). Ids are converted to int32: an id outside the int32 range wraps (real ids are far below). The first
    stop is found on int32 words of 4 codes: the first word holding a stop bit, then its 4 bytes. scratch: an
    optional (int32 [N, L], uint8 [N, L]) pair of buffers for the index and the codes (the codes' buffer is used
    when L is a multiple of `block`; fresh multi-MB CPU buffers cost page faults on every call)."""
    N, L = ids.shape
    V = codes_table.numel() - 1
    Lp = padded_length(L, block)
    if scratch is not None:
        idx = scratch[0].copy_(ids).clamp_(-1, V - 1).add_(1)  # -1 (and below) -> entry 0
    else:
        idx = ids.to(torch.int32, copy=True).clamp_(-1, V - 1).add_(1)  # never the caller's int32 tensor
    if scratch is not None and Lp == L:
        codes = torch.index_select(codes_table, 0, idx.view(-1), out=scratch[1].view(-1)).view(N, L)
    else:
        codes = torch.nn.functional.pad(codes_table.index_select(0, idx.view(-1)).view(N, L), (0, Lp - L))
    words = codes.view(torch.int32)  # [N, Lp / 4]
    nw = words.shape[1]
    # the first word with a stop bit, as nw - the largest (nw - j) over them (amax: faster than amin here), in
    # int32 (0 / 1 by a clamp: no bool; int64 products and maxima are several times slower on CPU)
    stop_w = (words & word_mask(STOP, 4)).clamp_(max=1)
    ar = torch.arange(nw, 0, -1, dtype=torch.int32, device=ids.device)
    fw = (nw - (stop_w.mul_(ar)).amax(dim=1, keepdim=True)).clamp_(max=nw - 1).long()
    # its first stop byte: the lowest stop bit of the word (w & -w: STOP << 8 * byte, 0 = none), named by a
    # lookup of 256 ** byte % 11 (1, 3, 9, 5 for bytes 0-3; 0 -> 4: none in the word)
    w = words.gather(1, fw) & word_mask(STOP, 4)
    first = lookup(_first_stop_byte(ids.device), ((w & -w) >> (STOP.bit_length() - 1)) % 11)
    n_valid = (fw * 4 + first).clamp_(max=L).squeeze(1)
    return codes, n_valid, idx


def padded_length(L: int, block: int = MARKER_BLOCK_TOKENS) -> int:
    """The codes' row length for rows of L tokens: L rounded up to a whole number of blocks (at least one)."""
    return -(-max(L, 1) // block) * block


def _first_stop_byte(device: torch.device) -> torch.Tensor:
    """int64 [11]: 256 ** b % 11 -> b for b in 0..3, 0 -> 4 (see `scan`); copied to `device` once."""

    def make():
        table = [4] * 11
        for b in range(4):
            table[256**b % 11] = b
        return torch.tensor(table, device=device)

    return cached(("first stop byte", device), make)


def _blocks_with(codes: torch.Tensor, bit: int, block: int) -> torch.Tensor:
    """BoolTensor [N, Lp / block]: blocks of `block` codes (uint8 [N, Lp]) holding a code with `bit`, read as int64
    words of 8 codes."""
    N = codes.shape[0]
    words = codes.view(torch.int64).view(N, codes.shape[1] // block, block // 8)
    either = words[..., 0]
    for i in range(1, block // 8):  # the OR of a block's words (one OR for the default block)
        either = either | words[..., i]
    return (either & word_mask(bit)) != 0


def pick_blocks(has: torch.Tensor, k: int, last: bool) -> torch.Tensor:
    """The indices of the first / last `k` True columns of each row in ascending order, LongTensor [N, k] (-1 where
    a row has fewer: at the end for first, at the start for last): a topk of each True column's distance from
    the row's other end (0 for False columns), so distinct values but for the Falses."""
    N, nb = has.shape
    k = min(k, nb)
    if last:  # j + 1, the largest first: the last Trues, then zeros
        v = torch.topk(has * torch.arange(1, nb + 1, device=has.device), k, dim=1).values
        return v.flip(1) - 1
    v = torch.topk(has * torch.arange(nb, 0, -1, device=has.device), k, dim=1).values  # nb - j: the first Trues
    return torch.where(v > 0, nb - v, -1)


def last_marker(
    vb: VocabBytes,
    index: torch.Tensor,
    codes: torch.Tensor,
    n_valid: torch.Tensor,
    blocks: int = MARKER_BLOCKS,
    block: int = MARKER_BLOCK_TOKENS,
):
    """Where the LAST marker occurrence before the first stop ends, however the marker was tokenized.

    index: IntTensor [N, L] token id + 1 in [0, V] (0: outside the vocabulary, read as byte-less), codes,
    n_valid: from `scan`. Returns (found BoolTensor [N], token LongTensor [N]: the token holding the marker's
    last byte, offset LongTensor [N]: bytes of that token up to the marker's end). Only tokens that can end an
    occurrence (`can_end`, the CAN_END bit of the codes) are candidates; the row is cut into blocks of `block`
    tokens and the last `blocks` blocks that start before the first stop and hold a candidate are searched
    (candidates after the stop in the stop's own block count there, and are then ignored): for each token
    there, the automaton state before it is recomputed from the m - 1 tokens before it (every non-special
    token has a byte, so they hold the m - 1 bytes the state depends on).
    """
    N, L = index.shape
    device = index.device
    m = max(len(vb.marker), 1)
    has = _blocks_with(codes, CAN_END, block) & (
        torch.arange(codes.shape[1] // block, device=device) * block < n_valid.unsqueeze(1)
    )
    chosen = pick_blocks(has, blocks, last=True)  # [N, k] ascending, -1 = none (first)
    k = chosen.shape[1]
    # each chosen block with the m - 1 tokens before it, as (id + 1) * m row offsets into the int32 tables:
    # [N, k, m - 1 + block]; token p - (m - 1) + d of every position p of a block is the slice d .. d + block
    tm = block_windows(index, chosen, block, m - 1).mul_(m)
    end = lookup(vb.match_end1_i, table_rows(tm, vb.next_state1_i, m))  # [N, k, block], -1 = no occurrence ends there
    valid = (end >= 0) & before_stop(chosen, n_valid, block)
    # the last occurrence: blocks are ascending, so the largest (k * block index) * stride + end over valid ones
    stride = vb.max_len + 1
    order = torch.arange(k * block, dtype=torch.int32, device=device).view(k, block) * stride
    best = torch.where(valid, order + end, -1).flatten(1).amax(dim=1).long()
    found = best >= 0
    best = best.clamp(min=0)
    at = best // stride  # k * block index
    token = (chosen.gather(1, (at // block).unsqueeze(1)).squeeze(1) * block + at % block) * found  # 0: none
    return found, token, best % stride


def table_rows(tm: torch.Tensor, next_state: torch.Tensor, m: int) -> torch.Tensor:
    """For each position of blocks with the m - 1 tokens before them (`block_windows`, times m: automaton table
    rows by id + 1, [N, k, m - 1 + block]), its automaton table row: the state before it, walked from state 0 over
    those m - 1 tokens, plus its own row offset. -> [N, k, block]."""
    block = tm.shape[2] - (m - 1)
    state = None
    for d in range(m - 1):
        state = lookup(next_state, tm[:, :, d : d + block] if state is None else tm[:, :, d : d + block] + state)
    return tm[:, :, m - 1 :] if state is None else tm[:, :, m - 1 :] + state


def before_stop(chosen: torch.Tensor, n_valid: torch.Tensor, block: int) -> torch.Tensor:
    """BoolTensor [N, k, block]: the positions of the chosen blocks (LongTensor [N, k], -1 = none: no position)
    before the row's first stop."""
    lim = torch.where(chosen >= 0, n_valid.unsqueeze(1) - chosen * block, 0).to(torch.int32)
    return torch.arange(block, dtype=torch.int32, device=chosen.device) < lim.unsqueeze(-1)


def block_windows(index: torch.Tensor, chosen: torch.Tensor, block: int, before: int) -> torch.Tensor:
    """The blocks `chosen` (LongTensor [N, k], -1 = none) of index (int32 [N, L] id + 1, from `scan`), each with the
    `before` tokens ahead of it: int32 [N, k, before + block]; tokens before the row and past its end read 0 (the
    byte-less id), a missing block reads block 0. Whole blocks are gathered from an [N, L / block, block] view (no
    per-token index arithmetic)."""
    N, L = index.shape
    k = chosen.shape[1]
    nb = -(-L // block)
    if nb * block != L:
        index = torch.nn.functional.pad(index, (0, nb * block - L))
    blocks3 = index.view(N, nb, block)
    c = chosen.clamp(min=0).unsqueeze(-1)
    parts = [blocks3.gather(1, c.expand(N, k, block))]
    for i in range(1, -(-before // block) + 1):  # the i-th block before, its last tokens where needed
        need = min(block, before - (i - 1) * block)
        prev = blocks3[:, :, block - need :].gather(1, (c - i).clamp(min=0).expand(N, k, need))
        parts.insert(0, prev * (c >= i))  # before the row: byte-less
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
