"""contains: whether an answer alternative occurs in a response as a whole number / word, read in windows
around the last candidate tokens (`contains_windows`), or over whole rows converted to bytes (`contains_text`,
slow: the reference the windows are tested against)."""

from __future__ import annotations

import torch

from rlhf_core.reward.text.answers import AnswerText
from rlhf_core.reward.text.numbers import (
    C_ALNUM,
    C_COMMA,
    C_DIGIT,
    C_DOT,
    C_MINUS,
    COMMA,
    DIGIT0,
    DIGIT9,
    DOLLAR,
    DOT,
    MINUS,
    NOT_SPACE,
    byte_tables,
)
from rlhf_core.reward.text.tables import cached, lookup
from rlhf_core.reward.text.vocab import VocabBytes, tokens_to_bytes
from rlhf_core.reward.text.windows import MARKER_BLOCK_TOKENS, padded_length, pick_blocks

CONTAINS_BLOCKS, CONTAINS_WINDOWS = 4, 6
"""contains reads the last CONTAINS_BLOCKS blocks of MARKER_BLOCK_TOKENS tokens (before the first stop) that hold
a candidate token (its first byte that is not whitespace, or not whitespace / '$', may be the first byte of
an answer alternative), and of those the last CONTAINS_WINDOWS candidates: an occurrence is looked for where
such a token's text starts."""
CONTAINS_LEAD_BYTES, CONTAINS_TAIL_BYTES = 4, 6
"""A candidate token's leading whitespace / '$' read (at most), and the bytes read after an occurrence (its
end: a '.0…0' longer than this does not end a number; at most 8)."""


def _dot_zero_words(T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [T - 2] each: '.' and j - 1 '0's as the first j bytes of an int64 word, and the mask of those bytes,
    for j = 2 .. T - 1 (T <= 8); copied to `device` once."""

    def make():
        heads = [int.from_bytes(b"." + b"0" * (j - 1), "little") for j in range(2, T)]
        masks = [(1 << 8 * j) - 1 for j in range(2, T)]
        return torch.tensor(heads, device=device), torch.tensor(masks, device=device)

    return cached(("dot_zeros", T, device), make)


def _is_alnum(x: torch.Tensor) -> torch.Tensor:
    return ((x >= 48) & (x <= 57)) | ((x | 32) >= 97) & ((x | 32) <= 122) | (x >= 128)


def _find_all(x: torch.Tensor, n: torch.Tensor, pat: torch.Tensor, pat_len: torch.Tensor) -> torch.Tensor:
    """Start positions where pat [R, K, P] (first pat_len bytes) occurs in x [R, W] within n: BoolTensor [R, K, W].
    Loops over the static pattern width P."""
    R, W = x.shape
    P = pat.shape[2]
    pos = torch.arange(W, device=x.device)
    ok = (pos + pat_len.unsqueeze(-1) <= n.view(R, 1, 1)) & (pat_len.unsqueeze(-1) > 0)  # [R, K, W]
    padded = torch.nn.functional.pad(x, (0, P))
    for q in range(P):
        ok &= (padded[:, None, q : q + W] == pat[:, :, q : q + 1]) | (q >= pat_len.unsqueeze(-1))
    return ok


def contains_text(x: torch.Tensor, n: torch.Tensor, ans: AnswerText) -> torch.Tensor:
    """Whether an answer alternative occurs in the text as a whole number / word. x [N, W], n [N] -> Bool [N].

    An occurrence of the alternative's text (its number forms are alternatives too: '1000', '1,000') counts
    when the byte before it is not alphanumeric, '-', or a ',' / '.' after a digit, and the byte after it is
    not alphanumeric and not a ',' / '.' before a digit, except a '.0…0' that ends the number.
    """
    N, W = x.shape
    hits = _find_all(x, n, ans.lit, ans.lit_len)  # [N, K, W]
    pad = torch.nn.functional.pad(x, (2, 2 + ans.width + 2))  # x[j] is pad[j + 2]
    pos = torch.arange(W, device=x.device)
    digit = lambda v: (v >= DIGIT0) & (v <= DIGIT9)  # noqa: E731
    sep = lambda v: (v == DOT) | (v == COMMA)  # noqa: E731
    prev, prev2 = pad[:, 1 : W + 1], pad[:, :W]
    before_ok = ~_is_alnum(prev) & (prev != MINUS) & ~(sep(prev) & digit(prev2))  # [N, W]
    # the byte after an occurrence starting at s: x[s + len]
    nxt_idx = (pos + ans.lit_len.unsqueeze(-1)) + 2  # [N, K, W] into pad
    flat_pad = pad.unsqueeze(1).expand(N, ans.lit.shape[1], pad.shape[1])
    nxt = flat_pad.gather(2, nxt_idx)
    nxt2 = flat_pad.gather(2, nxt_idx + 1)
    # '.0…0' then a non-digit: find the end of the zero run after a '.' by a reverse cummin over positions
    Wp = pad.shape[1]
    pos_p = torch.arange(Wp, device=x.device)
    nonzero_at = torch.where(pad != DIGIT0, pos_p, Wp).flip(-1).cummin(dim=-1).values.flip(-1)  # next non-'0'
    zero_end = nonzero_at.unsqueeze(1).expand(N, ans.lit.shape[1], Wp).gather(2, (nxt_idx + 1).clamp(max=Wp - 1))
    after_zeros = flat_pad.gather(2, zero_end.clamp(max=Wp - 1))
    dot_zeros = (nxt == DOT) & (zero_end > nxt_idx + 1) & ~digit(after_zeros) & ~_is_alnum(after_zeros)
    after_ok = (~_is_alnum(nxt) & ~(sep(nxt) & digit(nxt2))) | dot_zeros
    return (hits & before_ok.unsqueeze(1) & after_ok).flatten(1).any(dim=1)


def contains_windows(
    vb: VocabBytes,
    first_table: torch.Tensor,
    index: torch.Tensor,
    n_valid: torch.Tensor,
    ans: AnswerText,
    blocks: int = CONTAINS_BLOCKS,
    windows: int = CONTAINS_WINDOWS,
    block: int = MARKER_BLOCK_TOKENS,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whether an answer alternative occurs in the row (before its first stop) as a whole number / word, read
    in windows around candidate tokens. -> BoolTensor [N].

    first_table: int32 [V + 1] (entry 0 for ids outside the vocabulary, v + 1 for id v): the byte_bucket bits
    of the token's first byte that is not whitespace and of its first that is not whitespace or '$'; index,
    n_valid: from `scan`. A token is a candidate when those bits meet the row's answers' first bytes
    (ans.first_mask). The last `windows` candidates of the last `blocks` blocks of `block` tokens holding one
    are read: each window is the text from 2 bytes before the candidate token, and an occurrence is looked for
    where the token's text starts, after its leading whitespace (and after a '$' there). It counts when the
    byte before it is not alphanumeric, '-', or a ',' / '.' after a digit, and the byte after it is not
    alphanumeric and not a ',' / '.' before a digit, except a '.0…0' that ends the number.
    """
    N, L = index.shape
    device = index.device
    K = ans.lit_len.shape[1]
    if L == 0 or K == 0:
        return torch.zeros(N, dtype=torch.bool, device=device)
    Lp = padded_length(L, block)
    if Lp == L and scratch is not None:  # a reused buffer: page faults of a fresh one cost more than the lookup
        first = torch.index_select(first_table, 0, index.view(-1), out=scratch.view(-1)).view(N, L)
    else:
        first = torch.nn.functional.pad(lookup(first_table, index), (0, Lp - L))  # int32 [N, Lp]
    # candidates: codes meeting the row's mask (in place: `first` is this call's own buffer); blocks holding one:
    # the largest of their int64 words of 2 masked codes is not 0 (the codes are below 2**31)
    first &= ans.first_mask.unsqueeze(1)
    has = (first.view(torch.int64).view(N, Lp // block, block // 2).amax(dim=-1) != 0) & (
        torch.arange(Lp // block, device=device) * block < n_valid.unsqueeze(1)
    )
    chosen = pick_blocks(has, blocks, last=True)
    p = (chosen.unsqueeze(-1) * block + torch.arange(block, device=device)).flatten(1)  # [N, kb * block]
    live = (p >= 0) & (p < n_valid.unsqueeze(1)) & (first.gather(1, p.clamp(0, Lp - 1)) != 0)
    sel = pick_blocks(live, windows, last=True)  # [N, C] columns of p, -1 = none
    c = p.gather(1, sel.clamp(min=0))
    C = c.shape[1]
    Wc = ans.words.shape[2] * 8
    W = 2 + CONTAINS_LEAD_BYTES + Wc + CONTAINS_TAIL_BYTES + 1  # one byte more: a window the text runs past
    A = min(W, L + 2)
    q = c.unsqueeze(-1) - 2 + torch.arange(A, device=device)  # [N, C, A]: tokens c - 2 ..
    read = (q >= 0) & (q < n_valid.view(N, 1, 1))  # tokens not read (before the row, from its stop) are byte-less
    tok = index.gather(1, q.clamp(0, L - 1).flatten(1)).view(N, C, A) * read  # ids + 1
    pre2 = lookup(vb.lengths1_i, tok[:, :, :2])
    pre = pre2[..., 0] + pre2[..., 1]  # bytes of the two tokens before the candidate
    x, x_len = tokens_to_bytes(vb, tok.view(N * C, A), None, (pre - 2).clamp(min=0).view(-1), W, True, torch.int32)
    # the text goes on past the window (more bytes, or tokens not read: byte-less ones took their place): an
    # occurrence whose end and tail bytes are not all in the window is not decided, and does not count
    cut = (x_len >= W) | (n_valid.unsqueeze(1) - c + 2 > A).view(-1)  # [R]
    tables = byte_tables(device)
    cls = lookup(tables.classes_i32, x)  # int32 [R, W + 1]
    pos = torch.arange(W + 1, device=device)
    s1 = ((cls & NOT_SPACE) * (pos >= pre.clamp(max=2).view(-1, 1))).argmax(dim=1, keepdim=True)
    s2 = s1 + (x.gather(1, s1) == DOLLAR)
    st = torch.cat([s1, s2], dim=1)  # [R, 2]: both starts (after the whitespace, and after a '$' there) at once
    xr = x.view(N, C, W + 1)
    lit_len = ans.lit_len.view(N, 1, 1, K)
    fit = (lit_len > 0) & (lit_len <= Wc)
    cls_of = lambda v: lookup(tables.classes_i32, v)  # noqa: E731
    b1, b2 = x.gather(1, (st - 1).clamp(min=0)) * (st >= 1), x.gather(1, (st - 2).clamp(min=0)) * (st >= 2)
    c1, c2 = cls_of(b1), cls_of(b2)
    before_ok = ((c1 & (C_ALNUM | C_MINUS)) == 0) & ~(((c1 & (C_DOT | C_COMMA)) > 0) & ((c2 & C_DIGIT) > 0))
    xw = x.to(torch.uint8).gather(1, (st.unsqueeze(-1) + torch.arange(Wc, device=device)).clamp(max=W).view(-1, 2 * Wc))
    xw = xw.view(torch.int64).view(N, C, 2, 1, Wc // 8)
    same = ((xw & ans.word_mask.view(N, 1, 1, K, Wc // 8)) == ans.words.view(N, 1, 1, K, Wc // 8)).all(dim=-1)
    a = st.view(N, C, 2, 1) + lit_len  # the byte after the occurrence
    T = CONTAINS_TAIL_BYTES  # at most 8: the bytes after an occurrence are read as one int64 word too
    tail = xr.gather(2, (a.unsqueeze(-1) + torch.arange(8, device=device)).clamp(max=W).view(N, C, 2 * K * 8))
    tail = tail.view(N, C, 2, K, 8)  # the 8 bytes from the one after the occurrence
    ct = cls_of(tail)
    cn, c2 = ct[..., 0], ct[..., 1]
    word = tail.to(torch.uint8).view(torch.int64).squeeze(-1)  # [N, C, 2, K]
    # '.0…0' then a byte that is not alphanumeric: '.' and j - 1 zeros in the word's first j bytes, byte j (< T)
    heads, masks = _dot_zero_words(T, device)  # [T - 2]: for j = 2 .. T - 1 at once
    dot_zeros = (((word.unsqueeze(-1) & masks) == heads) & ((ct[..., 2:T] & C_ALNUM) == 0)).any(dim=-1)
    after_ok = ((cn & C_ALNUM) == 0) & ~(((cn & (C_DOT | C_COMMA)) > 0) & ((c2 & C_DIGIT) > 0)) | dot_zeros
    ok = same & before_ok.view(N, C, 2, 1) & after_ok & (a <= x_len.view(N, C, 1, 1)) & fit
    ok &= ~cut.view(N, C, 1, 1) | (a + T <= x_len.view(N, C, 1, 1))
    hit = ok.any(dim=2)  # [N, C, K]
    return (hit & (sel >= 0).unsqueeze(-1)).flatten(1).any(dim=1)
