"""Answer texts to token patterns, and vocabulary-derived token sets. Runs at data/build time, not per call.

Matching happens in token space, so one answer text must become every token sequence a model may
plausibly emit for it: tokenizers give a word a different id with and without a leading space
(SentencePiece '▁42', byte-level BPE 'Ġ42'), and numbers have several spellings ('1,000', '1000').
"""

from __future__ import annotations

import re

import torch

from rlhf_core.reward.tensor_native import pack_patterns
from rlhf_core.types import PackedPatterns

# How tokenizers spell a leading space (or word continuation, for WordPiece '##') inside token strings.
SPACE_PREFIXES = (" ", "\u2581", "\u0120", "##")  # ' ', SentencePiece '▁', byte-level 'Ġ', WordPiece '##'
# Whitespace as it appears inside vocab strings: plain, SentencePiece '▁', byte-level Ġ Ċ ĉ č (space, \n, \t, \r).
WHITESPACE_CHARS = frozenset(" \t\n\r\u2581\u0120\u010a\u0109\u010d")

_GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")
_PLAIN_NUMBER = re.compile(r"([+-]?)(\d+)(?:\.(\d*))?")


def number_forms(text: str) -> list[str]:
    """Normalised spellings of a number: '1,000' -> ['1000', '1,000'], '42.0' -> ['42'], '-0.50' -> ['-0.5'].

    Returns [] when `text` (stripped) is not a plain decimal number. The first form is canonical (no
    grouping, no '+', no leading zeros, no trailing fractional zeros); integers of 4+ digits also get
    their comma-grouped form.
    """
    s = text.strip()
    if _GROUPED_NUMBER.fullmatch(s):
        s = s.replace(",", "")
    m = _PLAIN_NUMBER.fullmatch(s)
    if not m:
        return []
    sign, whole, frac = m.group(1), m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    canonical = whole + ("." + frac if frac else "")
    if sign == "-" and canonical != "0":
        canonical = "-" + canonical
    forms = [canonical]
    if not frac and len(whole) > 3:
        forms.append(("-" if canonical.startswith("-") else "") + f"{int(whole):,}")
    return forms


def text_variants(text: str) -> list[str]:
    """The surface forms an answer text is matched in: as is, stripped, number forms, each also with a
    leading space. Distinct, in that order."""
    stripped = text.strip()
    forms = [text, stripped, *number_forms(text)]
    out = []
    for form in forms:
        out += [form, " " + form.lstrip()]
    return [t for t in dict.fromkeys(out) if t.strip() or t == text]


def answer_variants(tokenizer, text: str) -> list[list[int]]:
    """Distinct non-empty token-id sequences for the variants of an answer text.

    tokenizer: a Hugging Face tokenizer (its `encode(..., add_special_tokens=False)` is used).
    Variants: the text as is, stripped, and with a leading space; for numbers also the normalised
    forms of `number_forms` ('1,000' -> '1000', '42.0' -> '42'), each with and without a leading space.
    Returns a list of token-id lists (the first is the text as is), e.g. [[id('42')], [id('Ġ42')]].
    """
    seqs = [tuple(tokenizer.encode(t, add_special_tokens=False)) for t in text_variants(text)]
    return [list(s) for s in dict.fromkeys(seqs) if s]


def patterns_from_texts(tokenizer, answers: list[str], device: torch.device | str | None = None) -> PackedPatterns:
    """`PackedPatterns` [N, K, Q] of `answer_variants` of each answer text (K = most variants)."""
    rows = [[torch.tensor(v, dtype=torch.long) for v in answer_variants(tokenizer, a)] for a in answers]
    return pack_patterns(rows, device=device if device is not None else "cpu")


def _vocab_ids(tokenizer, keep) -> torch.Tensor:
    ids = sorted(i for tok, i in tokenizer.get_vocab().items() if keep(tok))
    return torch.tensor(ids, dtype=torch.long)


def continuation_token_ids(tokenizer, chars: str) -> torch.Tensor:
    """Ids of every vocab token made only of `chars`, with or without one leading space marker.

    For chars '0123456789.,' this is every digit / separator token ('1', '21', 'Ġ1', '▁.5', '##0'):
    the tokens that, directly after an answer, would make it a different number. LongTensor [C].
    """
    allowed = set(chars)

    def keep(tok: str) -> bool:
        for prefix in SPACE_PREFIXES:
            if tok.startswith(prefix) and len(tok) > len(prefix):
                tok = tok[len(prefix) :]
                break
        return bool(tok) and all(c in allowed for c in tok)

    return _vocab_ids(tokenizer, keep)


def whitespace_token_ids(tokenizer) -> torch.Tensor:
    """Ids of vocab tokens made only of whitespace (' ', '▁', 'Ġ', 'Ċ', ...). LongTensor [W]."""
    return _vocab_ids(tokenizer, lambda tok: bool(tok) and all(c in WHITESPACE_CHARS for c in tok))
