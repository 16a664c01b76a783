"""The vocabulary as bytes: each token id's bytes as `decode(..., skip_special_tokens=True)` writes them
(`token_bytes`), their byte automata (a marker's, a format text's: the state after a token, where an occurrence
ends in it), and rows of tokens turned into bytes on the device (`tokens_to_bytes`).

Built once per tokenizer on the host (Python loops over the vocabulary), used on the device as tables.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from rlhf_core.reward.text.tables import lookup

BYTES_PER_TOKEN = 8
"""Whole-response conversion (`full_text`) keeps at most L * this many bytes of a row."""


def gpt2_byte_decoder() -> dict[str, int]:
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


_BYTE_DECODER = gpt2_byte_decoder()
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


def automaton(table: list[bytes], seq: bytes):
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
        if mk:
            next_state, _, match_end = automaton(table, mk)
        else:  # no marker: one state that every token keeps, and no occurrence anywhere
            next_state, match_end = torch.zeros(V, dtype=torch.long), torch.full((V,), -1, dtype=torch.long)
        return cls(
            flat=flat,
            offsets=offsets,
            lengths=lengths,
            max_len=int(lengths.max()) if V else 0,
            marker=mk,
            next_state=next_state,
            match_end=match_end,
            can_end=(match_end.view(V, -1) >= 0).any(dim=1).to(torch.int32),
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
    lens = lookup(vb.lengths1_i, tok)  # int32 [R, A]
    ends = lens.cumsum(dim=1, dtype=torch.int32)
    starts = ends - lens
    total = ends[:, -1]
    if skip is not None:
        skip = skip.to(torch.int32)
        starts -= skip.unsqueeze(1)
        total = total - skip
    base = lookup(vb.offsets1_i, tok) - starts  # flat index of byte j of the row in token t: base[t] + j
    delta = base - torch.nn.functional.pad(base[:, :-1], (1, 0))
    acc = torch.zeros(R, width + 2, dtype=torch.int32, device=device)
    acc.scatter_add_(1, starts.clamp(0, width + 1).long(), delta)  # starts are ascending: the sums telescope
    j = torch.arange(width + 1, dtype=torch.int32, device=device)
    length = total.clamp(0, width)
    src = torch.where(j < length.unsqueeze(1), acc.cumsum(dim=1, dtype=torch.int32)[:, : width + 1] + j, vb.zero_at)
    return lookup(vb.flat0, src).to(dtype), length.long()


def full_text(vb: VocabBytes, ids: torch.Tensor, n_valid: torch.Tensor, bytes_per_token: int = BYTES_PER_TOKEN):
    """Whole rows as bytes (up to the first stop): (bytes [N, W], lengths [N]),
    W = L * min(max_len, bytes_per_token)."""
    L = ids.shape[1]
    width = L * max(1, min(vb.max_len, bytes_per_token))
    return tokens_to_bytes(vb, ids, n_valid, None, width)
