"""Answers matched as TEXT, on the device that generated the responses (no decode, no host round trip).

A model may emit the same text in many tokenizations ('####' as ['####'], ['##', '##'] or ['#', '###'];
' 72' as ['Ġ72'], ['Ġ', '72'] or ['Ġ7', '2']), and graders read text. So the text components turn tokens
into BYTES with a table of the vocabulary built once from the tokenizer (`VocabBytes`: token id -> its
bytes, byte-level BPE 'Ġ'-style characters, SentencePiece '▁' and <0xNN> byte tokens resolved, special
tokens -> no bytes), and match bytes:

  answer_after_marker  the number (or text) right after the LAST marker, however either was split;
  exact_match          the whole response (up to its first stop token) is the answer;
  contains             the answer occurs in the response as a whole number / word;
  format               texts occur in order.

Numbers are compared in a canonical form computed on the device (`_canonical_numbers`): leading spaces and
'$' skipped, commas dropped, trailing sentence punctuation ('.' or ','), trailing fractional zeros and a
bare '.' dropped, leading integer zeros dropped, so `$1,000.00`, `1000.` and `1000` are one number while
`72` never equals `7`, `720`, `7.2` or `-72`. docs/rewards.md lists the accepted forms.

Hot-path rules as in `tensor_native`: batched tensor code only (loops over static sizes: the marker
length, a format text's length), no `.item()` / `.tolist()` / `bool(tensor)` / `nonzero()` / boolean
indexing, no data-dependent shapes. The marker search reads only the last `MARKER_BLOCKS` blocks of
tokens holding a token that can end a marker (one vocabulary lookup per token finds them) and converts
only a window of tokens after the last marker to bytes; exact_match converts the first tokens of a row;
contains and format convert whole responses (up to `BYTES_PER_TOKEN` bytes per token on average).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

MARKER_BLOCK_TOKENS = 16
MARKER_BLOCKS = 4
"""The marker search cuts a row into blocks of MARKER_BLOCK_TOKENS tokens and reads the last MARKER_BLOCKS
blocks that hold a token able to end a marker occurrence (a token containing '#' for '####'): a marker
followed by that many more blocks with such tokens is not found."""
ANSWER_WINDOW_BYTES = 32
"""Bytes read after the marker beyond the answer's own length (spaces, '$', separators, '.0', a period)."""
ANSWER_MAX_BYTES = 64
"""Answer alternatives are read up to this many bytes (a longer text answer is cut, and cannot match)."""
BYTES_PER_TOKEN = 8
"""Whole-response conversion (contains, format) keeps at most L * this many bytes of a row."""

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
        return VocabBytes(
            flat=self.flat.to(device),
            offsets=self.offsets.to(device),
            lengths=self.lengths.to(device),
            max_len=self.max_len,
            marker=self.marker,
            next_state=self.next_state.to(device),
            match_end=self.match_end.to(device),
            can_end=self.can_end.to(device),
        )


# ----------------------------------------------------------------------------------------------------
# Hot path: tokens -> bytes, number canonicalisation, matching
# ----------------------------------------------------------------------------------------------------


def tokens_to_bytes(
    vb: VocabBytes, tok: torch.Tensor, n_tok: torch.Tensor, skip: torch.Tensor | None, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The text of token rows as bytes: (bytes LongTensor [R, width] (0 past the end), lengths LongTensor [R]).

    tok: LongTensor [R, A] token ids; n_tok: LongTensor [R] tokens of each row to read (the rest ignored);
    skip: LongTensor [R] leading bytes to drop (or None); width: static byte width (longer text is cut).
    A cumsum of the tokens' byte lengths gives where each token starts; each output byte finds its token
    by a batched searchsorted and is gathered from the flat byte table.
    """
    R, A = tok.shape
    device = tok.device
    if A == 0 or width == 0:
        return torch.zeros(R, width, dtype=torch.long, device=device), torch.zeros(R, dtype=torch.long, device=device)
    tok = tok.clamp(0, vb.lengths.numel() - 1)
    lens = vb.lengths.take(tok) * (torch.arange(A, device=device) < n_tok.unsqueeze(1))  # [R, A]
    ends = lens.cumsum(dim=1)
    total = ends[:, -1]
    j = torch.arange(width, device=device).expand(R, width)
    if skip is not None:
        j = j + skip.unsqueeze(1)
        total = total - skip
    k = torch.searchsorted(ends, j.contiguous(), right=True).clamp_(max=A - 1)  # token holding byte j
    start = ends.gather(1, k) - lens.gather(1, k)
    src = vb.offsets.take(tok.gather(1, k)) + (j - start).clamp(min=0)
    length = total.clamp(0, width)
    inside = torch.arange(width, device=device) < length.unsqueeze(1)
    out = vb.flat.take(src.clamp_(max=vb.flat.numel() - 1)).long() * inside
    return out, length


def _is_space(x: torch.Tensor) -> torch.Tensor:
    return (x == 32) | ((x >= 9) & (x <= 13))


def _is_alnum(x: torch.Tensor) -> torch.Tensor:
    return ((x >= 48) & (x <= 57)) | ((x | 32) >= 97) & ((x | 32) <= 122) | (x >= 128)


def _compact(x: torch.Tensor, keep: torch.Tensor, first: torch.Tensor | None = None):
    """Bytes of x where keep, packed to the left: (LongTensor [R, W], lengths [R]); `first` (optional
    LongTensor [R], 0 = none) is put in front where non-zero."""
    R, W = x.shape
    lead = (first > 0).long() if first is not None else torch.zeros(R, dtype=torch.long, device=x.device)
    dest = keep.long().cumsum(dim=1) - 1 + lead.unsqueeze(1)
    dest = torch.where(keep, dest, W + 1)
    out = torch.zeros(R, W + 2, dtype=torch.long, device=x.device)
    out.scatter_(1, dest, x)
    if first is not None:
        out[:, 0] = torch.where(lead > 0, first, out[:, 0])
    return out[:, :W], keep.sum(dim=1) + lead


def _canonical_numbers(x: torch.Tensor, n: torch.Tensor):
    """The number at the start of each byte row, canonical. x: LongTensor [R, W] bytes; n: LongTensor [R] lengths.

    Skips leading whitespace and '$'; reads an optional '-', then a run of digits, ',' and '.' that starts
    with a digit; drops trailing ',' / '.' (sentence punctuation), every ',' (thousands separators), leading
    integer zeros, trailing fractional zeros and a bare '.'; '-0' is '0'. Returns (canon [R, W], canon_len [R],
    is_number [R] (a digit was found and the run has at most one '.' with no ',' after it),
    rest [R]: index just past the run, trailing punctuation included).
    """
    R, W = x.shape
    device = x.device
    pos = torch.arange(W, device=device).expand(R, W)
    valid = pos < n.unsqueeze(1)
    skip = (_is_space(x) | (x == _DOLLAR)) & valid
    j0 = skip.long().cumprod(dim=1).sum(dim=1)  # first byte that is not skipped
    at0 = x.gather(1, j0.clamp(max=W - 1).unsqueeze(1)).squeeze(1)
    neg = (at0 == _MINUS) & (j0 < n)
    j1 = j0 + neg.long()
    digit = (x >= _DIGIT0) & (x <= _DIGIT9) & valid
    body = (digit | (x == _COMMA) | (x == _DOT)) & valid
    after = pos >= j1.unsqueeze(1)
    run = (body | ~after).long().cumprod(dim=1).bool() & after  # the maximal run from j1
    first_digit = digit.gather(1, j1.clamp(max=W - 1).unsqueeze(1)).squeeze(1) & (j1 < n)
    rest = j1 + run.sum(dim=1)
    last_digit = torch.where(run & digit, pos, -1).amax(dim=1)
    end = last_digit + 1  # trailing ',' / '.' dropped
    inside = run & (pos < end.unsqueeze(1))
    dots = inside & (x == _DOT)
    dot = torch.where(dots, pos, W).amin(dim=1)  # first '.', W = none
    commas_after_dot = (inside & (x == _COMMA) & (pos > dot.unsqueeze(1))).any(dim=1)
    is_number = first_digit & (dots.sum(dim=1) <= 1) & ~commas_after_dot
    int_end = torch.minimum(dot, end)
    nonzero = inside & digit & (x != _DIGIT0)
    first_nz = torch.where(nonzero & (pos < int_end.unsqueeze(1)), pos, W).amin(dim=1)
    int_start = torch.minimum(first_nz, int_end - 1)  # all zeros: keep the last one
    last_nz_frac = torch.where(nonzero & (pos > dot.unsqueeze(1)), pos, -1).amax(dim=1)
    num_end = torch.where(last_nz_frac > dot, last_nz_frac + 1, int_end)
    keep = inside & (pos >= int_start.unsqueeze(1)) & (pos < num_end.unsqueeze(1)) & (x != _COMMA)
    is_zero = (num_end == int_end) & (first_nz >= int_end)
    minus = torch.where(neg & ~is_zero, _MINUS, 0)
    canon, canon_len = _compact(x, keep, minus)
    return canon, canon_len, is_number, rest


def _stripped(x: torch.Tensor, n: torch.Tensor):
    """Each row without leading and trailing whitespace: (bytes [R, W], lengths [R])."""
    R, W = x.shape
    pos = torch.arange(W, device=x.device).expand(R, W)
    valid = pos < n.unsqueeze(1)
    lead = (_is_space(x) & valid | ~valid).long().cumprod(dim=1).sum(dim=1).clamp(max=W)
    last = torch.where(valid & ~_is_space(x), pos, -1).amax(dim=1)
    length = (last + 1 - lead).clamp(min=0)
    src = (pos + lead.unsqueeze(1)).clamp(max=W - 1)
    out = x.gather(1, src) * (pos < length.unsqueeze(1))
    return out, length


def _equal_prefix(a: torch.Tensor, a_len: torch.Tensor, b: torch.Tensor, b_len: torch.Tensor) -> torch.Tensor:
    """Whether b (its first b_len bytes) is a prefix of a. a: [R, W], b: [R, K, Wb]; lengths [R], [R, K] -> [R, K]."""
    w = min(a.shape[1], b.shape[2])
    same = (a[:, None, :w] == b[:, :, :w]) | (torch.arange(w, device=a.device) >= b_len.unsqueeze(-1))
    fits = (b_len <= a_len.unsqueeze(1)) & (b_len <= w)
    return same.all(dim=-1) & fits


@dataclass
class AnswerText:
    """The answer alternatives of a batch as text, made from the packed token patterns on the device.

    lit [N, K, Wa] / lit_len [N, K]: each alternative's bytes without surrounding whitespace;
    num [N, K, Wa] / num_len [N, K] / is_num [N, K]: its canonical number, where the whole stripped text is one
    number (trailing '.' allowed). Length 0 = absent alternative (never matches).
    """

    lit: torch.Tensor
    lit_len: torch.Tensor
    num: torch.Tensor
    num_len: torch.Tensor
    is_num: torch.Tensor

    @property
    def width(self) -> int:
        return self.lit.shape[2]


def answer_text(
    vb: VocabBytes, tokens: torch.Tensor, lengths: torch.Tensor, max_bytes: int = ANSWER_MAX_BYTES
) -> AnswerText:
    """AnswerText of PackedPatterns (tokens [N, K, Q], lengths [N, K]); an alternative of more than `max_bytes`
    bytes is dropped (length 0: it never matches)."""
    N, K, Q = tokens.shape
    width = max(1, min(Q * max(vb.max_len, 1), max_bytes))
    flat_tok = tokens.reshape(N * K, Q).clamp(0, vb.lengths.numel() - 1)
    b, b_len = tokens_to_bytes(vb, flat_tok, lengths.reshape(N * K), None, width + 1)
    b, b_len = b[:, :width], b_len * (b_len <= width)
    lit, lit_len = _stripped(b, b_len)
    num, num_len, is_num, rest = _canonical_numbers(lit, lit_len)
    is_num = is_num & (rest >= lit_len)
    shape = (N, K)
    return AnswerText(
        lit.reshape(N, K, width),
        lit_len.reshape(shape),
        num.reshape(N, K, width),
        num_len.reshape(shape),
        is_num.reshape(shape),
    )


def _matches_answer(x: torch.Tensor, n: torch.Tensor, ans: AnswerText, whole: bool) -> torch.Tensor:
    """Whether the text x (bytes [N, W], lengths [N]) starts with (whole=False) / is (whole=True) an answer.

    Number answers: the number at the start of x (after spaces and '$') has the answer's canonical form;
    whole: nothing but whitespace follows it. Text answers: x without leading whitespace starts with the
    answer text followed by a non-alphanumeric byte (or the end); whole: x stripped equals it.
    Returns BoolTensor [N] (any alternative).
    """
    canon, canon_len, is_number, rest = _canonical_numbers(x, n)
    num_hit = _equal_prefix(canon, canon_len, ans.num, ans.num_len) & (ans.num_len == canon_len.unsqueeze(1))
    num_hit &= is_number.unsqueeze(1) & ans.is_num & (ans.num_len > 0)
    lit, lit_len = _stripped(x, n)
    lit_hit = _equal_prefix(lit, lit_len, ans.lit, ans.lit_len) & (ans.lit_len > 0) & ~ans.is_num
    if whole:
        W = x.shape[1]
        pos = torch.arange(W, device=x.device)
        tail = ~_is_space(x) & (pos >= rest.unsqueeze(1)) & (pos < n.unsqueeze(1))
        num_hit &= ~tail.any(dim=1).unsqueeze(1)
        lit_hit &= ans.lit_len == lit_len.unsqueeze(1)
    else:
        nxt = lit.gather(1, ans.lit_len.clamp(max=lit.shape[1] - 1))  # [N, K]: byte after the answer
        lit_hit &= (ans.lit_len >= lit_len.unsqueeze(1)) | ~_is_alnum(nxt)
    return (num_hit | lit_hit).any(dim=1)


def first_stop(is_stop: torch.Tensor) -> torch.Tensor:
    """Index of the first True of each row (L when none). is_stop: BoolTensor [N, L] -> LongTensor [N]."""
    L = is_stop.shape[1]
    return torch.where(is_stop, torch.arange(L, device=is_stop.device), L).amin(dim=1)


def last_marker(
    vb: VocabBytes,
    ids: torch.Tensor,
    n_valid: torch.Tensor,
    blocks: int = MARKER_BLOCKS,
    block: int = MARKER_BLOCK_TOKENS,
):
    """Where the LAST marker occurrence before the first stop ends, however the marker was tokenized.

    ids: LongTensor [N, L] (non-negative); n_valid: LongTensor [N]. Returns (found BoolTensor [N], token
    LongTensor [N]: the token holding the marker's last byte, offset LongTensor [N]: bytes of that token up to
    the marker's end). Only tokens that can end an occurrence (`can_end`, one vocabulary lookup per token) are
    candidates; the row is cut into blocks of `block` tokens and the last `blocks` blocks holding a candidate
    are searched: for each token there, the automaton state before it is recomputed from the m - 1 tokens
    before it (every non-special token has a byte, so they hold the m - 1 bytes the state depends on).
    """
    N, L = ids.shape
    device = ids.device
    m = max(len(vb.marker), 1)
    nb = -(-L // block)
    pos = torch.arange(L, dtype=torch.int32, device=device)
    # key = position + 1 of a candidate before the first stop, else 0 (int32 arithmetic, no bool passes)
    key = vb.can_end.take(ids)  # int32 0 / 1, a new tensor
    key *= pos + 1
    key *= ((n_valid.to(torch.int32).unsqueeze(1) - 1 - pos) >> 31) + 1
    if nb * block != L:
        key = torch.nn.functional.pad(key, (0, nb * block - L))
    has = key.view(N, nb, block).amax(dim=-1) > 0  # [N, nb]
    count = has.long().cumsum(dim=1)
    slot = count[:, -1:] - count  # 0 for the last block with a candidate
    k = min(blocks, nb)
    chosen = torch.full((N, k + 1), -1, dtype=torch.long, device=device)
    chosen.scatter_(1, torch.where(has & (slot < k), slot, k), torch.arange(nb, device=device).expand(N, nb))
    chosen = chosen[:, :k]  # [N, k] block indices, -1 = none
    p = (chosen.unsqueeze(-1) * block + torch.arange(block, device=device)).flatten(1)  # [N, k * block]
    ok = (chosen.unsqueeze(-1) >= 0).expand(N, k, block).flatten(1) & (p < n_valid.unsqueeze(1))
    p = p.clamp(0, L - 1)
    state = torch.zeros_like(p)
    for d in range(m - 1, 0, -1):
        q = p - d
        t = ids.gather(1, q.clamp(min=0))
        state = torch.where(q >= 0, vb.next_state.take(t * m + state), 0)
    end = vb.match_end.take(ids.gather(1, p) * m + state)
    stride = vb.max_len + 1
    best = torch.where(ok & (end >= 0), p * stride + end, -1).amax(dim=1)
    found = best >= 0
    best = best.clamp(min=0)
    return found, best // stride, best % stride


def full_text(vb: VocabBytes, ids: torch.Tensor, n_valid: torch.Tensor, bytes_per_token: int = BYTES_PER_TOKEN):
    """Whole rows as bytes (up to the first stop): (bytes [N, W], lengths [N]),
    W = L * min(max_len, bytes_per_token)."""
    L = ids.shape[1]
    width = L * max(1, min(vb.max_len, bytes_per_token))
    return tokens_to_bytes(vb, ids, n_valid, None, width)


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


def format_text(x: torch.Tensor, n: torch.Tensor, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Whether the byte strings `sequences` (1-D LongTensors) occur in order, non-overlapping. -> FloatTensor [N]."""
    N, W = x.shape
    sequences = [s for s in sequences if s.numel() > 0]
    if not sequences:
        return torch.ones(N, device=x.device)
    pos = torch.arange(W, device=x.device)
    prev_end = torch.zeros(N, dtype=torch.long, device=x.device)
    for seq in sequences:
        P = seq.numel()
        hits = _find_all(x, n, seq.view(1, 1, P).expand(N, 1, P), torch.full((N, 1), P, device=x.device))[:, 0]
        first = torch.where(hits & (pos >= prev_end.unsqueeze(1)), pos, W + 1).amin(dim=1)
        prev_end = first + P
    return (prev_end <= W).float()


@dataclass
class TextMatcher:
    """The text components of one tokenizer and marker, tables cached per device. See the module docstring."""

    vocab: VocabBytes
    format_bytes: list[bytes]
    answer_window_bytes: int = ANSWER_WINDOW_BYTES
    _on_device: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, tokenizer, marker: str, format_sequences=()) -> TextMatcher:
        return cls(VocabBytes.build(tokenizer, marker), [s.encode("utf-8") for s in format_sequences])

    def on(self, device) -> tuple[VocabBytes, list[torch.Tensor]]:
        device = torch.device(device)
        if device not in self._on_device:
            seqs = [torch.tensor(list(b), dtype=torch.long, device=device) for b in self.format_bytes]
            self._on_device[device] = (self.vocab.to(device), seqs)
        return self._on_device[device]

    def answers(self, ids: torch.Tensor, patterns) -> AnswerText:
        vb, _ = self.on(ids.device)
        return answer_text(vb, patterns.tokens, patterns.lengths)

    def answer_after_marker(self, ids, n_valid, ans: AnswerText) -> torch.Tensor:
        """1.0 where the text right after the LAST marker (before the first stop) is an answer alternative."""
        vb, _ = self.on(ids.device)
        N, L = ids.shape
        if L == 0 or not vb.marker:
            return torch.zeros(N, device=ids.device)
        found, tok, offset = last_marker(vb, ids, n_valid)
        width = ans.width + self.answer_window_bytes
        A = min(width, L)
        idx = (tok.unsqueeze(1) + torch.arange(A, device=ids.device)).clamp(max=L - 1)
        window = ids.clamp(min=0).gather(1, idx)
        x, x_len = tokens_to_bytes(vb, window, (n_valid - tok).clamp(min=0), offset, width)
        return (_matches_answer(x, x_len, ans, whole=False) & found).float()

    def exact_match(self, ids, n_valid, ans: AnswerText) -> torch.Tensor:
        """1.0 where the whole response (up to its first stop) is an answer alternative (see _matches_answer)."""
        vb, _ = self.on(ids.device)
        N, L = ids.shape
        width = ans.width + self.answer_window_bytes
        A = min(width, L)
        x, x_len = tokens_to_bytes(vb, ids[:, :A].clamp(min=0), n_valid.clamp(max=A), None, width + 1)
        fits = (n_valid <= A) & (x_len <= width)
        return (_matches_answer(x, x_len, ans, whole=True) & fits).float()

    def text(self, ids, n_valid):
        vb, _ = self.on(ids.device)
        return full_text(vb, ids.clamp(min=0), n_valid)

    def contains(self, text, ans: AnswerText) -> torch.Tensor:
        return contains_text(text[0], text[1], ans).float()

    def format(self, text) -> torch.Tensor:
        _, seqs = self.on(text[0].device)
        return format_text(text[0], text[1], seqs)
