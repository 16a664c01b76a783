"""Algorithms: pure functions on tensors, selected by name from small registries.

ADVANTAGE_ESTIMATORS  rewards [..., G] -> advantages [..., G]            (advantages.py); "gae":
                      compute_gae_advantages(token_rewards, values, mask, gamma, lam) [N, T] -> (adv, returns)
value_loss            clipped value loss of a critic                     (value_loss.py)
POLICY_LOSSES         (logprobs, old_logprobs, advantages, mask, ...) -> (loss, stats)  (policy_loss.py)
kl_penalty            per-token KL estimators k1/k2/k3                   (kl.py)
agg_loss              per-token loss [N, L] -> scalar                    (aggregation.py)
global_normalisers    a step's mask [N, L] -> the denominators that make micro-batch losses sum
                      exactly to the step's loss                         (aggregation.py)
"""

from rlhf_core.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_OPTIONS,
    GROUP_ESTIMATORS,
    advantages_from_config,
    compute_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_rloo_advantages,
    masked_whiten,
)
from rlhf_core.algorithms.aggregation import AGG_MODES, agg_loss, global_normalisers, masked_mean
from rlhf_core.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rlhf_core.algorithms.policy_loss import (
    IMPORTANCE_LEVELS,
    M2PO_MASKINGS,
    POLICY_LOSSES,
    STEP_MASK_LOSSES,
    clipped_surrogate,
    compute_grpo_loss,
    compute_m2po_loss,
    compute_policy_loss,
    compute_ppo_loss,
    importance_ratio,
    m2po_keep_mask,
    m2po_trust_region_mask,
    step_keep_mask,
)
from rlhf_core.algorithms.value_loss import explained_variance, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_OPTIONS",
    "advantages_from_config",
    "compute_advantages",
    "compute_gae_advantages",
    "GROUP_ESTIMATORS",
    "masked_whiten",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "AGG_MODES",
    "agg_loss",
    "global_normalisers",
    "masked_mean",
    "KL_ESTIMATORS",
    "kl_penalty",
    "IMPORTANCE_LEVELS",
    "M2PO_MASKINGS",
    "POLICY_LOSSES",
    "STEP_MASK_LOSSES",
    "clipped_surrogate",
    "compute_grpo_loss",
    "compute_m2po_loss",
    "compute_policy_loss",
    "compute_ppo_loss",
    "importance_ratio",
    "m2po_keep_mask",
    "m2po_trust_region_mask",
    "step_keep_mask",
    "explained_variance",
    "value_loss",
]
