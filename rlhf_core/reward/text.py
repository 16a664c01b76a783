"""Answers matched as TEXT, on the device that generated the responses (no decode, no host round trip).

A model may emit the same text in many tokenizations ('####' as ['####'], ['##', '##'] or ['#', '###'];
' 72' as ['Ġ72'], ['Ġ', '72'] or ['Ġ7', '2']), and graders read text. So the text components turn tokens
into BYTES with a table of the vocabulary built once from the tokenizer (`VocabBytes`: token id -> its
bytes, byte-level BPE 'Ġ'-style characters, SentencePiece '▁' and <0xNN> byte tokens resolved, special
tokens -> no bytes), and match bytes:

  answer_after_marker  the number (or text) right after the LAST marker, however either was split;
  exact_match          the whole response (up to its first stop token) is the answer;
  contains             the answer occurs in the response as a whole number / word (windows around candidates);
  format               texts occur in order.

Numbers are compared in a canonical form computed on the device (`_numbers`): leading spaces and
'$' skipped, commas dropped, trailing sentence punctuation ('.' or ','), trailing fractional zeros and a
bare '.' dropped, leading integer zeros dropped, so `$1,000.00`, `1000.` and `1000` are one number while
`72` never equals `7`, `720`, `7.2` or `-72`. The form is a few int64 chunks of decimal digit values (no
byte compaction), exact for any length. docs/rewards.md lists the accepted forms.

Hot-path rules as in `tensor_native`: batched tensor code only (loops over static sizes: the marker
length, a format text's length), no `.item()` / `.tolist()` / `bool(tensor)` / `nonzero()` / boolean
indexing, no data-dependent shapes. Per call there is ONE pass over all [N, L] tokens (`scan`: one vocabulary
lookup gives each token's stop / can-end-a-marker / can-end-a-format-text bits; the first stop and candidate
blocks come from words of 4 or 8 such codes); then only windows are read, of fixed size:
answer_after_marker reads the last `MARKER_BLOCKS` candidate blocks and converts a window of tokens after the
last marker to bytes; exact_match converts the first tokens of a row; format runs each text's byte automaton
over the first `FORMAT_BLOCKS` candidate blocks after the previous text (or over every token when a text's
last byte is common, see FORMAT_WINDOW_MAX); contains looks up one more per-token code (the byte class of
the token's first byte) and converts short windows around the last `CONTAINS_WINDOWS` candidates. Lookups
use `index_select` on tables indexed by id + 1 (entry 0: ids outside the vocabulary), faster than `take` on
CPU. The answers' text is computed once per PackedPatterns object (cached while the same tensors are passed
again), in windows as wide as the batch's longest answer when the host prepared the patterns
(`TextMatcher.prepare`: AnswerHints read where they are packed, so the device never syncs for them), else
as wide as a static bound.

This tensor code is the reference and the path on accelerators. On CPU, `TextMatcher` runs the same
computation through a fused kernel (`kernel.py`, `text_kernel.c`: one loop per row on the tensors in place, the
same windows and limits; tests/test_reward_kernel.py holds the two equal), because there a call's few hundred
small ops cost more in dispatch than in work; without a C compiler, or with ATRLHF_TEXT_KERNEL=0, this code runs.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import weakref
from dataclasses import dataclass, field, fields, replace

import torch

from rlhf_core.reward import kernel as _kernel

MARKER_BLOCK_TOKENS = 16
MARKER_BLOCKS = 4
"""The marker search cuts a row into blocks of MARKER_BLOCK_TOKENS tokens and reads the last MARKER_BLOCKS
blocks that hold a token able to end a marker occurrence (a token containing '#' for '####'): a marker
followed by that many more blocks with such tokens is not found."""
FORMAT_BLOCKS = 4
"""The format search reads, for each text, the first FORMAT_BLOCKS blocks of MARKER_BLOCK_TOKENS tokens from the
previous text's end that hold a token able to end the text (when every text qualifies: see FORMAT_WINDOW_MAX)."""
FORMAT_WINDOW_MAX = (2, 0.05)
"""Format texts are searched in windows when there are at most 2 of them and, for each, at most 5% of the
vocabulary can end an occurrence (a rare last byte, as '#' or '>'); otherwise every token is read (slower)."""
ANSWER_WINDOW_BYTES = 16
"""Bytes read after the marker beyond the answer's own length (spaces, '$', separators, '.0', a period)."""
ANSWER_MAX_BYTES = 64
"""Answer alternatives are read up to this many bytes (a longer text answer is cut, and cannot match)."""
CONTAINS_BLOCKS, CONTAINS_WINDOWS = 4, 6
"""contains reads the last CONTAINS_BLOCKS blocks of MARKER_BLOCK_TOKENS tokens (before the first stop) that hold
a candidate token (its first byte that is not whitespace, or not whitespace / '$', may be the first byte of
an answer alternative), and of those the last CONTAINS_WINDOWS candidates: an occurrence is looked for where
such a token's text starts."""
CONTAINS_MAX_BYTES = 24
"""contains compares alternatives of at most this many bytes (a longer alternative never matches there)."""
CONTAINS_LEAD_BYTES, CONTAINS_TAIL_BYTES = 4, 6
"""A candidate token's leading whitespace / '$' read (at most), and the bytes read after an occurrence (its
end: a '.0…0' longer than this does not end a number; at most 8)."""
BUFFER_SHAPES = 4
"""On CPU, the scan's and contains' buffers are kept (per thread) for this many distinct batch shapes."""
BYTES_PER_TOKEN = 8
"""Whole-response conversion (`full_text`) keeps at most L * this many bytes of a row."""

_SPACE = (32, 9, 10, 13, 11, 12)  # ' ', \t, \n, \r, \v, \f
_DIGIT0, _DIGIT9, _DOT, _COMMA, _MINUS, _DOLLAR = 48, 57, 46, 44, 45, 36


# ----------------------------------------------------------------------------------------------------
# Build time: the vocabulary as bytes
# ----------------------------------------------------------------------------------------------------


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte ('Ġ' -> 0x20)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(tokenizer) -> set[str]:
    """Types of the fast tokenizer's decoder (and of the members of a Sequence decoder); {'none'} when the
    fast tokenizer has no decoder (decode joins tokens with ' '); {'unknown'} for a slow tokenizer. A
    WordLevel model adds 'WordLevel' (its tokens are words)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {"unknown"}
    state = json.loads(backend.to_str())
    decoder = state.get("decoder")
    word_level = {"WordLevel"} if (state.get("model") or {}).get("type") == "WordLevel" else set()
    if decoder is None:
        return {"none"} | word_level
    types, todo = set(word_level), [decoder]
    while todo:
        d = todo.pop()
        types.add(d.get("type", ""))
        todo += d.get("decoders") or []
    return types


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes of every token id 0..len(tokenizer)-1, as `decode(..., skip_special_tokens=True)` writes them.

    Byte-level BPE (a ByteLevel decoder): each character maps back to its byte ('Ġ72' -> b' 72'), so
    partial UTF-8 tokens keep their exact bytes. SentencePiece / Metaspace: '▁' -> ' ', '<0xNN>' -> that
    byte. WordPiece: '##x' -> 'x', other tokens ' ' + token. A fast tokenizer without a decoder joins
    tokens with ' ', and a WordLevel model without byte-level or '▁' decoding has words for tokens: each
    token gets a leading space ('3' '7' reads ' 3 7', two numbers, even where decode would write '37').
    Special tokens (and ids without a token) -> b''.
    Non-special added tokens are their text.
    """
    vocab = tokenizer.get_vocab()
    n = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
    id_to_token: list[str | None] = [None] * n
    for tok, i in vocab.items():
        id_to_token[i] = tok
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = {}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            special.add(i)
        else:
            added[i] = str(tok.content if hasattr(tok, "content") else tok)
    types = _decoder_types(tokenizer)
    byte_level = "ByteLevel" in types
    if "unknown" in types:  # slow tokenizer: guess from the vocabulary
        byte_level = "\u0120" in vocab and "\u2581" not in vocab
    metaspace = bool(types & {"Metaspace", "Replace", "ByteFallback", "Strip", "Fuse"}) or (
        "unknown" in types and not byte_level
    )
    out = []
    for i, tok in enumerate(id_to_token):
        if tok is None or i in special:
            out.append(b"")
        elif i in added:
            out.append(added[i].encode("utf-8"))
        elif byte_level and all(c in _BYTE_DECODER for c in tok):
            out.append(bytes(_BYTE_DECODER[c] for c in tok))
        elif metaspace or byte_level:
            m = _BYTE_TOKEN.fullmatch(tok)
            out.append(bytes([int(m.group(1), 16)]) if m else tok.replace("\u2581", " ").encode("utf-8"))
        elif "WordPiece" in types:
            out.append(tok[2:].encode("utf-8") if tok.startswith("##") else (" " + tok).encode("utf-8"))
        elif types & {"none", "WordLevel"}:  # tokens are words: one space before each
            out.append((" " + tok).encode("utf-8"))
        else:
            out.append(tok.encode("utf-8"))
    return out


def _kmp_step(marker: bytes):
    """Byte automaton of `marker`: step(state, byte) -> (state, matched). States 0..m-1 (matched prefix length);
    after a match the state falls back to the longest proper border, so overlapping occurrences are found."""
    m = len(marker)
    fail = [0] * (m + 1)
    k = 0
    for i in range(1, m):
        while k and marker[i] != marker[k]:
            k = fail[k]
        if marker[i] == marker[k]:
            k += 1
        fail[i + 1] = k

    def step(s: int, c: int) -> tuple[int, bool]:
        while s and marker[s] != c:
            s = fail[s]
        if marker[s] == c:
            s += 1
        if s == m:
            return fail[m], True
        return s, False

    return step


def _automaton(table: list[bytes], seq: bytes):
    """Per-token tables of the byte automaton of `seq` (m = len): (next_state, first_end, last_end), int64
    [V * m] at v * m + s: the state after token v read from state s, and the byte offset in v just past the
    first / last occurrence of `seq` that ends in it (-1 if none)."""
    m = len(seq)
    V = len(table)
    next_state = torch.zeros(V, m, dtype=torch.long)
    first_end = torch.full((V, m), -1, dtype=torch.long)
    last_end = torch.full((V, m), -1, dtype=torch.long)
    step = _kmp_step(seq)
    seq_bytes = set(seq)
    for v, b in enumerate(table):
        if not b:
            next_state[v] = torch.arange(m)
            continue
        if not seq_bytes.intersection(b):
            continue
        for s0 in range(m):
            s, first, last = s0, -1, -1
            for j, c in enumerate(b):
                s, hit = step(s, c)
                if hit:
                    last = j + 1
                    first = last if first < 0 else first
            next_state[v, s0], first_end[v, s0], last_end[v, s0] = s, first, last
    return next_state.flatten(), first_end.flatten(), last_end.flatten()


@dataclass
class VocabBytes:
    """The vocabulary as bytes, plus per-token lookups for one marker; built once per tokenizer (CPU tensors,
    copied to a device on first use by `TextMatcher`).

    V = the tokenizer's ids + 1: the last id has no bytes (callers map ids outside the vocabulary to it).
    flat: uint8 [T] all tokens' bytes concatenated; offsets: int64 [V] start of each token in `flat`;
    lengths: int64 [V] its byte count (0 for special tokens); max_len: longest token in bytes;
    marker: the marker bytes (m = len); next_state: int64 [V * m] automaton state after token v read from
        state s (index v * m + s); match_end: int64 [V * m] byte offset in token v just past the last marker
        occurrence that ends in it when read from state s, -1 if none; can_end: int32 [V] 1 where any does.
    """

    flat: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    max_len: int
    marker: bytes
    next_state: torch.Tensor
    match_end: torch.Tensor
    can_end: torch.Tensor

    @property
    def V(self) -> int:
        return self.lengths.numel()

    def shifted(self, name: str) -> torch.Tensor:
        """Table `name` indexed by id + 1 (`scan`'s index): the byte-less last id's entries (rows) first."""
        t = getattr(self, name)
        n = t.numel() // self.V
        return torch.cat([t[-n:], t])

    @classmethod
    def build(cls, tokenizer, marker: str) -> VocabBytes:
        table = token_bytes(tokenizer) + [b""]  # one more, byte-less id: where out-of-vocabulary ids are read
        V = len(table)
        lengths = torch.tensor([len(b) for b in table], dtype=torch.long)
        offsets = torch.zeros(V, dtype=torch.long)
        if V > 1:
            offsets[1:] = lengths.cumsum(0)[:-1]
        flat = torch.frombuffer(bytearray(b"".join(table)) or bytearray(1), dtype=torch.uint8).clone()
        mk = marker.encode("utf-8")
        m = max(len(mk), 1)
        next_state = torch.zeros(V, m, dtype=torch.long)
        match_end = torch.full((V, m), -1, dtype=torch.long)
        if mk:
            step = _kmp_step(mk)
            marker_bytes = set(mk)
            for v, b in enumerate(table):
                if not b:  # no bytes: the state passes through unchanged
                    next_state[v] = torch.arange(m)
                    continue
                if not marker_bytes.intersection(b):
                    continue  # state 0 after its first byte, and no occurrence: the zero defaults
                for s0 in range(m):
                    s, end = s0, -1
                    for j, c in enumerate(b):
                        s, hit = step(s, c)
                        if hit:
                            end = j + 1
                    next_state[v, s0] = s
                    match_end[v, s0] = end
        return cls(
            flat=flat,
            offsets=offsets,
            lengths=lengths,
            max_len=int(lengths.max()) if V else 0,
            marker=mk,
            next_state=next_state.flatten(),
            match_end=match_end.flatten(),
            can_end=(match_end >= 0).any(dim=1).to(torch.int32),
        )

    def to(self, device) -> VocabBytes:
        vb = VocabBytes(
            flat=self.flat.to(device),
            offsets=self.offsets.to(device),
            lengths=self.lengths.to(device),
            max_len=self.max_len,
            marker=self.marker,
            next_state=self.next_state.to(device),
            match_end=self.match_end.to(device),
            can_end=self.can_end.to(device),
        )
        # tables by id + 1 (index 0: outside the vocabulary), for index_select on non-negative indices
        vb.lengths1, vb.offsets1 = vb.shifted("lengths"), vb.shifted("offsets")
        vb.lengths1_i, vb.offsets1_i = vb.lengths1.to(torch.int32), vb.offsets1.to(torch.int32)
        vb.flat0 = torch.cat([vb.flat, vb.flat.new_zeros(1)])  # one 0 byte more, at zero_at: read past a text's end
        vb.zero_at = vb.flat.numel()
        vb.next_state1, vb.match_end1 = vb.shifted("next_state"), vb.shifted("match_end")
        vb.next_state1_i, vb.match_end1_i = vb.next_state1.to(torch.int32), vb.match_end1.to(torch.int32)
        return vb


# ----------------------------------------------------------------------------------------------------
# Hot path: tokens -> bytes, number canonicalisation, matching
# ----------------------------------------------------------------------------------------------------


# Byte classes (one table lookup per byte, then bit tests): bits set for what a byte IS or IS NOT, so that
# "the first byte that is not X" is one argmax over (class & NOT_X) (the first maximum; a zero sentinel byte
# after every text has every NOT_ bit, so there is always one).
_NOT_SKIP, _NOT_BODY, _NOT_SPACE, _C_DIGIT, _C_COMMA, _C_DOT, _C_MINUS, _C_ALNUM = 1, 2, 4, 8, 16, 32, 64, 128
_DIGIT_SHIFT, _DOT_SHIFT, _MINUS_SHIFT = 3, 5, 6


def _byte_classes() -> torch.Tensor:
    cls = []
    for b in range(256):
        space = b in _SPACE
        digit = _DIGIT0 <= b <= _DIGIT9
        c = 0 if (space or b == _DOLLAR) else _NOT_SKIP
        c |= 0 if (digit or b in (_COMMA, _DOT)) else _NOT_BODY
        c |= 0 if space else _NOT_SPACE
        c |= _C_DIGIT if digit else 0
        c |= _C_COMMA if b == _COMMA else 0
        c |= _C_DOT if b == _DOT else 0
        c |= _C_MINUS if b == _MINUS else 0
        c |= _C_ALNUM if (digit or 65 <= b <= 90 or 97 <= b <= 122 or b >= 128) else 0
        cls.append(c)
    return torch.tensor(cls, dtype=torch.long)


_CLASSES = _byte_classes()


def _byte_bucket(b: int) -> int:
    """One of 31 buckets of a byte (a bit of int32 candidate masks): digits, '-' and '$' their own, letters by
    their lower case, other bytes shared."""
    if _DIGIT0 <= b <= _DIGIT9:
        return b - _DIGIT0
    if b == _MINUS:
        return 10
    if b == _DOLLAR:
        return 11
    if 65 <= b <= 90 or 97 <= b <= 122:
        return 12 + ((b | 32) - 97) % 19
    return 12 + b % 19


_BUCKETS = torch.tensor([1 << _byte_bucket(b) for b in range(256)], dtype=torch.int32)
_CHUNK = 18  # decimal digits per int64 chunk of a canonical number (10**18 < 2**63)
_DIGIT_POW10 = torch.tensor(  # [256 * _CHUNK]: byte b, exponent e -> digit value of b (0 if none) * 10**e
    [(b - _DIGIT0) * 10**e if _DIGIT0 <= b <= _DIGIT9 else 0 for b in range(256) for e in range(_CHUNK)],
    dtype=torch.long,
)
_CONSTS: dict = {}


def _consts(device: torch.device) -> tuple[torch.Tensor, ...]:
    """(_CLASSES, _DIGIT_POW10, _BUCKETS, _CLASSES as int32, _DIGIT_POW10 then its negation) on `device`, copied
    once."""
    return _cached(
        device,
        lambda: (
            _CLASSES.to(device),
            _DIGIT_POW10.to(device),
            _BUCKETS.to(device),
            _CLASSES.to(device, torch.int32),
            torch.cat([_DIGIT_POW10, -_DIGIT_POW10]).to(device),  # signed: [sign * 256 * _CHUNK + b * _CHUNK + e]
        ),
    )


def _cached(key, make):
    """_CONSTS[key], made by make() the first time (small constant tensors, per device)."""
    c = _CONSTS.get(key)
    if c is None:
        c = _CONSTS[key] = make()
    return c


def _dot_zero_words(T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [T - 2] each: '.' and j - 1 '0's as the first j bytes of an int64 word, and the mask of those bytes,
    for j = 2 .. T - 1 (T <= 8); copied to `device` once."""

    def make():
        heads = [int.from_bytes(b"." + b"0" * (j - 1), "little") for j in range(2, T)]
        masks = [(1 << 8 * j) - 1 for j in range(2, T)]
        return torch.tensor(heads, device=device), torch.tensor(masks, device=device)

    return _cached(("dot_zeros", T, device), make)


def _at(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for a 1-D table and non-negative idx of any shape (index_select: faster than take on CPU)."""
    return table.index_select(0, idx.reshape(-1)).view(idx.shape)


def tokens_to_bytes(
    vb: VocabBytes,
    tok: torch.Tensor,
    n_tok: torch.Tensor | None,
    skip: torch.Tensor | None,
    width: int,
    shifted: bool = False,
    dtype: torch.dtype = torch.long,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The text of token rows as bytes: (bytes [R, width + 1] of `dtype` (0 past the end: the last column is
    always 0, a sentinel), lengths LongTensor [R] (at most width)).

    tok: [R, A] token ids (outside [0, V) read as the byte-less last id), or, with shifted, ids + 1 in [0, V] as
    `scan`'s index (0: byte-less); n_tok: LongTensor [R] tokens of each row to read (the rest ignored; None: all);
    skip: LongTensor [R] leading bytes to drop (or None); width: static byte width (longer text is cut). Each
    token's start byte comes from a cumsum of the tokens' byte lengths; each output byte's flat-table index is
    the start index of the last token starting at or before it (a scatter of the differences of those indices at
    the starts, and a cumsum) plus its position. int32 arithmetic (int64 adds are several times slower on CPU).
    """
    R, A = tok.shape
    device = tok.device
    if A == 0 or width == 0:
        return torch.zeros(R, width + 1, dtype=dtype, device=device), torch.zeros(R, dtype=torch.long, device=device)
    if not shifted:
        tok = tok.clamp(-1, vb.V - 1).add_(1)  # id + 1: 0 reads the byte-less last id
    if n_tok is not None:
        tok = tok * (torch.arange(A, device=device) < n_tok.unsqueeze(1))  # tokens not read: byte-less
    lens = _at(vb.lengths1_i, tok)  # int32 [R, A]
    ends = lens.cumsum(dim=1, dtype=torch.int32)
    starts = ends - lens
    total = ends[:, -1]
    if skip is not None:
        skip = skip.to(torch.int32)
        starts -= skip.unsqueeze(1)
        total = total - skip
    base = _at(vb.offsets1_i, tok) - starts  # flat index of byte j of the row in token t: base[t] + j
    delta = base - torch.nn.functional.pad(base[:, :-1], (1, 0))
    acc = torch.zeros(R, width + 2, dtype=torch.int32, device=device)
    acc.scatter_add_(1, starts.clamp(0, width + 1).long(), delta)  # starts are ascending: the sums telescope
    j = torch.arange(width + 1, dtype=torch.int32, device=device)
    length = total.clamp(0, width)
    src = torch.where(j < length.unsqueeze(1), acc.cumsum(dim=1, dtype=torch.int32)[:, : width + 1] + j, vb.zero_at)
    return _at(vb.flat0, src).to(dtype), length.long()


def _numbers(x: torch.Tensor, cls: torch.Tensor):
    """The number at the start of each byte row, in canonical form. x: LongTensor [R, W] bytes, 0 past the end,
    the last column 0; cls: _CLASSES of x.

    Skips leading whitespace and '$'; reads an optional '-', then a run of digits, ',' and '.' that starts with
    a digit; drops trailing ',' / '.' (sentence punctuation), every ',' (thousands separators), leading integer
    zeros, trailing fractional zeros and a bare '.'; '-0' is '0'. The canonical form is exact and compared as
    int64 chunks: [integer digits 0-17 from the right, fraction digits 1-18, integer digits 18-35, fraction
    digits 19-36, ...], each chunk the digits' decimal value (the fraction's read from its end), negated for a
    negative number, so leading integer zeros and trailing fraction zeros add nothing and '-0' is '0'.
    Returns (canon LongTensor [R, 2C], is_number BoolTensor [R] (a digit was found and the run has at most one
    '.' with no ',' after it), rest LongTensor [R]: index just past the run, trailing punctuation included).
    """
    R, W = x.shape
    C = -(-W // _CHUNK)
    pos, pos1, rpos = _positions(W, x.device)
    j0 = (cls & _NOT_SKIP).argmax(dim=1, keepdim=True)  # first byte that is not a space or '$'
    neg = (cls.gather(1, j0) >> _MINUS_SHIFT) & 1  # [R, 1] 0 / 1
    j1 = j0 + neg  # after an optional '-'
    after = pos >= j1
    rest = ((cls & _NOT_BODY) * after).argmax(dim=1, keepdim=True)  # first byte past the run
    digit = ((cls >> _DIGIT_SHIFT) & 1) * (pos < rest)  # 0 / 1: the run's digits (no digit comes before j1)
    end = (digit * pos1).amax(dim=1, keepdim=True)  # past the last digit: trailing ',' / '.' dropped
    sep = (cls & (_C_DOT | _C_COMMA)) * (after & (pos < end))  # the number's separators (their class bits)
    # first '.', W = none (as W - the largest W - pos over the '.'s: amax is several times faster than amin here)
    dot = W - (((sep & _C_DOT) * rpos).amax(dim=1, keepdim=True) >> _DOT_SHIFT)
    # a number: a digit first, and no separator after its first '.' (a second '.', a ','): 8 > that separator's bits
    is_number = ((cls.gather(1, j1) & _C_DIGIT) > (sep * (pos > dot)).amax(dim=1, keepdim=True)).squeeze(1)
    cnt = digit.cumsum(dim=1)
    r = cnt - cnt.gather(1, (dot - 1).clamp_(min=0))  # <= 0: integer digit, -r after it; > 0: fraction digit r
    frac = r > 0
    q = torch.maximum(r - 1, -r)  # fraction: r - 1; integer: -r
    # q // 18 and q % 18 for 0 <= q < 20000 by a multiply and a shift (exact there; a division is slower)
    div = (q * 3641) >> 16 if W < 20000 else q // _CHUNK
    # digit value * 10 ** (q % 18), negated for a negative number (the table's second half); 0 off the digits
    val = _at(_consts(x.device)[4], (x * _CHUNK + (q - div * _CHUNK) + neg * (256 * _CHUNK)) * digit)
    col = (div * 2 + frac).clamp_(max=2 * C - 1)
    canon = torch.zeros(R, 2 * C, dtype=torch.long, device=x.device).scatter_add_(1, col, val)
    return canon, is_number, rest.squeeze(1)


def _positions(W: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(arange(W), arange(1, W + 1), W - arange(W)) on `device`, made once per width."""

    def make():
        pos = torch.arange(W, device=device)
        return pos, pos + 1, W - pos

    return _cached(("positions", W, device), make)


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [R, Ca], b [R, K, Cb] canonical numbers (zero-padded to one width) -> equal BoolTensor [R, K]."""
    w = max(a.shape[1], b.shape[2])
    if a.shape[1] < w:
        a = torch.nn.functional.pad(a, (0, w - a.shape[1]))
    if b.shape[2] < w:
        b = torch.nn.functional.pad(b, (0, w - b.shape[2]))
    return (a.unsqueeze(1) == b).all(dim=-1)


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
    canon [N, K, 2C] / is_num [N, K]: its canonical number (see `_numbers`), where the whole stripped text
    is one number (trailing '.' allowed). Length 0 = absent alternative (never matches).
    """

    lit: torch.Tensor
    lit_len: torch.Tensor
    canon: torch.Tensor
    is_num: torch.Tensor
    first_mask: torch.Tensor | None = None  # int32 [N]: _byte_bucket bits of the alternatives' first bytes
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


def _static_width(vb: VocabBytes, Q: int, max_bytes: int = ANSWER_MAX_BYTES) -> int:
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
    width = _static_width(vb, tokens.shape[2], max_bytes)
    if hints is not None:
        width = max(1, min(width, hints.width))
    return _finish_answers(*_answer_fields(vb, tokens, lengths, width), hints)


def _answer_fields(vb: VocabBytes, tokens: torch.Tensor, lengths: torch.Tensor, width: int):
    """(lit [N, K, width], lit_len [N, K], canon [N, K, 2C], is_num [N, K]) of the alternatives (see AnswerText), read
    in `width` bytes (a longer alternative: length 0)."""
    N, K, Q = tokens.shape
    b, b_len = tokens_to_bytes(vb, tokens.reshape(N * K, Q), lengths.reshape(N * K), None, width + 1)
    fits = b_len <= width
    x = b[:, : width + 1] * fits.unsqueeze(1)  # column `width` is 0 where it fits
    cls = _at(_consts(x.device)[0], x)
    canon, is_num, rest = _numbers(x, cls)
    pos = torch.arange(width + 1, device=x.device)
    nonspace = ((cls & _NOT_SPACE) > 0) & (pos < b_len.unsqueeze(1))
    lead = (cls & _NOT_SPACE).argmax(dim=1, keepdim=True)
    last = torch.where(nonspace, pos, -1).amax(dim=1, keepdim=True)
    lit_len = ((last + 1 - lead).clamp(min=0) * fits.unsqueeze(1)).squeeze(1)
    lit = x.gather(1, (pos[:width] + lead).clamp(max=width)) * (pos[:width] < lit_len.unsqueeze(1))
    is_num = is_num & (rest >= last.squeeze(1) + 1) & (lit_len > 0)
    lit = lit.reshape(N, K, width)
    lit_len = lit_len.reshape(N, K)
    canon = canon.reshape(N, K, canon.shape[1])
    is_num = is_num.reshape(N, K)
    return lit, lit_len, canon, is_num


def _finish_answers(
    lit: torch.Tensor,
    lit_len: torch.Tensor,
    canon: torch.Tensor,
    is_num: torch.Tensor,
    hints: AnswerHints | None,
    keep: torch.Tensor | None = None,
) -> AnswerText:
    """The AnswerText of `_answer_fields`: with hints.alternatives, each row's distinct texts (keep: `_distinct`, if
    known) in that many slots; then the first bytes' buckets and the texts as int64 words."""
    N, K, width = lit.shape
    device = lit.device
    if hints is not None and 0 < hints.alternatives < K:  # each row's distinct texts into `alternatives` slots
        k2 = hints.alternatives
        keep = _distinct(lit, lit_len) if keep is None else keep
        slot = torch.where(keep, keep.long().cumsum(1) - 1, k2).clamp_(max=k2)
        src = torch.full((N, k2 + 1), K, dtype=torch.long, device=device)
        src = src.scatter_(1, slot, torch.arange(K, device=device).expand(N, K))[:, :k2]  # K: no alternative
        have, src = src < K, src.clamp(max=K - 1)
        lit = lit.gather(1, src.unsqueeze(-1).expand(N, k2, width))
        lit_len = lit_len.gather(1, src) * have
        canon = canon.gather(1, src.unsqueeze(-1).expand(N, k2, canon.shape[2]))
        is_num = is_num.gather(1, src) & have
        K = k2
    buckets = _consts(device)[2]
    first = torch.where(lit_len > 0, _at(buckets, lit[:, :, 0]), 0)  # [N, K]
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


def _distinct(lit: torch.Tensor, lit_len: torch.Tensor) -> torch.Tensor:
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


def _matches_answer(
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
    cls = _at(_consts(x.device)[0], x)
    pos = torch.arange(W, device=x.device)
    hit = torch.zeros(N, dtype=torch.bool, device=x.device)
    if ans.any_num is not False:  # None: not known on the host
        canon, is_number, rest = _numbers(x, cls)
        num_hit = _same(canon, ans.canon) & (is_number.unsqueeze(1) & ans.is_num)
        if whole:
            tail = ((cls & _NOT_SPACE) > 0) & (pos >= rest.unsqueeze(1)) & (pos < n.unsqueeze(1))
            num_hit &= ~tail.any(dim=1).unsqueeze(1)
        hit = num_hit.any(dim=1)
        if cut is not None:
            hit &= ~cut | (rest < n)
    if ans.any_text is False:
        return hit
    lead = (cls & _NOT_SPACE).argmax(dim=1, keepdim=True)  # first non-space (the sentinel when none)
    Wa = min(ans.width, W)
    W8 = ans.lit_words.shape[2] * 8  # >= Wa; compared as int64 words of 8 bytes, lit's bytes only
    lit = x.gather(1, (torch.arange(W8, device=x.device) + lead).clamp(max=W - 1))
    words = lit.to(torch.uint8).view(torch.int64)  # [N, W8 / 8]
    same = ((words.unsqueeze(1) & ans.lit_mask) == ans.lit_words).all(dim=-1)
    lit_hit = same & (ans.lit_len > 0) & (ans.lit_len <= Wa) & ~ans.is_num
    lit_hit &= ans.lit_len <= (n.unsqueeze(1) - lead)
    if whole:
        last = torch.where(((cls & _NOT_SPACE) > 0) & (pos < n.unsqueeze(1)), pos, -1).amax(dim=1, keepdim=True)
        lit_hit &= ans.lit_len == (last + 1 - lead)
    else:
        after = x.gather(1, (lead + ans.lit_len.clamp(max=Wa)).clamp(max=W - 1))  # [N, K]: byte after the answer
        nxt = _at(_consts(x.device)[0], after)
        lit_hit &= (nxt & _C_ALNUM) == 0
        if cut is not None:
            lit_hit &= ~cut.unsqueeze(1) | (lead + ans.lit_len < n.unsqueeze(1))
    return hit | lit_hit.any(dim=1)


def first_stop(is_stop: torch.Tensor) -> torch.Tensor:
    """Index of the first True of each row (L when none). is_stop: BoolTensor [N, L] -> LongTensor [N]."""
    L = is_stop.shape[1]
    return torch.where(is_stop, torch.arange(L, device=is_stop.device), L).amin(dim=1)


_TEXT = ":text"  # text_hints key suffix (after the matcher's token) of its PreparedText
_CAN_END, _STOP, _FORMAT0 = 1, 2, 4  # bits of the per-token codes of `scan`; format text i: _FORMAT0 << 3 * i
# For format text i, three bits from _FORMAT0 << 3 * i: CAN (the token ends an occurrence from some state),
# WHOLE (from state 0), ADV (the token can leave a state >= 1, or has no bytes). A token can end an occurrence
# only if WHOLE, or CAN and the token before it is ADV: a pair test on int64 words of 8 codes.


_FORMAT_WINDOW_NONE = 1 << 40  # format_windows: "no end" for a (token * stride + offset), and the first text's -start
_FORMAT_TOKENS_NONE = 1 << 62  # format_tokens: "no end" for a byte position


def _word_mask(bit: int, size: int = 8) -> int:
    """`bit` in each of the `size` bytes of an int64 (8) / int32 (4) word (as a signed integer)."""
    w = int.from_bytes(bytes([bit]) * size, "little")
    return w - (1 << 8 * size) if w >= 1 << (8 * size - 1) else w


def scan(codes_table: torch.Tensor, ids: torch.Tensor, block: int = MARKER_BLOCK_TOKENS, scratch=None):
    """The one [N, L] pass over the tokens: each id's code (uint8 bits _CAN_END, _STOP) by one vocabulary
    lookup. codes_table: uint8 [V + 1], entry 0 for ids outside [0, V) (the byte-less last id's code), entry
    v + 1 for id v. Returns (codes uint8 [N, Lp] (Lp = L rounded up to a multiple of `block`, padding 0),
    n_valid LongTensor [N]: the first stop of each row, L when none, index int32 [N, L]: id + 1, 0 outside the
    vocabulary). Ids are converted to int32: an id outside the int32 range wraps (real ids are far below). The first
    stop is found on int32 words of 4 codes: the first word holding a stop bit, then its 4 bytes. scratch: an
    optional (int32 [N, L], uint8 [N, L]) pair of buffers for the index and the codes (the codes' buffer is used
    when L is a multiple of `block`; fresh multi-MB CPU buffers cost page faults on every call)."""
    N, L = ids.shape
    V = codes_table.numel() - 1
    Lp = _padded_length(L, block)
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
    stop_w = (words & _word_mask(_STOP, 4)).clamp_(max=1)
    ar = torch.arange(nw, 0, -1, dtype=torch.int32, device=ids.device)
    fw = (nw - (stop_w.mul_(ar)).amax(dim=1, keepdim=True)).clamp_(max=nw - 1).long()
    # its first stop byte: the lowest stop bit of the word (w & -w: _STOP << 8 * byte, 0 = none), named by a
    # lookup of 256 ** byte % 11 (1, 3, 9, 5 for bytes 0-3; 0 -> 4: none in the word)
    w = words.gather(1, fw) & _word_mask(_STOP, 4)
    first = _at(_first_stop_byte(ids.device), ((w & -w) >> (_STOP.bit_length() - 1)) % 11)
    n_valid = (fw * 4 + first).clamp_(max=L).squeeze(1)
    return codes, n_valid, idx


def _padded_length(L: int, block: int = MARKER_BLOCK_TOKENS) -> int:
    """The codes' row length for rows of L tokens: L rounded up to a whole number of blocks (at least one)."""
    return -(-max(L, 1) // block) * block


def _first_stop_byte(device: torch.device) -> torch.Tensor:
    """int64 [11]: 256 ** b % 11 -> b for b in 0..3, 0 -> 4 (see `scan`); copied to `device` once."""

    def make():
        table = [4] * 11
        for b in range(4):
            table[256**b % 11] = b
        return torch.tensor(table, device=device)

    return _cached(("first stop byte", device), make)


def _blocks_with(codes: torch.Tensor, bit: int, block: int) -> torch.Tensor:
    """BoolTensor [N, Lp / block]: blocks of `block` codes (uint8 [N, Lp]) holding a code with `bit`, read as int64
    words of 8 codes."""
    N = codes.shape[0]
    words = codes.view(torch.int64).view(N, codes.shape[1] // block, block // 8)
    either = words[..., 0]
    for i in range(1, block // 8):  # the OR of a block's words (one OR for the default block)
        either = either | words[..., i]
    return (either & _word_mask(bit)) != 0


def _pick_blocks(has: torch.Tensor, k: int, last: bool) -> torch.Tensor:
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
    occurrence (`can_end`, the _CAN_END bit of the codes) are candidates; the row is cut into blocks of `block`
    tokens and the last `blocks` blocks that start before the first stop and hold a candidate are searched
    (candidates after the stop in the stop's own block count there, and are then ignored): for each token
    there, the automaton state before it is recomputed from the m - 1 tokens before it (every non-special
    token has a byte, so they hold the m - 1 bytes the state depends on).
    """
    N, L = index.shape
    device = index.device
    m = max(len(vb.marker), 1)
    has = _blocks_with(codes, _CAN_END, block) & (
        torch.arange(codes.shape[1] // block, device=device) * block < n_valid.unsqueeze(1)
    )
    chosen = _pick_blocks(has, blocks, last=True)  # [N, k] ascending, -1 = none (first)
    k = chosen.shape[1]
    # each chosen block with the m - 1 tokens before it, as (id + 1) * m row offsets into the int32 tables:
    # [N, k, m - 1 + block]; token p - (m - 1) + d of every position p of a block is the slice d .. d + block
    tm = _block_windows(index, chosen, block, m - 1).mul_(m)
    end = _at(vb.match_end1_i, _table_rows(tm, vb.next_state1_i, m))  # [N, k, block], -1 = no occurrence ends there
    valid = (end >= 0) & _before_stop(chosen, n_valid, block)
    # the last occurrence: blocks are ascending, so the largest (k * block index) * stride + end over valid ones
    stride = vb.max_len + 1
    order = torch.arange(k * block, dtype=torch.int32, device=device).view(k, block) * stride
    best = torch.where(valid, order + end, -1).flatten(1).amax(dim=1).long()
    found = best >= 0
    best = best.clamp(min=0)
    at = best // stride  # k * block index
    token = (chosen.gather(1, (at // block).unsqueeze(1)).squeeze(1) * block + at % block) * found  # 0: none
    return found, token, best % stride


def _table_rows(tm: torch.Tensor, next_state: torch.Tensor, m: int) -> torch.Tensor:
    """For each position of blocks with the m - 1 tokens before them (`_block_windows`, times m: automaton table
    rows by id + 1, [N, k, m - 1 + block]), its automaton table row: the state before it, walked from state 0 over
    those m - 1 tokens, plus its own row offset. -> [N, k, block]."""
    block = tm.shape[2] - (m - 1)
    state = None
    for d in range(m - 1):
        state = _at(next_state, tm[:, :, d : d + block] if state is None else tm[:, :, d : d + block] + state)
    return tm[:, :, m - 1 :] if state is None else tm[:, :, m - 1 :] + state


def _before_stop(chosen: torch.Tensor, n_valid: torch.Tensor, block: int) -> torch.Tensor:
    """BoolTensor [N, k, block]: the positions of the chosen blocks (LongTensor [N, k], -1 = none: no position)
    before the row's first stop."""
    lim = torch.where(chosen >= 0, n_valid.unsqueeze(1) - chosen * block, 0).to(torch.int32)
    return torch.arange(block, dtype=torch.int32, device=chosen.device) < lim.unsqueeze(-1)


def _block_windows(index: torch.Tensor, chosen: torch.Tensor, block: int, before: int) -> torch.Tensor:
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


def full_text(vb: VocabBytes, ids: torch.Tensor, n_valid: torch.Tensor, bytes_per_token: int = BYTES_PER_TOKEN):
    """Whole rows as bytes (up to the first stop): (bytes [N, W], lengths [N]),
    W = L * min(max_len, bytes_per_token)."""
    L = ids.shape[1]
    width = L * max(1, min(vb.max_len, bytes_per_token))
    return tokens_to_bytes(vb, ids, n_valid, None, width)


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
    digit = lambda v: (v >= _DIGIT0) & (v <= _DIGIT9)  # noqa: E731
    sep = lambda v: (v == _DOT) | (v == _COMMA)  # noqa: E731
    prev, prev2 = pad[:, 1 : W + 1], pad[:, :W]
    before_ok = ~_is_alnum(prev) & (prev != _MINUS) & ~(sep(prev) & digit(prev2))  # [N, W]
    # the byte after an occurrence starting at s: x[s + len]
    nxt_idx = (pos + ans.lit_len.unsqueeze(-1)) + 2  # [N, K, W] into pad
    flat_pad = pad.unsqueeze(1).expand(N, ans.lit.shape[1], pad.shape[1])
    nxt = flat_pad.gather(2, nxt_idx)
    nxt2 = flat_pad.gather(2, nxt_idx + 1)
    # '.0…0' then a non-digit: find the end of the zero run after a '.' by a reverse cummin over positions
    Wp = pad.shape[1]
    pos_p = torch.arange(Wp, device=x.device)
    nonzero_at = torch.where(pad != _DIGIT0, pos_p, Wp).flip(-1).cummin(dim=-1).values.flip(-1)  # next non-'0'
    zero_end = nonzero_at.unsqueeze(1).expand(N, ans.lit.shape[1], Wp).gather(2, (nxt_idx + 1).clamp(max=Wp - 1))
    after_zeros = flat_pad.gather(2, zero_end.clamp(max=Wp - 1))
    dot_zeros = (nxt == _DOT) & (zero_end > nxt_idx + 1) & ~digit(after_zeros) & ~_is_alnum(after_zeros)
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

    first_table: int32 [V + 1] (entry 0 for ids outside the vocabulary, v + 1 for id v): the _byte_bucket bits
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
    Lp = _padded_length(L, block)
    if Lp == L and scratch is not None:  # a reused buffer: page faults of a fresh one cost more than the lookup
        first = torch.index_select(first_table, 0, index.view(-1), out=scratch.view(-1)).view(N, L)
    else:
        first = torch.nn.functional.pad(_at(first_table, index), (0, Lp - L))  # int32 [N, Lp]
    # candidates: codes meeting the row's mask (in place: `first` is this call's own buffer); blocks holding one:
    # the largest of their int64 words of 2 masked codes is not 0 (the codes are below 2**31)
    first &= ans.first_mask.unsqueeze(1)
    has = (first.view(torch.int64).view(N, Lp // block, block // 2).amax(dim=-1) != 0) & (
        torch.arange(Lp // block, device=device) * block < n_valid.unsqueeze(1)
    )
    chosen = _pick_blocks(has, blocks, last=True)
    p = (chosen.unsqueeze(-1) * block + torch.arange(block, device=device)).flatten(1)  # [N, kb * block]
    live = (p >= 0) & (p < n_valid.unsqueeze(1)) & (first.gather(1, p.clamp(0, Lp - 1)) != 0)
    sel = _pick_blocks(live, windows, last=True)  # [N, C] columns of p, -1 = none
    c = p.gather(1, sel.clamp(min=0))
    C = c.shape[1]
    Wc = ans.words.shape[2] * 8
    W = 2 + CONTAINS_LEAD_BYTES + Wc + CONTAINS_TAIL_BYTES + 1  # one byte more: a window the text runs past
    A = min(W, L + 2)
    q = c.unsqueeze(-1) - 2 + torch.arange(A, device=device)  # [N, C, A]: tokens c - 2 ..
    read = (q >= 0) & (q < n_valid.view(N, 1, 1))  # tokens not read (before the row, from its stop) are byte-less
    tok = index.gather(1, q.clamp(0, L - 1).flatten(1)).view(N, C, A) * read  # ids + 1
    pre2 = _at(vb.lengths1_i, tok[:, :, :2])
    pre = pre2[..., 0] + pre2[..., 1]  # bytes of the two tokens before the candidate
    x, x_len = tokens_to_bytes(vb, tok.view(N * C, A), None, (pre - 2).clamp(min=0).view(-1), W, True, torch.int32)
    # the text goes on past the window (more bytes, or tokens not read: byte-less ones took their place): an
    # occurrence whose end and tail bytes are not all in the window is not decided, and does not count
    cut = (x_len >= W) | (n_valid.unsqueeze(1) - c + 2 > A).view(-1)  # [R]
    consts = _consts(device)
    cls = _at(consts[3], x)  # int32 [R, W + 1]
    pos = torch.arange(W + 1, device=device)
    s1 = ((cls & _NOT_SPACE) * (pos >= pre.clamp(max=2).view(-1, 1))).argmax(dim=1, keepdim=True)
    s2 = s1 + (x.gather(1, s1) == _DOLLAR)
    st = torch.cat([s1, s2], dim=1)  # [R, 2]: both starts (after the whitespace, and after a '$' there) at once
    xr = x.view(N, C, W + 1)
    lit_len = ans.lit_len.view(N, 1, 1, K)
    fit = (lit_len > 0) & (lit_len <= Wc)
    cls_of = lambda v: _at(consts[3], v)  # noqa: E731
    b1, b2 = x.gather(1, (st - 1).clamp(min=0)) * (st >= 1), x.gather(1, (st - 2).clamp(min=0)) * (st >= 2)
    c1, c2 = cls_of(b1), cls_of(b2)
    before_ok = ((c1 & (_C_ALNUM | _C_MINUS)) == 0) & ~(((c1 & (_C_DOT | _C_COMMA)) > 0) & ((c2 & _C_DIGIT) > 0))
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
    dot_zeros = (((word.unsqueeze(-1) & masks) == heads) & ((ct[..., 2:T] & _C_ALNUM) == 0)).any(dim=-1)
    after_ok = ((cn & _C_ALNUM) == 0) & ~(((cn & (_C_DOT | _C_COMMA)) > 0) & ((c2 & _C_DIGIT) > 0)) | dot_zeros
    ok = same & before_ok.view(N, C, 2, 1) & after_ok & (a <= x_len.view(N, C, 1, 1)) & fit
    ok &= ~cut.view(N, C, 1, 1) | (a + T <= x_len.view(N, C, 1, 1))
    hit = ok.any(dim=2)  # [N, C, K]
    return (hit & (sel >= 0).unsqueeze(-1)).flatten(1).any(dim=1)


def format_tokens(vb: VocabBytes, index: torch.Tensor, n_valid: torch.Tensor, automata) -> torch.Tensor:
    """Whether the format texts occur in order, non-overlapping, before the first stop. -> FloatTensor [N].

    index: IntTensor [N, L] id + 1 (0: byte-less), from `scan`; automata: per text (next_state, first_end,
    last_end, m) from `_automaton`. No bytes are made: for every token, the automaton state before it is
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
    lens = _at(vb.lengths1, index)
    start = lens.cumsum(dim=1) - lens
    live = torch.arange(L, device=index.device) < n_valid.unsqueeze(1)
    prev_end = torch.zeros(N, 1, dtype=torch.long, device=index.device)
    for next_state, first_end, last_end, m in automata:
        state = torch.zeros_like(index)
        for d in range(m - 1, 0, -1):  # the tokens at i - (m - 1) .. i - 1, in order, from state 0
            t = torch.nn.functional.pad(index[:, : max(L - d, 0)], (min(d, L), 0))
            state = _at(next_state, t * m + state)
        row = index * m + state
        ends = []
        for table in (first_end, last_end):
            e = _at(table, row)
            at = start + e
            ends.append(torch.where((e >= 0) & (at - m >= prev_end) & live, at, big))
        prev_end = torch.minimum(ends[0], ends[1]).amin(dim=1, keepdim=True)
    return (prev_end < big).squeeze(1).float()


def _format_blocks(codes: torch.Tensor, i: int, block: int) -> torch.Tensor:
    """BoolTensor [N, Lp / block]: blocks holding a token that may end format text i (WHOLE, or CAN after an ADV
    token), on int64 words of 8 codes; the first token of a word counts its predecessor as ADV (a superset)."""
    can = _FORMAT0 << 3 * i
    N = codes.shape[0]
    w = codes.view(torch.int64)
    prev_adv = ((w << 8) | (can << 2)) & _word_mask(can << 2)  # each byte: the ADV bit of the token before it
    cand = (w & (prev_adv >> 2) & _word_mask(can)) | ((w & _word_mask(can << 1)) >> 1)  # CAN bits only: >= 0
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

    index, codes, n_valid: from `scan` (codes carry text i's CAN / WHOLE / ADV bits, see _FORMAT0). For
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
        chosen = _pick_blocks(has, blocks, last=False)  # [N, k], -1 = none (last)
        k = chosen.shape[1]
        # each chosen block with the m - 1 tokens before it (as in last_marker): [N, k, m - 1 + block] of id + 1
        # (0 before the row); token p - j of every position p of a block is the slice m - 1 - j ..
        t = _block_windows(index, chosen, block, m - 1)
        row = _table_rows(t * m, next_state, m)  # [N, k, block]
        if first and final:  # one text: whether it occurs (a token's last occurrence ends there if any does)
            return ((_at(last_end, row) >= 0) & _before_stop(chosen, n_valid, block)).flatten(1).any(dim=1).float()
        row = row.reshape(N, k * block)
        p = (chosen.unsqueeze(-1) * block + torch.arange(block, device=device)).flatten(1)  # [N, P]
        ok = (p >= 0) & (p < n_valid.unsqueeze(1))
        if not first:
            ok &= p >= p0
        # the bytes between the previous text's end and token p (for d < m): tokens p - 1 .. p - d, less e0
        lens = _at(vb.lengths1, t[:, :, : m - 1 + block - 1])
        d = p - p0
        between = -e0.expand(N, k * block)
        for j in range(1, m):
            between = between + lens[:, :, m - 1 - j : m - 1 - j + block].reshape(N, k * block) * (d >= j)
        best = torch.full((N, 1), big, dtype=torch.long, device=device)
        for table in (first_end, last_end):
            e = _at(table, row)
            good = ok & (e >= 0) & ((d >= m) | (e + between >= m))
            best = torch.minimum(best, torch.where(good, p * stride + e, big).amin(dim=1, keepdim=True))
        found = best < big
        p0 = torch.where(found, best // stride, big)
        e0 = best % stride
    return (p0 < big).squeeze(1).float()


@dataclass
class Rows:
    """Responses prepared for the text components by one `TextMatcher.rows` call: ids (as given), the per-token
    codes of `scan` and the first stop of each row (n_valid)."""

    ids: torch.Tensor
    codes: torch.Tensor
    n_valid: torch.Tensor
    index: torch.Tensor  # int32 id + 1, 0 outside the vocabulary (on CPU index and codes are buffers reused by
    # the next `rows` call)


@dataclass
class TextMatcher:
    """The text components of one tokenizer and marker, tables cached per device. See the module docstring."""

    vocab: VocabBytes
    format_bytes: list[bytes]
    answer_window_bytes: int = ANSWER_WINDOW_BYTES
    format_automata: list = field(default_factory=list, repr=False)
    format_windowed: bool = False
    first_table: torch.Tensor | None = field(default=None, repr=False)  # int32 [V]: see contains_windows
    _on_device: dict = field(default_factory=dict, repr=False)
    _answers: dict = field(default_factory=dict, repr=False)
    # names this matcher's AnswerHints: random, so that patterns prepared in one process never carry hints a
    # different matcher of another process would take for its own (a pickled copy keeps the name: same tables)
    token: str = field(default_factory=lambda: secrets.token_hex(8), repr=False)
    kernel: bool = True  # on CPU, use the fused kernel (`kernel.py`) when it loads; False: always the tensor code

    @classmethod
    def build(cls, tokenizer, marker: str, format_sequences=()) -> TextMatcher:
        vb = VocabBytes.build(tokenizer, marker)
        flat = vb.flat.numpy().tobytes()
        table = [flat[o : o + n] for o, n in zip(vb.offsets.tolist(), vb.lengths.tolist())]
        fmt = [s.encode("utf-8") for s in format_sequences]
        automata = [(*_automaton(table, b), len(b)) for b in fmt if b]
        V = len(table)
        windowed = len(automata) <= FORMAT_WINDOW_MAX[0] and all(
            int((a[1].view(V, -1) >= 0).any(dim=1).sum()) <= FORMAT_WINDOW_MAX[1] * V for a in automata
        )
        first = []
        for b in table:
            lead = b.lstrip(b" \t\n\r\x0b\x0c")
            money = lead[1:].lstrip(b" \t\n\r\x0b\x0c") if lead[:1] == b"$" else lead
            first.append(
                int(_BUCKETS[lead[0]]) | int(_BUCKETS[money[0]]) if money else (int(_BUCKETS[lead[0]]) if lead else 0)
            )
        return cls(
            vb,
            fmt,
            format_automata=automata,
            format_windowed=windowed,
            first_table=torch.tensor(first, dtype=torch.int32),
        )

    def on(self, device) -> tuple[VocabBytes, list]:
        """(VocabBytes, format automata) on `device`, copied once; the automata tables by id + 1 (the byte-less
        last id's rows first, for `scan`'s index)."""
        device = torch.device(device)
        if device not in self._on_device:
            automata = [(*(torch.cat([t[-a[3] :], t]).to(device) for t in a[:3]), a[3]) for a in self.format_automata]
            self._on_device[device] = (self.vocab.to(device), automata)
        return self._on_device[device]

    def _codes_table(self, device, stop_ids: tuple[int, ...]) -> torch.Tensor:
        key = (torch.device(device), stop_ids)
        if key not in self._on_device:
            V = self.vocab.lengths.numel()
            table = self.vocab.can_end.to(torch.uint8) * _CAN_END
            if self.format_windowed:
                for i, a in enumerate(self.format_automata):
                    can, m = _FORMAT0 << 3 * i, a[3]
                    ends = a[1].view(V, m) >= 0
                    adv = (a[0].view(V, m) >= 1).any(dim=1) | (self.vocab.lengths == 0)
                    table |= ends.any(dim=1).to(torch.uint8) * can
                    table |= ends[:, 0].to(torch.uint8) * (can << 1)
                    table |= adv.to(torch.uint8) * (can << 2)
            for s in stop_ids:
                if 0 <= s < V - 1:
                    table[s] |= _STOP
            self._on_device[key] = torch.cat([table[-1:], table]).to(device)  # entry 0: ids outside [0, V)
        return self._on_device[key]

    def _cpu_buffers(self, name: str, ids: torch.Tensor, dtypes) -> tuple[torch.Tensor, ...] | None:
        """Buffers of ids' shape, one per dtype, kept per thread and reused by the next call with that shape (on
        CPU a fresh multi-MB buffer costs page faults on every call, more than the pass that fills it); None on
        an accelerator, whose caching allocator already reuses memory."""
        if ids.device.type != "cpu":
            return None
        return self._buffers(name, [(tuple(ids.shape), d) for d in dtypes])

    def _buffers(self, name: str, specs) -> tuple[torch.Tensor, ...]:
        """CPU buffers of the given (shape, dtype)s for `name`, kept per thread for the last BUFFER_SHAPES shapes
        asked for (the oldest shape's are dropped: batches of ever new lengths do not pile up buffers)."""
        kept = self._on_device.setdefault(("buffers", name, threading.get_ident()), {})
        key = tuple(specs)
        buffers = kept.pop(key, None)
        if buffers is None:
            buffers = tuple(torch.empty(shape, dtype=d) for shape, d in specs)
            while len(kept) >= BUFFER_SHAPES:
                kept.pop(next(iter(kept)))
        kept[key] = buffers  # the most recent last
        return buffers

    def _lib(self, device: torch.device):
        """The fused CPU kernel (`kernel.load`) for tensors on `device`, or None: the tensor code."""
        if not self.kernel or device.type != "cpu":
            return None
        return _kernel.load()

    def rows(self, ids: torch.Tensor, stop_ids) -> Rows:
        """The one pass over all tokens (`scan`): codes and the first stop of each row. Stop ids outside the
        tokenizer are never found (ids there read as the byte-less token)."""
        stop_ids = tuple(int(s) for s in stop_ids)
        lib = self._lib(ids.device)
        if lib is not None and ids.dim() == 2 and ids.numel() and ids.dtype in (torch.int64, torch.int32):
            return self._rows_kernel(lib, ids.contiguous(), stop_ids)
        scratch = self._cpu_buffers("scan", ids, (torch.int32, torch.uint8))
        codes, n_valid, index = scan(self._codes_table(ids.device, stop_ids), ids.contiguous(), scratch=scratch)
        return Rows(ids, codes, n_valid, index)

    def _rows_kernel(self, lib, ids: torch.Tensor, stop_ids: tuple[int, ...]) -> Rows:
        """`rows` by the kernel's scan (the same index, codes and first stops), into this thread's buffers."""
        N, L = ids.shape
        Lp = _padded_length(L)
        index, codes = self._buffers("kernel scan", [((N, L), torch.int32), ((N, Lp), torch.uint8)])
        table = self._codes_table(ids.device, stop_ids)
        n_valid = torch.empty(N, dtype=torch.long)
        lib.atr_scan(
            _kernel.ptr(ids),
            int(ids.dtype == torch.int32),
            N,
            L,
            Lp,
            _kernel.ptr(table),
            table.numel() - 1,
            _kernel.ptr(index),
            _kernel.ptr(codes),
            _kernel.ptr(n_valid),
        )
        return Rows(ids, codes, n_valid, index)

    def _answer_args(self, ans: AnswerText) -> tuple:
        """AnswerText as the kernel's answer arguments (K, Wa, Ca2, lit, lit_len, canon, is_num, any_num, any_text)
        and the contiguous tensors they point into (kept alive by the caller)."""
        long = torch.int64
        keep = (ans.lit.to(long).contiguous(), ans.lit_len.to(long).contiguous(), ans.canon.to(long).contiguous())
        keep += (ans.is_num.to(torch.bool).contiguous(),)
        lit, lit_len, canon, is_num = keep
        K, Wa = lit.shape[1], lit.shape[2]
        args = (K, Wa, canon.shape[2], _kernel.ptr(lit), _kernel.ptr(lit_len), _kernel.ptr(canon), _kernel.ptr(is_num))
        return args + (int(ans.any_num is not False), int(ans.any_text is not False)), keep

    def prepare(self, patterns):
        """`patterns` (PackedPatterns) with this matcher's AnswerHints attached, read on the host: call it where the
        patterns are packed, once per prompt batch (before they go to the device, repeat_interleave keeps them).
        The hints make the answers' windows as wide as the answers (not the static bound) and skip the number /
        text matching a batch has no answer for. Patterns already on a device are returned as they are (reading
        them there would be a sync). The hints describe the patterns as prepared: prepare again after changing
        their tensors in place."""
        if patterns.tokens.device.type != "cpu":
            return patterns
        vb, _ = self.on("cpu")
        tokens, lengths = patterns.tokens, patterns.lengths
        N, K, Q = tokens.shape
        text = {}
        if tokens.numel() == 0:
            hints = AnswerHints(1, False, False, 1)
        else:
            tok = tokens.clamp(-1, vb.V - 1).add(1)
            n_bytes = (_at(vb.lengths1, tok) * (torch.arange(Q) < lengths.unsqueeze(-1))).sum(-1)
            width = int(n_bytes.max().clamp(max=_static_width(vb, Q)))
            lit, lit_len, canon, is_num = fields_ = _answer_fields(vb, tokens, lengths, max(1, width))
            keep = _distinct(lit, lit_len)
            hints = AnswerHints(
                width=width,
                any_num=bool(is_num.any()),
                any_text=bool(((lit_len > 0) & ~is_num).any()),
                alternatives=max(1, int(keep.sum(1).max())) if N else 1,
            )
            # the answers' text as a reward call would make it from these hints, made here once per prompt batch
            text = {self.token + _TEXT: PreparedText(_finish_answers(*fields_, hints, keep), tokens, lengths)}
        return replace(patterns, text_hints={**(patterns.text_hints or {}), self.token: hints, **text})

    def answers(self, ids: torch.Tensor, patterns) -> AnswerText:
        """AnswerText of the packed patterns, cached while the same pattern tensors (same version) are used."""
        vb, _ = self.on(ids.device)
        tokens, lengths = patterns.tokens, patterns.lengths
        hints = getattr(patterns, "text_hints", None) or {}
        prepared = hints.get(self.token + _TEXT)
        if isinstance(prepared, PreparedText) and prepared.belongs_to(tokens, lengths):
            return prepared.text  # made by prepare on the host, moved and repeated with these tensors
        hints = hints.get(self.token)
        key = (id(tokens), id(lengths), hints)
        hit = self._answers.get(key)
        if hit is not None:
            t_ref, l_ref, versions, ans = hit
            if t_ref() is tokens and l_ref() is lengths and versions == (tokens._version, lengths._version):
                return ans
        ans = answer_text(vb, tokens, lengths, hints=hints)
        if len(self._answers) >= 8:
            self._answers.pop(next(iter(self._answers)))
        self._answers[key] = (weakref.ref(tokens), weakref.ref(lengths), (tokens._version, lengths._version), ans)
        return ans

    def answer_after_marker(self, rows: Rows, ans: AnswerText) -> torch.Tensor:
        """1.0 where the text right after the LAST marker (before the first stop) is an answer alternative."""
        ids, n_valid = rows.ids, rows.n_valid
        vb, _ = self.on(ids.device)
        N, L = ids.shape
        if L == 0 or not vb.marker:
            return torch.zeros(N, device=ids.device)
        width = ans.width + self.answer_window_bytes
        lib = self._lib(ids.device)
        if lib is not None and 0 <= width <= _kernel.MAX_WIDTH - 2 and _kernel_reads(rows, ans):
            args, _keep = self._answer_args(ans)
            out = torch.empty(N, dtype=torch.float32)
            lib.atr_answer_after_marker(
                _kernel.ptr(rows.index),
                _kernel.ptr(rows.codes),
                N,
                L,
                rows.codes.shape[1],
                _kernel.ptr(n_valid),
                max(len(vb.marker), 1),
                _kernel.ptr(vb.next_state1_i),
                _kernel.ptr(vb.match_end1_i),
                _kernel.ptr(vb.flat0),
                _kernel.ptr(vb.offsets1_i),
                _kernel.ptr(vb.lengths1_i),
                MARKER_BLOCKS,
                MARKER_BLOCK_TOKENS,
                width,
                *args,
                _kernel.ptr(out),
            )
            return out
        found, tok, offset = last_marker(vb, rows.index, rows.codes, n_valid)
        A = min(width + 1, L)  # one token and byte more: a window the text runs past is told from one it fills
        idx = (tok.unsqueeze(1) + torch.arange(A, device=ids.device)).clamp_(max=L - 1)
        window = rows.index.gather(1, idx)  # ids + 1
        n_tok = (n_valid - tok).clamp(min=0)
        x, x_len = tokens_to_bytes(vb, window, n_tok, offset, width + 1, shifted=True)
        cut = (x_len > width) | (n_tok > A)  # the text goes on past the window
        return (_matches_answer(x, x_len, ans, whole=False, cut=cut) & found).float()

    def exact_match(self, rows: Rows, ans: AnswerText) -> torch.Tensor:
        """1.0 where the whole response (up to its first stop) is an answer alternative (see _matches_answer)."""
        ids, n_valid = rows.ids, rows.n_valid
        vb, _ = self.on(ids.device)
        N, L = ids.shape
        width = ans.width + self.answer_window_bytes
        lib = self._lib(ids.device)
        if lib is not None and 0 <= width <= _kernel.MAX_WIDTH - 2 and L and _kernel_reads(rows, ans):
            args, _keep = self._answer_args(ans)
            out = torch.empty(N, dtype=torch.float32)
            lib.atr_exact_match(
                _kernel.ptr(rows.index),
                N,
                L,
                _kernel.ptr(n_valid),
                _kernel.ptr(vb.flat0),
                _kernel.ptr(vb.offsets1_i),
                _kernel.ptr(vb.lengths1_i),
                width,
                *args,
                _kernel.ptr(out),
            )
            return out
        A = min(width, L)
        x, x_len = tokens_to_bytes(vb, rows.index[:, :A], n_valid.clamp(max=A), None, width + 1, shifted=True)
        fits = (n_valid <= A) & (x_len <= width)
        return (_matches_answer(x[:, : width + 1], x_len.clamp(max=width), ans, whole=True) & fits).float()

    def text(self, rows: Rows):
        """Whole rows as bytes (`full_text`): slow, for reference (contains reads windows instead)."""
        vb, _ = self.on(rows.ids.device)
        return full_text(vb, rows.ids, rows.n_valid)

    def contains(self, rows: Rows, ans: AnswerText) -> torch.Tensor:
        """1.0 where an answer alternative occurs in the response as a whole number / word (`contains_windows`)."""
        vb, _ = self.on(rows.ids.device)
        key = (rows.ids.device, "first")
        if key not in self._on_device:
            t = self.first_table
            self._on_device[key] = torch.cat([t[-1:], t]).to(rows.ids.device)  # entry 0: ids outside [0, V)
        lib = self._lib(rows.ids.device)
        N, L = rows.index.shape
        Wc = ans.words.shape[2] * 8
        if lib is not None and _contains_fits_kernel(Wc) and _kernel_reads(rows, ans):
            _, (lit, lit_len, _, _) = self._answer_args(ans)
            first_mask = ans.first_mask.to(torch.int32).contiguous()
            out = torch.empty(N, dtype=torch.float32)
            lib.atr_contains(
                _kernel.ptr(rows.index),
                N,
                L,
                _kernel.ptr(rows.n_valid),
                _kernel.ptr(self._on_device[key]),
                _kernel.ptr(first_mask),
                _kernel.ptr(vb.flat0),
                _kernel.ptr(vb.offsets1_i),
                _kernel.ptr(vb.lengths1_i),
                CONTAINS_BLOCKS,
                CONTAINS_WINDOWS,
                MARKER_BLOCK_TOKENS,
                Wc,
                CONTAINS_LEAD_BYTES,
                CONTAINS_TAIL_BYTES,
                lit.shape[1],
                lit.shape[2],
                _kernel.ptr(lit),
                _kernel.ptr(lit_len),
                _kernel.ptr(out),
            )
            return out
        scratch = self._cpu_buffers("contains", rows.ids, (torch.int32,))
        return contains_windows(
            vb, self._on_device[key], rows.index, rows.n_valid, ans, scratch=scratch[0] if scratch else None
        ).float()

    def format(self, rows: Rows) -> torch.Tensor:
        vb, automata = self.on(rows.ids.device)
        lib = self._lib(rows.ids.device)
        if lib is not None and automata and rows.index.numel() and _kernel_reads(rows):
            return self._format_kernel(lib, vb, rows, automata)
        if self.format_windowed:
            return format_windows(vb, rows.index, rows.codes, rows.n_valid, automata)
        return format_tokens(vb, rows.index, rows.n_valid, automata)

    def _format_kernel(self, lib, vb: VocabBytes, rows: Rows, automata) -> torch.Tensor:
        """`format` by the kernel: one call per text, each row's previous text end carried from call to call."""
        index, n_valid = rows.index, rows.n_valid
        N, L = index.shape
        if self.format_windowed:
            big = _FORMAT_WINDOW_NONE
            p0 = torch.full((N,), -big, dtype=torch.long)
            e0 = torch.zeros(N, dtype=torch.long)
            for i, (next_state, first_end, last_end, m) in enumerate(automata):
                lib.atr_format_window(
                    _kernel.ptr(index),
                    _kernel.ptr(rows.codes),
                    N,
                    L,
                    rows.codes.shape[1],
                    _kernel.ptr(n_valid),
                    _kernel.ptr(vb.lengths1_i),
                    _kernel.ptr(next_state),
                    _kernel.ptr(first_end),
                    _kernel.ptr(last_end),
                    m,
                    _FORMAT0 << 3 * i,
                    int(i == 0),
                    FORMAT_BLOCKS,
                    MARKER_BLOCK_TOKENS,
                    vb.max_len + 1,
                    big,
                    _kernel.ptr(p0),
                    _kernel.ptr(e0),
                )
            return (p0 < big).float()
        big = _FORMAT_TOKENS_NONE
        prev_end = torch.zeros(N, dtype=torch.long)
        for next_state, first_end, last_end, m in automata:
            lib.atr_format_tokens(
                _kernel.ptr(index),
                N,
                L,
                _kernel.ptr(n_valid),
                _kernel.ptr(vb.lengths1_i),
                _kernel.ptr(next_state),
                _kernel.ptr(first_end),
                _kernel.ptr(last_end),
                m,
                big,
                _kernel.ptr(prev_end),
            )
        return (prev_end < big).float()


def _kernel_reads(rows: Rows, ans: AnswerText | None = None) -> bool:
    """Whether the kernel can read these rows in place (as `scan` makes them: int32 index, uint8 codes, int64
    first stops, each contiguous) with these answers (one row of them per response row: anything else is left to
    the tensor code, which raises its shape error)."""
    N, L = rows.index.shape
    if ans is not None and (ans.lit.shape[0] != N or ans.lit_len.shape[0] != N or ans.first_mask is None):
        return False
    return (
        rows.codes.shape == (N, _padded_length(L))
        and rows.n_valid.shape == (N,)
        and rows.index.dtype == torch.int32
        and rows.codes.dtype == torch.uint8
        and rows.n_valid.dtype == torch.int64
        and all(t.is_contiguous() for t in (rows.index, rows.codes, rows.n_valid))
    )


def _contains_fits_kernel(Wc: int) -> bool:
    """Whether contains' windows fit the kernel's buffers (its window of 2 + lead + Wc + tail + 1 bytes, at most 8
    tail bytes, at most 64 candidates per row)."""
    W = 2 + CONTAINS_LEAD_BYTES + Wc + CONTAINS_TAIL_BYTES + 1
    return W <= _kernel.MAX_WIDTH and CONTAINS_TAIL_BYTES <= 8 and CONTAINS_WINDOWS <= 64
