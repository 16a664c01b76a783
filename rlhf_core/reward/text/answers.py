"""Answers as text: the answer alternatives of a batch (packed token patterns) turned into bytes, stripped
text and canonical numbers on the device (`answer_text`), what the host knows of them when it packs them
(`AnswerHints`, `PreparedText`), and whether a text window starts with / is an answer (`matches_answer`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields, replace

import torch

from rlhf_core.reward.text.numbers import C_ALNUM, NOT_SPACE, byte_tables, numbers, same_number
from rlhf_core.reward.text.tables import lookup
from rlhf_core.reward.text.vocab import VocabBytes, tokens_to_bytes

ANSWER_WINDOW_BYTES = 16
"""Bytes read after the marker beyond the answer's own length (spaces, '$', separators, '.0', a period)."""
ANSWER_MAX_BYTES = 64
"""Answer alternatives are read up to this many bytes (a longer text answer is cut, and cannot match)."""
CONTAINS_MAX_BYTES = 24
"""contains compares alternatives of at most this many bytes (a longer alternative never matches there)."""


@dataclass(frozen=True)
class AnswerHints:
    """What the host knows of a batch's answer alternatives when it packs them (`TextMatcher.prepare`), so that
    the device needs no sync for it: the bytes of the longest alternative (as `tokens_to_bytes` writes them; an
    alternative longer than ANSWER_MAX_BYTES counts as that), whether any alternative is a number / a text, and
    the most distinct texts any row's alternatives have (token variants such as '72' / ' 72' are one text: the
    answers' text keeps that many slots per row, not K). Hints describe the patterns as they were prepared."""

    width: int
    any_num: bool
    any_text: bool
    alternatives: int = 0  # the most distinct texts of a row (0: unknown, keep all K)


@dataclass
class AnswerText:
    """The answer alternatives of a batch as text, made from the packed token patterns on the device.

    lit [N, K, Wa] / lit_len [N, K]: each alternative's bytes without surrounding whitespace;
    canon [N, K, 2C] / is_num [N, K]: its canonical number (see `numbers`), where the whole stripped text
    is one number (trailing '.' allowed). Length 0 = absent alternative (never matches).
    """

    lit: torch.Tensor
    lit_len: torch.Tensor
    canon: torch.Tensor
    is_num: torch.Tensor
    first_mask: torch.Tensor | None = None  # int32 [N]: byte_bucket bits of the alternatives' first bytes
    words: torch.Tensor | None = None  # int64 [N, K, Wc / 8]: lit (first Wc bytes) as int64 words (contains)
    word_mask: torch.Tensor | None = None  # int64 [N, K, Wc / 8]: 0xFF on lit's bytes, 0 past lit_len
    lit_words: torch.Tensor | None = None  # int64 [N, K, ceil(Wa / 8)]: all of lit as int64 words
    lit_mask: torch.Tensor | None = None  # int64, the same shape: 0xFF on lit's bytes, 0 past lit_len
    any_num: bool | None = None  # whether any alternative is a number / a text (None: unknown, on a device)
    any_text: bool | None = None

    @property
    def width(self) -> int:
        return self.lit.shape[2]

    def _map(self, fn) -> AnswerText:
        """fn applied to every tensor (a move, a repeat of the rows: `PreparedText.follow`)."""
        return replace(
            self, **{f.name: fn(v) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}
        )


class PreparedText:
    """The answers' text that `TextMatcher.prepare` made on the host for the rows of the patterns it prepared. It
    belongs to those patterns' tensors (the same objects, unchanged since: weak references and their versions);
    PackedPatterns.to / repeat_interleave give the moved / repeated text to the new tensors (`follow`), so that
    a reward call on the samples of a prompt batch reads it instead of making it again. Other tensors (rows
    rebuilt, changed in place) never use it. A pickled copy belongs to no tensors."""

    def __init__(self, text: AnswerText, tokens: torch.Tensor, lengths: torch.Tensor):
        self.text = text
        self._refs = (weakref.ref(tokens), weakref.ref(lengths))
        self._versions = (tokens._version, lengths._version)

    def follow(self, fn, tokens: torch.Tensor, lengths: torch.Tensor) -> PreparedText:
        """The text with `fn` applied to its tensors (a move, a repeat), for the patterns' new tensors."""
        return PreparedText(self.text._map(fn), tokens, lengths)

    def belongs_to(self, tokens: torch.Tensor, lengths: torch.Tensor) -> bool:
        t, n = self._refs
        return t() is tokens and n() is lengths and self._versions == (tokens._version, lengths._version)

    def __getstate__(self):
        return {"text": self.text}

    def __setstate__(self, state):
        self.text = state["text"]
        self._refs, self._versions = (lambda: None, lambda: None), None


def static_width(vb: VocabBytes, Q: int, max_bytes: int = ANSWER_MAX_BYTES) -> int:
    """The answers' byte width known without reading them: Q tokens of the longest token, at most max_bytes."""
    return max(1, min(Q * max(vb.max_len, 1), max_bytes))


def answer_text(
    vb: VocabBytes,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    max_bytes: int = ANSWER_MAX_BYTES,
    hints: AnswerHints | None = None,
) -> AnswerText:
    """AnswerText of PackedPatterns (tokens [N, K, Q], lengths [N, K]); an alternative of more than `max_bytes`
    bytes is dropped (length 0: it never matches). hints (`TextMatcher.prepare`, read on the host when the
    patterns were packed): the exact byte width of the alternatives, and whether any is a number / a text;
    without them the width is the static bound Q * the longest token and both kinds are matched."""
    width = static_width(vb, tokens.shape[2], max_bytes)
    if hints is not None:
        width = max(1, min(width, hints.width))
    return finish_answers(*answer_fields(vb, tokens, lengths, width), hints)


def answer_fields(vb: VocabBytes, tokens: torch.Tensor, lengths: torch.Tensor, width: int):
    """(lit [N, K, width], lit_len [N, K], canon [N, K, 2C], is_num [N, K]) of the alternatives (see AnswerText), read
    in `width` bytes (a longer alternative: length 0)."""
    N, K, Q = tokens.shape
    b, b_len = tokens_to_bytes(vb, tokens.reshape(N * K, Q), lengths.reshape(N * K), None, width + 1)
    fits = b_len <= width
    x = b[:, : width + 1] * fits.unsqueeze(1)  # column `width` is 0 where it fits
    cls = lookup(byte_tables(x.device).classes, x)
    canon, is_num, rest = numbers(x, cls)
    pos = torch.arange(width + 1, device=x.device)
    nonspace = ((cls & NOT_SPACE) > 0) & (pos < b_len.unsqueeze(1))
    lead = (cls & NOT_SPACE).argmax(dim=1, keepdim=True)
    last = torch.where(nonspace, pos, -1).amax(dim=1, keepdim=True)
    lit_len = ((last + 1 - lead).clamp(min=0) * fits.unsqueeze(1)).squeeze(1)
    lit = x.gather(1, (pos[:width] + lead).clamp(max=width)) * (pos[:width] < lit_len.unsqueeze(1))
    is_num = is_num & (rest >= last.squeeze(1) + 1) & (lit_len > 0)
    lit = lit.reshape(N, K, width)
    lit_len = lit_len.reshape(N, K)
    canon = canon.reshape(N, K, canon.shape[1])
    is_num = is_num.reshape(N, K)
    return lit, lit_len, canon, is_num


def finish_answers(
    lit: torch.Tensor,
    lit_len: torch.Tensor,
    canon: torch.Tensor,
    is_num: torch.Tensor,
    hints: AnswerHints | None,
    keep: torch.Tensor | None = None,
) -> AnswerText:
    """The AnswerText of `answer_fields`: with hints.alternatives, each row's distinct texts (keep: `distinct_texts`, if
    known) in that many slots; then the first bytes' buckets and the texts as int64 words."""
    N, K, width = lit.shape
    device = lit.device
    if hints is not None and 0 < hints.alternatives < K:  # each row's distinct texts into `alternatives` slots
        k2 = hints.alternatives
        keep = distinct_texts(lit, lit_len) if keep is None else keep
        slot = torch.where(keep, keep.long().cumsum(1) - 1, k2).clamp_(max=k2)
        src = torch.full((N, k2 + 1), K, dtype=torch.long, device=device)
        src = src.scatter_(1, slot, torch.arange(K, device=device).expand(N, K))[:, :k2]  # K: no alternative
        have, src = src < K, src.clamp(max=K - 1)
        lit = lit.gather(1, src.unsqueeze(-1).expand(N, k2, width))
        lit_len = lit_len.gather(1, src) * have
        canon = canon.gather(1, src.unsqueeze(-1).expand(N, k2, canon.shape[2]))
        is_num = is_num.gather(1, src) & have
        K = k2
    buckets = byte_tables(device).buckets
    first = torch.where(lit_len > 0, lookup(buckets, lit[:, :, 0]), 0)  # [N, K]
    first_mask = first[:, 0]
    for k in range(1, K):
        first_mask = first_mask | first[:, k]
    words, mask = _as_words(lit, lit_len, min(width, CONTAINS_MAX_BYTES))
    lit_words, lit_mask = _as_words(lit, lit_len, width)
    return AnswerText(
        lit,
        lit_len,
        canon,
        is_num,
        first_mask,
        words,
        mask,
        lit_words,
        lit_mask,
        any_num=hints.any_num if hints is not None else None,
        any_text=hints.any_text if hints is not None else None,
    )


def distinct_texts(lit: torch.Tensor, lit_len: torch.Tensor) -> torch.Tensor:
    """BoolTensor [N, K]: the alternatives (lit [N, K, W], zero past lit_len) that are not empty and whose text no
    earlier alternative of the row has ('72' and ' 72' are one text once stripped)."""
    K = lit.shape[1]
    words, _ = _as_words(lit, lit_len, lit.shape[2])
    same = (words.unsqueeze(2) == words.unsqueeze(1)).all(dim=-1) & (lit_len.unsqueeze(2) == lit_len.unsqueeze(1))
    earlier = torch.ones(K, K, dtype=torch.bool, device=lit.device).tril(-1)  # [j, i]: i before j
    return (lit_len > 0) & ~(same & earlier).any(dim=-1)


def _as_words(lit: torch.Tensor, lit_len: torch.Tensor, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `upto` bytes of lit [N, K, W] (zero past lit_len) as int64 words of 8 bytes, and the mask of
    lit's bytes in them: ([N, K, ceil(upto / 8)], the same shape), for comparing 8 bytes per op."""
    w8 = -(-upto // 8) * 8
    words = torch.nn.functional.pad(lit[:, :, :w8], (0, w8 - min(lit.shape[2], w8))).to(torch.uint8)
    words = words.clone(memory_format=torch.contiguous_format)  # plain strides (a [1, 1, w] slice keeps its own)
    mask = ((torch.arange(w8, device=lit.device) < lit_len.unsqueeze(-1)) * 255).to(torch.uint8)
    return words.view(torch.int64), mask.view(torch.int64)


def matches_answer(
    x: torch.Tensor, n: torch.Tensor, ans: AnswerText, whole: bool, cut: torch.Tensor | None = None
) -> torch.Tensor:
    """Whether the text x (bytes [N, W], 0 past the end n [N], the last column 0) starts with (whole=False) /
    is (whole=True) an answer.

    Number answers: the number at the start of x (after spaces and '$') has the answer's canonical form;
    whole: nothing but whitespace follows it. Text answers: x without leading whitespace starts with the
    answer text followed by a non-alphanumeric byte (or the end); whole: x stripped equals it.
    cut: BoolTensor [N], rows whose text goes on past x: there a number must end, and a text answer be
    followed by a byte, inside x (what comes after x is not known: '72' cut from '720' is not 72).
    Returns BoolTensor [N] (any alternative).
    """
    N, W = x.shape
    cls = lookup(byte_tables(x.device).classes, x)
    pos = torch.arange(W, device=x.device)
    hit = torch.zeros(N, dtype=torch.bool, device=x.device)
    if ans.any_num is not False:  # None: not known on the host
        canon, is_number, rest = numbers(x, cls)
        num_hit = same_number(canon, ans.canon) & (is_number.unsqueeze(1) & ans.is_num)
        if whole:
            tail = ((cls & NOT_SPACE) > 0) & (pos >= rest.unsqueeze(1)) & (pos < n.unsqueeze(1))
            num_hit &= ~tail.any(dim=1).unsqueeze(1)
        hit = num_hit.any(dim=1)
        if cut is not None:
            hit &= ~cut | (rest < n)
    if ans.any_text is False:
        return hit
    lead = (cls & NOT_SPACE).argmax(dim=1, keepdim=True)  # first non-space (the sentinel when none)
    Wa = min(ans.width, W)
    W8 = ans.lit_words.shape[2] * 8  # >= Wa; compared as int64 words of 8 bytes, lit's bytes only
    lit = x.gather(1, (torch.arange(W8, device=x.device) + lead).clamp(max=W - 1))
    words = lit.to(torch.uint8).view(torch.int64)  # [N, W8 / 8]
    same = ((words.unsqueeze(1) & ans.lit_mask) == ans.lit_words).all(dim=-1)
    lit_hit = same & (ans.lit_len > 0) & (ans.lit_len <= Wa) & ~ans.is_num
    lit_hit &= ans.lit_len <= (n.unsqueeze(1) - lead)
    if whole:
        last = torch.where(((cls & NOT_SPACE) > 0) & (pos < n.unsqueeze(1)), pos, -1).amax(dim=1, keepdim=True)
        lit_hit &= ans.lit_len == (last + 1 - lead)
    else:
        after = x.gather(1, (lead + ans.lit_len.clamp(max=Wa)).clamp(max=W - 1))  # [N, K]: byte after the answer
        nxt = lookup(byte_tables(x.device).classes, after)
        lit_hit &= (nxt & C_ALNUM) == 0
        if cut is not None:
            lit_hit &= ~cut.unsqueeze(1) | (lead + ans.lit_len < n.unsqueeze(1))
    return hit | lit_hit.any(dim=1)
