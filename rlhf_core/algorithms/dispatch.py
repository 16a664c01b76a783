"""Policy losses by name: `compute_policy_loss(algo_cfg, ...)` calls the loss `algo_cfg.loss` registered with
`rlhf_core.algorithms.register_policy_loss`, through its one signature fn(inputs: LossInputs, options).

Shapes and stats are those of `rlhf_core.algorithms.policy_loss` (its module docstring).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from rlhf_core.algorithms.aggregation import agg_loss, as_mask, global_normalisers
from rlhf_core.algorithms.correction import apply_correction
from rlhf_core.algorithms.registry import POLICY_LOSS_REGISTRY, policy_loss_spec
from rlhf_core.algorithms.surrogate import Norm, Stats, _add_kl, _agg_kwargs, _Inputs


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a registered policy loss gets besides its options: fn(inputs: LossInputs, options) -> (loss, stats).

    Tensors (shapes as in rlhf_core.algorithms.policy_loss): logprobs (with gradient), old_logprobs (the behaviour
    log-probs the ratio is taken against), advantages, mask, ref_logprobs (given when the KL reference is
    used), rollout_logprobs (the engine's, when given apart from old_logprobs). The algorithm's settings every
    loss is expected to honour: agg, importance_level, kl_coef (0 when there is no ref_logprobs), kl_estimator.
    With algorithm.rollout_correction on, the dispatch has already applied it (rlhf_core.algorithms.correction):
    old_logprobs are then the trainer's log-probs and advantages [N, L] carry the correction weights. The step's
    normalisation: norm_len, global_norm (see policy_loss; `aggregate` applies both). keep_mask,
    kept_norm: the rows' share of the step's token mask of a loss registered with step_mask, else None.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    agg: str = "token-mean"
    importance_level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    norm_len: Optional[float] = None
    global_norm: Norm = None
    keep_mask: Optional[torch.Tensor] = None
    kept_norm: Norm = None

    def ratio_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(logprobs, old_logprobs, advantages, mask): the positional arguments of every built-in compute_*_loss."""
        return self.logprobs, self.old_logprobs, self.advantages, self.mask

    def shared(self) -> dict[str, Any]:
        """The keyword arguments every built-in compute_*_loss takes besides its own options."""
        return {
            "agg": self.agg,
            "importance_level": self.importance_level,
            "rollout_logprobs": self.rollout_logprobs,
            "ref_logprobs": self.ref_logprobs,
            "kl_coef": self.kl_coef,
            "kl_estimator": self.kl_estimator,
            "norm_len": self.norm_len,
            "global_norm": self.global_norm,
        }

    def valid(self) -> torch.Tensor:
        """FloatTensor [N, L]: the mask as floats (all ones when mask is None)."""
        return as_mask(self.mask, self.logprobs)

    def aggregate(self, per_token: torch.Tensor) -> torch.Tensor:
        """A per-token loss [N, L] (zero it at invalid positions first) -> this call's share of the step's
        loss: agg_loss with agg, norm_len and the step's global_norm."""
        return agg_loss(per_token, self.valid(), self.agg, **_agg_kwargs(self.norm_len, self.global_norm))

    def add_kl(self, pg_loss: torch.Tensor, stats: Stats) -> torch.Tensor:
        """pg_loss + kl_coef · KL to the reference (aggregated like the loss), as the built-in losses add it:
        stats get "loss/policy" and, with ref_logprobs, "loss/kl"."""
        x = _Inputs(self.logprobs, self.old_logprobs, self.advantages, self.mask, self.ref_logprobs)
        return _add_kl(
            pg_loss, x, self.agg, self.kl_coef, self.kl_estimator, stats, _agg_kwargs(self.norm_len, self.global_norm)
        )


POLICY_LOSSES = POLICY_LOSS_REGISTRY.view(lambda spec: spec.fn)
"""Read-only view of the registry: every loss name (and alias) -> its registered fn(inputs, options)."""
STEP_MASK_LOSSES = POLICY_LOSS_REGISTRY.names_where(lambda spec: spec.step_mask is not None)
"""Read-only view: the losses whose token mask is a statistic of the whole step (see step_keep_mask)."""
_LOSS_FIELDS = POLICY_LOSS_REGISTRY.view(lambda spec: tuple(spec.options.model_fields))
"""Read-only view: every loss -> the names of its options (its `algorithm.loss_options`)."""


def _loss_inputs(algo_cfg: Any, *tensors: Optional[torch.Tensor], **step: Any) -> LossInputs:
    """LossInputs of (logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs) with the
    config's common settings."""
    ref_logprobs = tensors[4]
    return LossInputs(
        *tensors,
        agg=algo_cfg.agg,
        importance_level=algo_cfg.importance_level,
        kl_coef=algo_cfg.kl_coef if ref_logprobs is not None else 0.0,
        kl_estimator=algo_cfg.kl_estimator,
        **step,
    )


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
    """The registered loss named by `algo_cfg.loss` (an `AlgorithmConfig`), with `algo_cfg.loss_options`.

    Shapes as in the module docstring. For M2PO `old_logprobs` are the behaviour log-probs. The KL term
    (kl_coef · KL, any built-in loss) is added when algo_cfg.kl_coef > 0 and ref_logprobs is given; with
    ref_logprobs alone it is only reported as "loss/kl".
    norm_len: the "seq-mean-token-sum-norm" normaliser; the trainer passes rollout.max_new_tokens.
    global_norm: the whole step's `global_normalisers(mask)` when these rows are one micro-batch of it.
    keep_mask [N, L], kept_norm: the step's token mask and its normalisers (`step_keep_mask`), for a loss
    whose mask is a statistic of the whole step (M2PO); refused by the others.
    """
    spec = policy_loss_spec(algo_cfg.loss)
    if (keep_mask is not None or kept_norm is not None) and spec.step_mask is None:
        raise ValueError(f"policy loss {algo_cfg.loss!r} takes no step-wide keep_mask/kept_norm")
    correction = getattr(algo_cfg, "rollout_correction", None)
    behaviour, raw_advantages = old_logprobs, advantages
    # algorithm.rollout_correction, for every loss: the ratio against the trainer's log-probs, w·A (correction.py)
    old_logprobs, advantages, mask, corrected = apply_correction(
        correction, logprobs, old_logprobs, advantages, mask, rollout_logprobs
    )
    if spec.step_mask is not None and keep_mask is None and corrected:
        # a step-mask loss (M2PO) keeps its mask on the behaviour ratio: after the correction its ratio is taken
        # against the trainer's log-probs, 1 by construction, and it would mask nothing (it would be PPO)
        keep_mask, kept_norm = step_keep_mask(algo_cfg, logprobs, behaviour, raw_advantages, mask)
    inputs = _loss_inputs(
        algo_cfg,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        ref_logprobs,
        rollout_logprobs,
        norm_len=norm_len,
        global_norm=global_norm,
        keep_mask=keep_mask,
        kept_norm=kept_norm,
    )
    loss, stats = spec.fn(inputs, algo_cfg.loss_options)
    return loss, {**stats, **corrected}


def step_keep_mask(
    algo_cfg: Any,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> Optional[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The token mask of a loss whose mask is a statistic of the whole step, and its normalisers.

    logprobs (current policy, no gradient needed), old_logprobs, mask: [N, L] of the whole step;
    advantages: [N] or [N, L]. Returns None for a loss registered without step_mask (PPO, GRPO), else
    (keep BoolTensor [N, L], kept_norm = global_normalisers(keep·mask)): slice keep to a micro-batch's
    rows and pass both to compute_policy_loss(keep_mask=..., kept_norm=...).
    """
    spec = policy_loss_spec(algo_cfg.loss)
    if spec.step_mask is None:
        return None
    # on the behaviour ratio, also with a rollout correction (which would make the ratio 1: see compute_policy_loss)
    inputs = _loss_inputs(algo_cfg, logprobs.detach(), old_logprobs, advantages, mask, None, None)
    keep = spec.step_mask(inputs, algo_cfg.loss_options)
    valid = as_mask(mask, logprobs.detach())
    return keep, global_normalisers(keep.reshape(valid.shape).to(valid.dtype) * valid)
