"""Answer texts to token patterns, and vocabulary-derived token sets. Runs at data/build time, not per call.

Matching happens in token space, so one answer text must become every token sequence a model may
plausibly emit for it: tokenizers give a word a different id with and without a leading space
(SentencePiece '▁42', byte-level BPE 'Ġ42'), and numbers have several spellings ('1,000', '1000').
"""

from __future__ import annotations

import torch

from rlhf_core.reward.answer_forms import SPACE_PREFIXES, WHITESPACE_CHARS, answer_variants
from rlhf_core.reward.tensor_native import pack_patterns
from rlhf_core.types import PackedPatterns


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
