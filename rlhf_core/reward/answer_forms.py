"""Answer texts as the spellings a model may write, and their token ids: plain text work, no torch.

Imported by the prompt builders (`rlhf_core.data.answers`), whose processes (the prompt queue's Ray actor among
them) stay free of torch; `rlhf_core.reward.answers` turns these ids into tensors.
"""

from __future__ import annotations

import re

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
