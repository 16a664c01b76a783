"""Rollout correction: importance weights between the rollout engine's log-probs and the trainer's.

The rollout engine samples from π_rollout (its own kernels, dtype, sampling code, and the weights it held);
the trainer computes π_train for the same tokens. With `algorithm.rollout_correction` on, every policy loss
takes its ratio against π_train (the "old" policy of decoupled PPO: the trainer's log-probs at the step, before
it updates) and each token's loss term is multiplied by a detached weight of ρ = π_train / π_rollout:

    level token      ρ_t = exp(log π_train(y_t) − log π_rollout(y_t))
    level sequence   ρ_t = exp(Σ_t' (log π_train(y_t') − log π_rollout(y_t'))) for every token of the row
                     (the product of the row's token ratios: verl's sequence-level IS weight)
    level geometric  ρ_t = exp(mean_t' (log π_train(y_t') − log π_rollout(y_t'))) for every token of the row
                     (the geometric mean of the row's token ratios: verl's "geometric" rejection level)
    mode tis         w = min(ρ, upper)                                  (truncated importance sampling)
    mode mis         w = ρ · 1[lower ≤ ρ ≤ upper]                       (masked importance sampling)
    mode icepop      mis at level token (IcePop: both tails masked per token)

lower defaults to 1 / upper (verl's default). Log-ratios (summed or averaged at the sequence levels) are
clamped to ±20 before exp (verl's SAFETY_BOUND). What a masked (rejected) token does is `rejected`: 'zero'
keeps its place in the loss's denominators with a term of 0, as IcePop's objective writes it; 'drop' takes it
out of the loss's token mask, as verl's rejection sampling does (its denominators count the kept tokens; the
trainer then rejects over the whole step before its micro-batches, `correction_keep`, so the update still does
not depend on trainer.micro_batch_size). The weights multiply the advantages
(`apply_correction`): every built-in loss is positively homogeneous in the advantages (the clipped surrogate,
dual clip, M2PO), so w·A gives exactly w·ℓ, while the KL term, which has no advantage, is not reweighted.
Shapes: [N, L] throughout; advantages [N] or [N, L].
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rlhf_core.algorithms.aggregation import as_mask, masked_mean, safe_div

SAFETY_BOUND = 20.0
CORRECTION_LEVELS = ("token", "sequence", "geometric")


def _at_least_float32(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def correction_ratio(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """ρ [N, L] (detached): per token, or the row's product (sequence) or geometric mean (geometric) of its token
    ratios, broadcast over its tokens; 0 off the mask."""
    valid = mask > 0
    log_ratio = torch.where(
        valid, (train_logprobs - rollout_logprobs).detach().to(_at_least_float32(train_logprobs)), 0.0
    )
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        m = mask.to(log_ratio.dtype)
        log_ratio = safe_div((log_ratio * m).sum(-1, keepdim=True), m.sum(-1, keepdim=True)).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown rollout_correction.level {level!r}; expected one of {CORRECTION_LEVELS}")
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return torch.where(valid, rho, torch.zeros_like(rho))


def correction_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor],
    mode: str,
    level: str = "token",
    lower: Optional[float] = None,
    upper: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(w [N, L] detached, 0 off the mask; stats) of a correction mode ('tis', 'mis', 'icepop').

    Stats (means over the valid tokens; weight_max the maximum): correction/weight_mean, correction/weight_max
    (of w), correction/clipped_frac (tokens whose ρ was truncated), correction/masked_frac (tokens zeroed)."""
    valid_f = as_mask(mask, train_logprobs)
    if mode == "icepop":
        if level != "token":
            raise ValueError("rollout_correction.mode 'icepop' masks per token: level must be 'token'")
        mode = "mis"
    rho = correction_ratio(train_logprobs, rollout_logprobs, valid_f, level)
    low = 1.0 / upper if lower is None else lower
    zero = torch.zeros_like(rho)
    if mode == "tis":
        clipped = rho > upper
        w, masked = rho.clamp(max=upper), torch.zeros_like(clipped)
    elif mode == "mis":
        masked = (rho < low) | (rho > upper)
        w, clipped = torch.where(masked, zero, rho), torch.zeros_like(masked)
    else:
        raise ValueError(f"unknown rollout_correction.mode {mode!r}; expected 'tis', 'mis' or 'icepop'")
    valid = valid_f > 0
    w = torch.where(valid, w, zero).detach()
    stats = {
        "correction/weight_mean": masked_mean(w, valid_f),
        "correction/weight_max": torch.where(valid, w, zero).amax() if w.numel() else zero.sum(),
        "correction/clipped_frac": masked_mean((clipped & valid).to(w.dtype), valid_f),
        "correction/masked_frac": masked_mean((masked & valid).to(w.dtype), valid_f),
    }
    return w, stats


def apply_correction(
    cfg: Any,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    rollout_logprobs: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """The one place a correction enters a loss: (old_logprobs, advantages, mask, stats) to hand the loss.

    cfg: an `algorithm.rollout_correction` (RolloutCorrection). Off ('none'): the inputs unchanged, no stats.
    On: π_rollout is `rollout_logprobs` (else `old_logprobs`, the behaviour log-probs the trainer passes),
    π_train is `logprobs` detached (the trainer's log-probs at the step: it takes one update per batch, so the
    forward pass that carries the gradient has the values of the weights it holds); the loss's ratio is then
    taken against π_train and the advantages ([N] or [N, L]) become w·A, [N, L]. With rejected 'drop', the
    mask returned leaves the rejected tokens out."""
    if cfg is None or not cfg.enabled:
        return old_logprobs, advantages, mask, {}
    rollout = old_logprobs if rollout_logprobs is None else rollout_logprobs
    train = logprobs.detach()
    w, stats = correction_weights(
        train.reshape(-1, train.shape[-1]),
        rollout.reshape(-1, train.shape[-1]),
        None if mask is None else mask.reshape(-1, train.shape[-1]),
        cfg.mode,
        cfg.level,
        cfg.lower,
        cfg.upper,
    )
    w = w.reshape(logprobs.shape).to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    if adv.shape != logprobs.shape:
        adv = adv.reshape(*logprobs.shape[:-1], 1)
    return train, adv * w, correction_keep(cfg, train, rollout, mask), stats


def correction_keep(
    cfg: Any, train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """The loss's token mask without the tokens a mis / icepop correction rejects (ρ outside [lower, upper]), for
    rejected 'drop' (verl's rejection sampling: the rejected leave the response mask); the mask unchanged for
    any other correction. Shapes [N, L] (or [L]); the result is boolean."""
    if cfg is None or not cfg.enabled or cfg.mode == "tis" or getattr(cfg, "rejected", "zero") != "drop":
        return mask
    valid = as_mask(mask, train_logprobs)
    level = "token" if cfg.mode == "icepop" else cfg.level
    shape = (-1, train_logprobs.shape[-1])
    rho = correction_ratio(
        train_logprobs.reshape(shape), rollout_logprobs.reshape(shape), valid.reshape(shape), level
    ).reshape(valid.shape)
    return (valid > 0) & (rho >= cfg.lower_bound) & (rho <= cfg.upper)


def step_rejection(
    cfg: Any, train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A step's token mask without the tokens a dropping correction (rejected 'drop') rejects, and the
    correction's stats over the step's mask before the drop (what the trainer logs: the rejected are counted);
    (mask, {}) for any other correction."""
    if cfg is None or not cfg.drops:
        return mask, {}
    _, stats = correction_weights(train_logprobs, rollout_logprobs, mask, cfg.mode, cfg.level, cfg.lower, cfg.upper)
    return correction_keep(cfg, train_logprobs, rollout_logprobs, mask), stats
