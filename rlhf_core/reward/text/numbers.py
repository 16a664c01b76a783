"""Number forms: the byte classes every text component reads bytes by, and numbers in a canonical form
computed on the device (`numbers`), so that `$1,000.00`, `1000.` and `1000` are one number while `72` never
equals `7`, `720`, `7.2` or `-72` (docs/rewards.md lists the accepted forms)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlhf_core.reward.text.tables import cached, lookup

SPACE_BYTES = (32, 9, 10, 13, 11, 12)  # ' ', \t, \n, \r, \v, \f
DIGIT0, DIGIT9, DOT, COMMA, MINUS, DOLLAR = 48, 57, 46, 44, 45, 36

# Byte classes (one table lookup per byte, then bit tests): bits set for what a byte IS or IS NOT, so that
# "the first byte that is not X" is one argmax over (class & NOT_X) (the first maximum; a zero sentinel byte
# after every text has every NOT_ bit, so there is always one).
NOT_SKIP, NOT_BODY, NOT_SPACE, C_DIGIT, C_COMMA, C_DOT, C_MINUS, C_ALNUM = 1, 2, 4, 8, 16, 32, 64, 128
_DIGIT_SHIFT, _DOT_SHIFT, _MINUS_SHIFT = 3, 5, 6


def _byte_classes() -> torch.Tensor:
    cls = []
    for b in range(256):
        space = b in SPACE_BYTES
        digit = DIGIT0 <= b <= DIGIT9
        c = 0 if (space or b == DOLLAR) else NOT_SKIP
        c |= 0 if (digit or b in (COMMA, DOT)) else NOT_BODY
        c |= 0 if space else NOT_SPACE
        c |= C_DIGIT if digit else 0
        c |= C_COMMA if b == COMMA else 0
        c |= C_DOT if b == DOT else 0
        c |= C_MINUS if b == MINUS else 0
        c |= C_ALNUM if (digit or 65 <= b <= 90 or 97 <= b <= 122 or b >= 128) else 0
        cls.append(c)
    return torch.tensor(cls, dtype=torch.long)


def byte_bucket(b: int) -> int:
    """One of 31 buckets of a byte (a bit of int32 candidate masks): digits, '-' and '$' their own, letters by
    their lower case, other bytes shared."""
    if DIGIT0 <= b <= DIGIT9:
        return b - DIGIT0
    if b == MINUS:
        return 10
    if b == DOLLAR:
        return 11
    if 65 <= b <= 90 or 97 <= b <= 122:
        return 12 + ((b | 32) - 97) % 19
    return 12 + b % 19


CLASSES = _byte_classes()
"""int64 [256]: the class bits of each byte."""
BUCKETS = torch.tensor([1 << byte_bucket(b) for b in range(256)], dtype=torch.int32)
"""int32 [256]: the bit of each byte's bucket."""
_CHUNK = 18  # decimal digits per int64 chunk of a canonical number (10**18 < 2**63)
_DIGIT_POW10 = torch.tensor(  # [256 * _CHUNK]: byte b, exponent e -> digit value of b (0 if none) * 10**e
    [(b - DIGIT0) * 10**e if DIGIT0 <= b <= DIGIT9 else 0 for b in range(256) for e in range(_CHUNK)],
    dtype=torch.long,
)


class ByteTables(NamedTuple):
    """The byte tables on one device (`byte_tables`)."""

    classes: torch.Tensor  # int64 [256]: CLASSES
    classes_i32: torch.Tensor  # int32 [256]: CLASSES
    buckets: torch.Tensor  # int32 [256]: BUCKETS
    signed_pow10: torch.Tensor  # int64 [2 * 256 * _CHUNK]: _DIGIT_POW10, then its negation


def byte_tables(device: torch.device) -> ByteTables:
    """The byte tables on `device`, copied once."""
    return cached(
        ("byte tables", device),
        lambda: ByteTables(
            CLASSES.to(device),
            CLASSES.to(device, torch.int32),
            BUCKETS.to(device),
            torch.cat([_DIGIT_POW10, -_DIGIT_POW10]).to(device),  # [sign * 256 * _CHUNK + b * _CHUNK + e]
        ),
    )


def numbers(x: torch.Tensor, cls: torch.Tensor):
    """The number at the start of each byte row, in canonical form. x: LongTensor [R, W] bytes, 0 past the end,
    the last column 0; cls: CLASSES of x.

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
    j0 = (cls & NOT_SKIP).argmax(dim=1, keepdim=True)  # first byte that is not a space or '$'
    neg = (cls.gather(1, j0) >> _MINUS_SHIFT) & 1  # [R, 1] 0 / 1
    j1 = j0 + neg  # after an optional '-'
    after = pos >= j1
    rest = ((cls & NOT_BODY) * after).argmax(dim=1, keepdim=True)  # first byte past the run
    digit = ((cls >> _DIGIT_SHIFT) & 1) * (pos < rest)  # 0 / 1: the run's digits (no digit comes before j1)
    end = (digit * pos1).amax(dim=1, keepdim=True)  # past the last digit: trailing ',' / '.' dropped
    sep = (cls & (C_DOT | C_COMMA)) * (after & (pos < end))  # the number's separators (their class bits)
    # first '.', W = none (as W - the largest W - pos over the '.'s: amax is several times faster than amin here)
    dot = W - (((sep & C_DOT) * rpos).amax(dim=1, keepdim=True) >> _DOT_SHIFT)
    # a number: a digit first, and no separator after its first '.' (a second '.', a ','): 8 > that separator's bits
    is_number = ((cls.gather(1, j1) & C_DIGIT) > (sep * (pos > dot)).amax(dim=1, keepdim=True)).squeeze(1)
    cnt = digit.cumsum(dim=1)
    r = cnt - cnt.gather(1, (dot - 1).clamp_(min=0))  # <= 0: integer digit, -r after it; > 0: fraction digit r
    frac = r > 0
    q = torch.maximum(r - 1, -r)  # fraction: r - 1; integer: -r
    # q // 18 and q % 18 for 0 <= q < 20000 by a multiply and a shift (exact there; a division is slower)
    div = (q * 3641) >> 16 if W < 20000 else q // _CHUNK
    # digit value * 10 ** (q % 18), negated for a negative number (the table's second half); 0 off the digits
    val = lookup(byte_tables(x.device).signed_pow10, (x * _CHUNK + (q - div * _CHUNK) + neg * (256 * _CHUNK)) * digit)
    col = (div * 2 + frac).clamp_(max=2 * C - 1)
    canon = torch.zeros(R, 2 * C, dtype=torch.long, device=x.device).scatter_add_(1, col, val)
    return canon, is_number, rest.squeeze(1)


def _positions(W: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(arange(W), arange(1, W + 1), W - arange(W)) on `device`, made once per width."""

    def make():
        pos = torch.arange(W, device=device)
        return pos, pos + 1, W - pos

    return cached(("positions", W, device), make)


def same_number(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [R, Ca], b [R, K, Cb] canonical numbers (zero-padded to one width) -> equal BoolTensor [R, K]."""
    w = max(a.shape[1], b.shape[2])
    if a.shape[1] < w:
        a = torch.nn.functional.pad(a, (0, w - a.shape[1]))
    if b.shape[2] < w:
        b = torch.nn.functional.pad(b, (0, w - b.shape[2]))
    return (a.unsqueeze(1) == b).all(dim=-1)
