"""Building blocks of the policy losses: inputs flattened and cleaned, importance ratios, the clipped
surrogate, M2PO's trust-region mask, TIS weights, the KL term and the common stats.

Shapes and the conventions (invalid positions zeroed before any arithmetic, no host sync) are those of
`rlhf_core.algorithms.policy_loss`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from rlhf_core.algorithms.aggregation import AGG_MODES, agg_loss, as_mask, masked_mean, safe_div
from rlhf_core.algorithms.correction import correction_weights
from rlhf_core.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rlhf_core.algorithms.options import IMPORTANCE_LEVELS

Stats = dict[str, torch.Tensor]
Norm = Optional[Mapping[str, torch.Tensor]]

_LOG_RATIO_CLAMP = 20.0

# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


class _Inputs:
    """Inputs flattened to [N, L], validated, with invalid positions zeroed."""

    def __init__(self, logprobs, old_logprobs, advantages, mask, ref_logprobs=None, rollout_logprobs=None):
        if logprobs.dim() < 2:
            raise ValueError(f"logprobs must be [N, L] (or [B, G, L]), got shape {tuple(logprobs.shape)}")
        shape = logprobs.shape
        L = shape[-1]

        def flat(x: Optional[torch.Tensor], name: str) -> Optional[torch.Tensor]:
            if x is None:
                return None
            if x.shape != shape:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} like logprobs")
            return x.reshape(-1, L)

        lp = logprobs.reshape(-1, L)
        self.mask = as_mask(None if mask is None else flat(mask, "mask"), lp)
        self.valid = self.mask > 0
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)

        def clean(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            # torch.where (not multiplication): 0·(-inf) and 0·NaN would poison values and gradients.
            return None if x is None else torch.where(self.valid, x.to(lp.dtype), zero)

        self.logprobs = clean(lp)
        self.old_logprobs = clean(flat(old_logprobs, "old_logprobs"))
        self.ref_logprobs = clean(flat(ref_logprobs, "ref_logprobs"))
        self.rollout_logprobs = clean(flat(rollout_logprobs, "rollout_logprobs"))

        adv = advantages.to(lp.dtype)
        if adv.shape == shape:
            adv = adv.reshape(-1, L)
            self.advantages = torch.where(self.valid, adv, zero)
        elif adv.numel() == lp.shape[0]:
            self.advantages = adv.reshape(-1, 1)
        else:
            raise ValueError(
                f"advantages have shape {tuple(advantages.shape)}; expected one per sequence "
                f"({tuple(shape[:-1])}) or one per token ({tuple(shape)})"
            )


def importance_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """Importance ratio at token or sequence (GSPO) level.

    log_ratio: FloatTensor [N, L] = logprobs − old_logprobs; mask: FloatTensor [N, L].
    Returns FloatTensor [N, L]: exp(clamp(log r_t, ±20)) per token, or for "sequence"
    exp(clamp(Σ_t m·log r_t / Σ_t m, ±20)) broadcast over the sequence's tokens.
    """
    if level == "token":
        log_r = log_ratio
    elif level == "sequence":
        log_r = safe_div((log_ratio * mask).sum(-1, keepdim=True), mask.sum(-1, keepdim=True))
        log_r = log_r.expand_as(log_ratio)
    else:
        raise ValueError(f"unknown importance_level {level!r}; expected one of {IMPORTANCE_LEVELS}")
    return torch.exp(log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: Optional[float] = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic per-token surrogate (to minimise).

    ratio: FloatTensor [N, L]; advantages: FloatTensor [N, 1] or [N, L].
    ℓ = max(−A·r, −A·clip(r, 1 − clip_eps, 1 + (clip_eps_high or clip_eps)))   (ℓ = −A·r if clip_eps is None)
    dual clip c > 1 (arXiv 1912.09729): for A < 0, ℓ = min(ℓ, −A·c), bounding the loss of a token whose
    ratio has exploded.
    Returns (ℓ [N, L], clipped [N, L] bool: the clipped branch is active,
             dual_clipped [N, L] bool: the dual bound is active).
    """
    unclipped = -advantages * ratio
    if clip_eps is None:
        loss = unclipped
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        high = clip_eps if clip_eps_high is None else clip_eps_high
        clipped_loss = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + high)
        loss = torch.maximum(unclipped, clipped_loss)
        clipped = clipped_loss > unclipped
    if dual_clip is None:
        return loss, clipped, torch.zeros_like(clipped)
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    bound = -advantages * dual_clip
    negative = (advantages < 0).expand_as(loss)
    dual = negative & (loss > bound)
    return torch.where(negative, torch.minimum(loss, bound), loss), clipped, dual


def m2po_trust_region_mask(
    log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, m2_threshold: float = 0.04
) -> torch.Tensor:
    """M2PO second-moment trust-region mask (Algorithm 1 of arXiv 2510.01161), batched.

    log_ratio: FloatTensor [N, L] = logprobs − behavior_logprobs (detached here); advantages: [N, 1] or
    [N, L]; valid: BoolTensor [N, L]. Returns BoolTensor [N, L], True = keep.

    Candidates are valid tokens whose ratio moved in the advantage's direction: (A > 0, d > 0) or
    (A < 0, d < 0), with d the log-ratio and v = d². Candidates are masked in descending order of v until
    the mean of v over the remaining candidates is ≤ m2_threshold. Since the prefix means of an
    ascending sort never decrease, that keeps exactly the longest ascending prefix whose mean is
    ≤ m2_threshold: one sort, one cumulative sum and one scatter, no loop and no host sync.
    Non-candidates are always kept. Ties in v are broken by position (stable sort: earlier kept).
    """
    d = log_ratio.detach()
    adv = advantages.detach().expand_as(d)
    v = d.square()
    candidate = valid & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))

    flat_v = torch.where(candidate, v, torch.full_like(v, float("inf"))).reshape(-1)
    sorted_v, order = torch.sort(flat_v, stable=True)
    n_candidates = candidate.sum()
    position = torch.arange(1, flat_v.numel() + 1, device=v.device)
    in_candidates = position <= n_candidates
    prefix_mean = torch.cumsum(torch.where(in_candidates, sorted_v, torch.zeros_like(sorted_v)), 0) / position
    ok = in_candidates & (prefix_mean <= m2_threshold)
    keep_count = torch.where(ok, position, torch.zeros_like(position)).amax()
    keep_sorted = position <= keep_count
    keep_flat = torch.empty_like(keep_sorted).scatter_(0, order, keep_sorted)
    return ~candidate | keep_flat.reshape(d.shape)


def _ratio_stats(x: _Inputs, log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor) -> Stats:
    m = x.mask
    return {
        "policy/ratio_mean": masked_mean(ratio, m).detach(),
        "policy/ratio_max": torch.where(x.valid, ratio, torch.zeros_like(ratio)).amax().detach(),
        # k3 estimate of KL(π_old ‖ π_θ) on tokens sampled from π_old: ≥ 0, low variance.
        "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, m).detach(),
        "policy/clip_frac": masked_mean(clipped.to(m.dtype), m).detach(),
    }


def _tis_weights(x: _Inputs, tis_cap: Optional[float], stats: Stats) -> Optional[torch.Tensor]:
    """min(exp(old − rollout), cap), detached; None when TIS is off. The tensor functions' own keyword
    (compute_*_loss(rollout_logprobs=, tis_cap=)): the one correction (`correction_weights`, mode tis, level
    token) under the stats names tis/weight_mean, tis/capped_frac. Configs use algorithm.rollout_correction."""
    if tis_cap is None or x.rollout_logprobs is None:
        return None
    w, s = correction_weights(x.old_logprobs, x.rollout_logprobs, x.mask, "tis", "token", upper=tis_cap)
    stats["tis/weight_mean"] = s["correction/weight_mean"]
    stats["tis/capped_frac"] = s["correction/clipped_frac"]
    return w


def _agg_kwargs(norm_len: Optional[float], global_norm: Norm) -> dict[str, Any]:
    """Keyword arguments of agg_loss: the length normaliser and the step's denominators."""
    return {"norm_len": norm_len, **(global_norm or {})}


def _add_kl(
    pg_loss: torch.Tensor,
    x: _Inputs,
    agg: str,
    kl_coef: float,
    kl_estimator: str,
    stats: Stats,
    agg_kwargs: dict[str, Any],
) -> torch.Tensor:
    stats["loss/policy"] = pg_loss.detach()
    if x.ref_logprobs is None:
        if kl_coef > 0:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the frozen reference policy's log-probs)")
        return pg_loss
    kl = agg_loss(kl_penalty(x.logprobs, x.ref_logprobs, kl_estimator), x.mask, agg, **agg_kwargs)
    stats["loss/kl"] = kl.detach()
    return pg_loss + kl_coef * kl if kl_coef > 0 else pg_loss


def _check_names(agg: str, importance_level: str, kl_estimator: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGG_MODES}")
    if importance_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"unknown importance_level {importance_level!r}; expected one of {IMPORTANCE_LEVELS}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kl_estimator!r}; expected one of {KL_ESTIMATORS}")
