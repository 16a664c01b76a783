"""Policy losses: pure functions on tensors, selected by name from `POLICY_LOSSES`.

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

from collections.abc import Mapping
from typing import Any, Optional

import torch

from rlhf_core.algorithms.aggregation import AGG_MODES, agg_loss, as_mask, global_normalisers, masked_mean, safe_div
from rlhf_core.algorithms.kl import KL_ESTIMATORS, kl_penalty

Stats = dict[str, torch.Tensor]
Norm = Optional[Mapping[str, torch.Tensor]]

_LOG_RATIO_CLAMP = 20.0
IMPORTANCE_LEVELS = ("token", "sequence")
M2PO_MASKINGS = ("trust_region", "ratio_sq")


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
    """min(exp(old − rollout), cap), detached; None when TIS is off."""
    if tis_cap is None or x.rollout_logprobs is None:
        return None
    raw = torch.exp((x.old_logprobs - x.rollout_logprobs).detach().clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    w = raw.clamp(max=tis_cap)
    stats["tis/weight_mean"] = masked_mean(w, x.mask)
    stats["tis/capped_frac"] = masked_mean((raw > tis_cap).to(w.dtype), x.mask)
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


POLICY_LOSSES = {
    "ppo": compute_ppo_loss,
    "m2po": compute_m2po_loss,
    "grpo": compute_grpo_loss,
}

# Losses whose token mask is a statistic of the whole step's batch (see step_keep_mask).
STEP_MASK_LOSSES = ("m2po",)

# AlgorithmConfig fields each loss takes, beyond the shared ones passed by compute_policy_loss.
_LOSS_FIELDS = {
    "ppo": ("clip_eps", "clip_eps_high", "dual_clip"),
    "grpo": ("clip_eps", "clip_eps_high", "dual_clip"),
    "m2po": ("clip_eps", "clip_eps_high", "dual_clip", "m2_threshold", "masking", "ratio_sq_threshold"),
}


def compute_policy_loss(
    algo_cfg: Any,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    *,
    norm_len: Optional[float] = None,
    global_norm: Norm = None,
    keep_mask: Optional[torch.Tensor] = None,
    kept_norm: Norm = None,
) -> tuple[torch.Tensor, Stats]:
    """The loss named by `algo_cfg.loss` (an `AlgorithmConfig`), with that config's options.

    Shapes as in the module docstring. For M2PO `old_logprobs` are the behaviour log-probs. The KL term
    (kl_coef · KL, any loss) is added when algo_cfg.kl_coef > 0 and ref_logprobs is given; with
    ref_logprobs alone it is only reported as "loss/kl".
    norm_len: the "seq-mean-token-sum-norm" normaliser; the trainer passes rollout.max_new_tokens.
    global_norm: the whole step's `global_normalisers(mask)` when these rows are one micro-batch of it.
    keep_mask [N, L], kept_norm: the step's token mask and its normalisers (`step_keep_mask`), for a loss
    whose mask is a statistic of the whole step (M2PO); refused by the others.
    """
    try:
        fn = POLICY_LOSSES[algo_cfg.loss]
    except KeyError:
        raise ValueError(f"unknown policy loss {algo_cfg.loss!r}; known: {sorted(POLICY_LOSSES)}") from None
    kwargs = {name: getattr(algo_cfg, name) for name in _LOSS_FIELDS[algo_cfg.loss]}
    if keep_mask is not None or kept_norm is not None:
        if algo_cfg.loss not in STEP_MASK_LOSSES:
            raise ValueError(f"policy loss {algo_cfg.loss!r} takes no step-wide keep_mask/kept_norm")
        kwargs.update(keep_mask=keep_mask, kept_norm=kept_norm)
    return fn(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        **kwargs,
        agg=algo_cfg.agg,
        importance_level=algo_cfg.importance_level,
        rollout_logprobs=rollout_logprobs,
        tis_cap=algo_cfg.tis_cap,
        ref_logprobs=ref_logprobs,
        kl_coef=algo_cfg.kl_coef if ref_logprobs is not None else 0.0,
        kl_estimator=algo_cfg.kl_estimator,
        norm_len=norm_len,
        global_norm=global_norm,
    )


def step_keep_mask(
    algo_cfg: Any,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> Optional[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The token mask of a loss whose mask is a statistic of the whole step, and its normalisers.

    logprobs (current policy, no gradient needed), old_logprobs, mask: [N, L] of the whole step;
    advantages: [N] or [N, L]. Returns None for a loss without such a mask (PPO, GRPO), else
    (keep BoolTensor [N, L], kept_norm = global_normalisers(keep·mask)): slice keep to a micro-batch's
    rows and pass both to compute_policy_loss(keep_mask=..., kept_norm=...).
    """
    if algo_cfg.loss not in STEP_MASK_LOSSES:
        return None
    keep = m2po_keep_mask(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        algo_cfg.m2_threshold,
        algo_cfg.masking,
        algo_cfg.ratio_sq_threshold,
        importance_level=algo_cfg.importance_level,
    )
    valid = as_mask(mask, logprobs.detach())
    return keep, global_normalisers(keep.reshape(valid.shape).to(valid.dtype) * valid)
