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

# The one number grammar (docs/rewards.md, "Numbers"), read the same on the device (`reward.text.numbers.numbers`):
# spaces and '$' in any order, an optional '-', then a run of digits, ',' and '.' that starts with a digit.
_NUMBER = re.compile(r"[ \t\n\r\v\f$]*(-?)([0-9][0-9.,]*)")
_SPACES = " \t\n\r\v\f"  # ASCII whitespace only, as the device's byte classes


def canonical_number(text: str) -> str | None:
    """The canonical form of `text` when its whole text (without surrounding whitespace) is one number, else None.

    The grammar every component reads numbers by (the text components on the device, token matching's answer
    spellings, the answer checks of the prompt builders): spaces and '$' before, an optional '-', digits with
    ',' anywhere (dropped: thousands separators) and at most one '.' with no ',' after it, trailing '.' / ','
    (sentence punctuation) allowed. Canonical: no ',', no leading integer zeros, no trailing fraction zeros,
    no bare '.', '-0' is '0'. '$50', '50.00', '50.' -> '50'; '5,000' -> '5000'; '-7.50' -> '-7.5'; '+5',
    '.5', '1.2.3', '1.000,5', 'seventy' -> None.
    """
    s = text.strip(_SPACES)
    m = _NUMBER.fullmatch(s)
    if not m:
        return None
    body = m.group(2).rstrip(".,")
    whole, dot, frac = body.partition(".")
    if "." in frac or "," in frac:
        return None
    whole = whole.replace(",", "").lstrip("0") or "0"
    frac = frac.rstrip("0")
    canonical = whole + ("." + frac if frac else "")
    return "-" + canonical if m.group(1) and canonical != "0" else canonical


def number_forms(text: str) -> list[str]:
    """Normalised spellings of a number: '1,000' -> ['1000', '1,000'], '$42.0' -> ['42'], '-0.50' -> ['-0.5'].

    Returns [] when `text` is not one number (`canonical_number`, the grammar every component reads). The first
    form is canonical; integers of 4+ digits also get their comma-grouped form.
    """
    canonical = canonical_number(text)
    if canonical is None:
        return []
    forms = [canonical]
    digits = canonical.lstrip("-")
    if digits.isdigit() and len(digits) > 3:
        forms.append(("-" if canonical.startswith("-") else "") + f"{int(digits):,}")
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
