"""Policy losses: pure functions on tensors. By name: each is registered (`rlhf_core.algorithms.builtin`) and
called through `compute_policy_loss` (rlhf_core.algorithms.dispatch) with its options class.

Shapes (N sequences, L response positions; GRPO may also pass [B, G, L] with N = B·G):
    logprobs                     FloatTensor [N, L]  log π_θ(y_t) under the policy being trained (grad).
    old_logprobs                 FloatTensor [N, L]  log-probs the ratio is taken against: π_old for
                                                     PPO/GRPO, the behaviour policy π_behav for M2PO.
    advantages                   FloatTensor [N] (one per sequence, broadcast over tokens) or [N, L].
    mask                         Bool/FloatTensor [N, L] valid response positions; None = all valid.
    ref_logprobs                 FloatTensor [N, L]  frozen reference policy (KL penalty), optional.
    rollout_logprobs             FloatTensor [N, L]  what the rollout engine reported (TIS), optional.

Every loss returns `(loss, stats)`: `loss` a scalar carrying gradient to `logprobs`, `stats` a dict of
detached scalar tensors with namespaced keys. Nothing here calls `.item()` or branches on tensor
values, so the hot path never waits on the device. Invalid positions are zeroed before any arithmetic,
so padding holding -inf or NaN log-probs cannot leak NaN into the loss or its gradient; an all-zero
mask gives loss 0 and zero gradients.

Common options (keyword arguments of every loss, defaults off):
    importance_level  "token": r_t = π_θ/π_old per token (PPO). "sequence": GSPO (arXiv 2507.18071),
                      s_i = exp(masked mean_t log r_it), one ratio per sequence, clipped per sequence and
                      broadcast to its tokens (gradient flows through the mean); pair it with
                      agg="seq-mean-token-mean" for the paper's objective.
    rollout_logprobs, tis_cap
                      truncated importance sampling for the rollout-engine-vs-trainer mismatch
                      (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
                      training"): w = min(exp(old − rollout), cap), detached, multiplies ℓ.
    ref_logprobs, kl_coef, kl_estimator
                      loss += kl_coef · agg(kl_penalty(logprobs, ref_logprobs, kl_estimator)); the KL
                      is reported as "loss/kl" whenever ref_logprobs is given.
    norm_len          the fixed length normaliser of agg "seq-mean-token-sum-norm" (Dr.GRPO): the
                      generation budget, rollout.max_new_tokens. None falls back to L, the padded width.
    global_norm       the whole step's denominators, `global_normalisers(step_mask)` (a dict of scalar
                      tensors), when this call sees one micro-batch of the step: the loss is then this
                      micro-batch's exact share of the step's loss (policy term and KL term alike), so the
                      micro-batch losses and gradients sum to those of the whole batch. None: normalise by
                      this call's own rows.

Stats are of this call's rows: "loss/policy" (the policy-gradient term, before any KL) and "loss/kl" are
its shares of the step's loss when global_norm is given (sum them over micro-batches), the other
"policy/*", "m2po/*" and "tis/*" values are means over its valid tokens (weigh them by its token count),
and "policy/ratio_max" is its maximum (take the maximum).
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf_core.algorithms.aggregation import agg_loss, masked_mean
from rlhf_core.algorithms.options import M2PO_MASKINGS
from rlhf_core.algorithms.surrogate import (
    Norm,
    Stats,
    _add_kl,
    _agg_kwargs,
    _check_names,
    _Inputs,
    _ratio_stats,
    _tis_weights,
    clipped_surrogate,
    importance_ratio,
    m2po_trust_region_mask,
)

__all__ = ["compute_grpo_loss", "compute_m2po_loss", "compute_ppo_loss", "m2po_keep_mask"]

# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------


def compute_ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    clip_eps: Optional[float] = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    agg: str = "token-mean",
    *,
    importance_level: str = "token",
    rollout_logprobs: Optional[torch.Tensor] = None,
    tis_cap: Optional[float] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    norm_len: Optional[float] = None,
    global_norm: Norm = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped PPO surrogate (arXiv 1707.06347), with clip-higher (DAPO) and dual clip.

    logprobs, old_logprobs, mask: [N, L]; advantages: [N] or [N, L]. Returns (loss [], stats).
    r = exp(clamp(logprobs − old_logprobs, ±20)); ℓ = max(−A·r, −A·clip(r, 1−ε, 1+ε_high));
    dual_clip c: ℓ = min(ℓ, −A·c) where A < 0; loss = agg(ℓ, mask) (with norm_len and global_norm, see
    the module docstring). clip_eps=None disables clipping.
    Stats: loss/policy, policy/{ratio_mean, ratio_max, approx_kl, clip_frac}, policy/dual_clip_frac
    (with dual_clip), tis/* (with TIS), loss/kl (with ref_logprobs).
    """
    _check_names(agg, importance_level, kl_estimator)
    x = _Inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs)
    log_ratio = x.logprobs - x.old_logprobs
    ratio = importance_ratio(log_ratio, x.mask, importance_level)
    loss_mat, clipped, dual = clipped_surrogate(ratio, x.advantages, clip_eps, clip_eps_high, dual_clip)
    stats = _ratio_stats(x, log_ratio, ratio, clipped)
    if dual_clip is not None:
        stats["policy/dual_clip_frac"] = masked_mean(dual.to(x.mask.dtype), x.mask).detach()
    w = _tis_weights(x, tis_cap, stats)
    if w is not None:
        loss_mat = loss_mat * w
    agg_kwargs = _agg_kwargs(norm_len, global_norm)
    pg_loss = agg_loss(loss_mat, x.mask, agg, **agg_kwargs)
    return _add_kl(pg_loss, x, agg, kl_coef, kl_estimator, stats, agg_kwargs), stats


def compute_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    clip_eps: Optional[float] = 0.2,
    clip_eps_high: Optional[float] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    agg: str = "token-mean",
    *,
    dual_clip: Optional[float] = None,
    importance_level: str = "token",
    rollout_logprobs: Optional[torch.Tensor] = None,
    tis_cap: Optional[float] = None,
    norm_len: Optional[float] = None,
    global_norm: Norm = None,
) -> tuple[torch.Tensor, Stats]:
    """GRPO (arXiv 2402.03300): the clipped surrogate on group advantages plus kl_coef · KL to the reference.

    logprobs, old_logprobs, ref_logprobs, mask: [B·G, L] or [B, G, L]; advantages: [B·G], [B, G] or
    token-level like logprobs. Returns (loss [], stats); the KL is aggregated with the same `agg` and
    reported as "loss/kl". The paper's objective is agg="seq-mean-token-mean" with k3; token-mean
    (DAPO) is the default here.
    """
    return compute_ppo_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps,
        clip_eps_high,
        dual_clip,
        agg,
        importance_level=importance_level,
        rollout_logprobs=rollout_logprobs,
        tis_cap=tis_cap,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        norm_len=norm_len,
        global_norm=global_norm,
    )


def _m2po_keep(
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    masking: str,
    m2_threshold: float,
    ratio_sq_threshold: float,
) -> torch.Tensor:
    """The M2PO keep mask [N, L] (bool) of the rows given, from their log-ratios and ratios."""
    if masking == "trust_region":
        return m2po_trust_region_mask(log_ratio, advantages, valid, m2_threshold)
    if masking == "ratio_sq":
        return ratio.detach().square() < ratio_sq_threshold
    raise ValueError(f"unknown M2PO masking {masking!r}; expected one of {M2PO_MASKINGS}")


def m2po_keep_mask(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    m2_threshold: float = 0.04,
    masking: str = "trust_region",
    ratio_sq_threshold: float = 4.0,
    *,
    importance_level: str = "token",
) -> torch.Tensor:
    """The M2PO keep mask of a whole step's batch, computed once and passed to every micro-batch.

    logprobs (current policy, no gradient needed), behavior_logprobs, mask: [N, L]; advantages: [N] or
    [N, L]. Returns BoolTensor [N, L], True = keep: what compute_m2po_loss computes on these rows when
    given no keep_mask (entries at invalid positions do not matter: those carry no loss).
    The second moment of "trust_region" is a statistic of the batch, and so is the number of kept tokens
    that "ratio_sq" normalises by: a mask (and its `global_normalisers(keep·mask)`) computed per
    micro-batch would make the update depend on trainer.micro_batch_size.
    """
    x = _Inputs(logprobs.detach(), behavior_logprobs, advantages, mask)
    log_ratio = x.logprobs - x.old_logprobs
    ratio = importance_ratio(log_ratio, x.mask, importance_level)
    keep = _m2po_keep(log_ratio, ratio, x.advantages, x.valid, masking, m2_threshold, ratio_sq_threshold)
    return keep.reshape(logprobs.shape)


def compute_m2po_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    m2_threshold: float = 0.04,
    masking: str = "trust_region",
    clip_eps: Optional[float] = None,
    ratio_sq_threshold: float = 4.0,
    agg: str = "token-mean",
    *,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    importance_level: str = "token",
    rollout_logprobs: Optional[torch.Tensor] = None,
    tis_cap: Optional[float] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    norm_len: Optional[float] = None,
    global_norm: Norm = None,
    keep_mask: Optional[torch.Tensor] = None,
    kept_norm: Norm = None,
) -> tuple[torch.Tensor, Stats]:
    """M2PO: staleness-robust policy gradient against the behaviour policy (arXiv 2510.01161).

    logprobs, behavior_logprobs, mask: [N, L]; advantages: [N] or [N, L]. Returns (loss [], stats).
    masking "trust_region" (Algorithm 1): M = m2po_trust_region_mask(d, A, valid, m2_threshold) with
        d = logprobs − behavior_logprobs; ℓ = −M·A·r (r PPO-clipped only when clip_eps is given);
        loss = agg(ℓ, mask) — masked tokens stay in the denominator.
    masking "ratio_sq" (the r² rule): M = 1[r² < ratio_sq_threshold]; ℓ = the PPO-clipped surrogate with
        clip_eps (0.2 when None); loss = agg(ℓ, M·mask) — only kept tokens count, so token-mean divides
        by the number of kept tokens.
    keep_mask: BoolTensor [N, L], M precomputed over the whole step (`m2po_keep_mask`, sliced to these
        rows); None computes M from these rows alone, which is the step's M only when they are the whole
        step. kept_norm: `global_normalisers(M·mask)` of the whole step, the denominators of "ratio_sq"
        (None: those of these rows). global_norm (the step's `global_normalisers(mask)`) gives those of
        "trust_region" and of the KL term.
    Stats: m2po/m2 (mean d² over valid tokens, before masking), m2po/masked_frac (masked / valid),
    plus those of compute_ppo_loss.
    """
    _check_names(agg, importance_level, kl_estimator)
    if masking not in M2PO_MASKINGS:
        raise ValueError(f"unknown M2PO masking {masking!r}; expected one of {M2PO_MASKINGS}")
    x = _Inputs(logprobs, behavior_logprobs, advantages, mask, ref_logprobs, rollout_logprobs)
    log_ratio = x.logprobs - x.old_logprobs
    ratio = importance_ratio(log_ratio, x.mask, importance_level)
    if keep_mask is None:
        keep = _m2po_keep(log_ratio, ratio, x.advantages, x.valid, masking, m2_threshold, ratio_sq_threshold)
    else:
        if keep_mask.shape != logprobs.shape:
            raise ValueError(
                f"keep_mask has shape {tuple(keep_mask.shape)}, expected {tuple(logprobs.shape)} like logprobs"
            )
        keep = keep_mask.reshape(x.mask.shape)
    if masking == "ratio_sq":
        clip_eps = 0.2 if clip_eps is None else clip_eps
    loss_mat, clipped, dual = clipped_surrogate(ratio, x.advantages, clip_eps, clip_eps_high, dual_clip)
    keep_f = keep.to(x.mask.dtype)

    stats = _ratio_stats(x, log_ratio, ratio, clipped)
    if dual_clip is not None:
        stats["policy/dual_clip_frac"] = masked_mean(dual.to(x.mask.dtype), x.mask).detach()
    stats["m2po/m2"] = masked_mean(log_ratio.detach().square(), x.mask)
    stats["m2po/masked_frac"] = masked_mean(1.0 - keep_f, x.mask)

    w = _tis_weights(x, tis_cap, stats)
    if w is not None:
        loss_mat = loss_mat * w
    agg_kwargs = _agg_kwargs(norm_len, global_norm)
    if masking == "trust_region":
        pg_loss = agg_loss(loss_mat * keep_f, x.mask, agg, **agg_kwargs)
    else:
        pg_loss = agg_loss(loss_mat, keep_f * x.mask, agg, **_agg_kwargs(norm_len, kept_norm))
    return _add_kl(pg_loss, x, agg, kl_coef, kl_estimator, stats, agg_kwargs), stats
