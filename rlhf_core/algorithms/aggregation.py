"""Reducing a per-token loss matrix to a scalar, under a validity mask.

Shapes: loss_mat and mask are [N, L] (N sequences, L response positions). `mask` is bool or float
(float entries act as weights); None means every position is valid. An all-zero mask reduces to 0 with
zero gradient, never NaN: every division guards its denominator with `torch.where`, not `.item()`, so
nothing here synchronises with the device.
"""

from __future__ import annotations

from typing import Optional

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def as_mask(mask: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """`mask` as a float tensor of `like`'s dtype and shape (ones when None)."""
    if mask is None:
        return torch.ones_like(like)
    return mask.to(like.dtype).expand_as(like)


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, with den = 0 replaced by 1 (the numerators here are then 0 as well)."""
    return num / torch.where(den != 0, den, torch.ones_like(den))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ(x·m) / Σm over all elements; 0 when the mask is empty. x, mask: same shape. Returns []."""
    return safe_div((x * mask).sum(), mask.sum())


def agg_loss(loss_mat: torch.Tensor, mask: Optional[torch.Tensor], agg: str = "token-mean") -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    loss_mat: FloatTensor [N, L]; mask: Bool/FloatTensor [N, L] or None. Returns a scalar tensor.
    "token-mean":              Σ(ℓ·m) / Σm                     (every token weighs the same)
    "seq-mean-token-mean":     mean over sequences with Σ_t m > 0 of Σ_t(ℓ·m) / Σ_t m
    "seq-mean-token-sum":      mean over sequences with Σ_t m > 0 of Σ_t(ℓ·m)
    "seq-mean-token-sum-norm": Σ(ℓ·m) / (N·L)                  (Dr.GRPO, arXiv 2503.20783: a constant
                                                                 normaliser, no length bias)
    """
    m = as_mask(mask, loss_mat)
    weighted = loss_mat * m
    if agg == "token-mean":
        return safe_div(weighted.sum(), m.sum())
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens = m.sum(dim=-1)
        per_seq = weighted.sum(dim=-1)
        if agg == "seq-mean-token-mean":
            per_seq = safe_div(per_seq, tokens)
        has_tokens = (tokens > 0).to(loss_mat.dtype)
        return safe_div((per_seq * has_tokens).sum(), has_tokens.sum())
    if agg == "seq-mean-token-sum-norm":
        return weighted.sum() / max(loss_mat.numel(), 1)
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGG_MODES}")
