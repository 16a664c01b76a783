"""The critic's loss and statistics: pure functions on tensors.

Shapes: values, old_values, returns, mask are [N, T] (N sequences, T response positions).
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf_core.algorithms.aggregation import safe_div


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: Optional[float] = None,
    total_tokens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: ½ max((V − R)², (clip(V, V_old ± clip) − R)²), summed over the valid tokens
    and divided by `total_tokens` (the whole step's valid tokens, so micro-batch losses sum exactly to the
    step's; None: this call's own). clip None: the plain squared error.

    values (grad) / old_values (the values the advantages were computed with) / returns / mask: [N, T].
    Returns (loss: scalar, clipfrac: the summed count of tokens where the clipped term was the larger,
    over total_tokens too, so it also sums across micro-batches)."""
    m = mask.to(values.dtype)
    den = m.sum() if total_tokens is None else total_tokens.to(values.dtype)
    returns = returns.detach()
    unclipped = (values - returns).square()
    if clip is None:
        per_token = unclipped
        clipped_more = torch.zeros_like(per_token)
    else:
        old = old_values.detach()
        clipped = (old + (values - old).clamp(-clip, clip) - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clipped_more = (clipped > unclipped).to(values.dtype)
    loss = 0.5 * safe_div((per_token * m).sum(), den)
    clipfrac = safe_div((clipped_more * m).sum(), den).detach()
    return loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 − Var(R − V) / Var(R) over the valid tokens of `mask` ([N, T]): 1 when the critic predicts the
    returns, 0 when it predicts no better than their mean, negative when worse. 0 when Var(R) is 0."""
    m = mask.to(returns.dtype)
    n = m.sum().clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return ((x - mean).square() * m).sum() / n

    var_r = var(returns)
    ev = 1.0 - safe_div(var(returns - values), var_r)
    return torch.where(var_r > 0, ev, torch.zeros_like(ev))
