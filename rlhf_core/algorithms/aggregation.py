"""Reducing a per-token loss matrix to a scalar, under a validity mask.

Shapes: loss_mat and mask are [N, L] (N sequences, L response positions). `mask` is bool or float
(float entries act as weights); None means every position is valid. An all-zero mask reduces to 0 with
zero gradient, never NaN: every division guards its denominator with `torch.where`, not `.item()`, so
nothing here synchronises with the device.

Micro-batching. A step's batch may be split into micro-batches whose gradients are accumulated. Every
mode's denominator is a property of the whole step (its valid tokens, its sequences with tokens, its
rows), so `agg_loss` takes them as optional global normalisers (`global_normalisers(step_mask)`, the
global-token normalisation of verl): with them, the losses of the micro-batches sum exactly to the loss
of the whole batch, and so do their gradients. Without them each call normalises by its own rows.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

Number = Union[int, float, torch.Tensor]


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


def global_normalisers(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The denominators of `agg_loss` for a whole step, from the step's mask.

    mask: Bool/FloatTensor [N, L] of the whole step (float entries are weights). Returns a dict of scalar
    tensors on mask's device, to pass as `agg_loss(..., **global_normalisers(step_mask))`:
        "global_tokens": Σm                           (token-mean)
        "global_seqs":   #sequences with Σ_t m > 0    (seq-mean-token-mean, seq-mean-token-sum)
        "global_rows":   N                            (seq-mean-token-sum-norm)
    """
    m = mask if mask.is_floating_point() else mask.float()
    tokens = m.sum(dim=-1)
    return {
        "global_tokens": tokens.sum(),
        "global_seqs": (tokens > 0).to(m.dtype).sum(),
        "global_rows": torch.full((), float(m.shape[0]), dtype=m.dtype, device=m.device),
    }


def _div(num: torch.Tensor, den: Number) -> torch.Tensor:
    """num / den for a tensor or Python den; den = 0 leaves num (then 0 itself) unchanged."""
    if isinstance(den, torch.Tensor):
        return safe_div(num, den.to(num.dtype))
    return num / den if den != 0 else num


def agg_loss(
    loss_mat: torch.Tensor,
    mask: Optional[torch.Tensor],
    agg: str = "token-mean",
    *,
    norm_len: Optional[Number] = None,
    global_tokens: Optional[Number] = None,
    global_seqs: Optional[Number] = None,
    global_rows: Optional[Number] = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    loss_mat: FloatTensor [N, L]; mask: Bool/FloatTensor [N, L] or None. Returns a scalar tensor.
    "token-mean":              Σ(ℓ·m) / T                    (every token weighs the same)
    "seq-mean-token-mean":     Σ_i over sequences with Σ_t m > 0 of (Σ_t ℓ·m / Σ_t m), divided by S
    "seq-mean-token-sum":      Σ_i Σ_t ℓ·m, divided by S
    "seq-mean-token-sum-norm": Σ(ℓ·m) / (R · norm_len)       (Dr.GRPO, arXiv 2503.20783: a constant
                                                               normaliser, no length bias)
    T = global_tokens, S = global_seqs, R = global_rows: the step's valid tokens, sequences with tokens
    and rows (`global_normalisers`); each defaults to this call's own (Σm, sequences with Σ_t m > 0, N),
    so that without them the call is the plain aggregate of its rows.
    norm_len: the fixed length normaliser of "seq-mean-token-sum-norm", the generation budget
    (rollout.max_new_tokens; TRL's dr_grpo divides by max_completion_length). None falls back to L, the
    padded width of this batch, which depends on how wide the batch happens to be: pass it.
    """
    m = as_mask(mask, loss_mat)
    weighted = loss_mat * m
    if agg == "token-mean":
        return _div(weighted.sum(), m.sum() if global_tokens is None else global_tokens)
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens = m.sum(dim=-1)
        per_seq = weighted.sum(dim=-1)
        if agg == "seq-mean-token-mean":
            per_seq = safe_div(per_seq, tokens)
        has_tokens = (tokens > 0).to(loss_mat.dtype)
        return _div((per_seq * has_tokens).sum(), has_tokens.sum() if global_seqs is None else global_seqs)
    if agg == "seq-mean-token-sum-norm":
        total = _div(weighted.sum(), loss_mat.shape[0] if global_rows is None else global_rows)
        return _div(total, loss_mat.shape[-1] if norm_len is None else norm_len)
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGG_MODES}")
