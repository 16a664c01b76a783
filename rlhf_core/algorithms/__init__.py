"""Algorithms: pure functions on tensors, selected by name from registries.

register_policy_loss  decorator: fn(inputs: LossInputs, options) -> (loss, stats) becomes `algorithm.loss: <name>`,
                      its options class validated from `algorithm.loss_options`        (registry.py)
register_advantage    decorator: fn(inputs: AdvantageInputs, options) -> advantages becomes `algorithm.advantage:
                      <name>`, its options from `algorithm.advantage_options`          (registry.py)
built-ins             losses ppo (alias grpo), m2po; estimators grpo, rloo, gae, with the options classes of
                      options.py                                                         (builtin.py)
compute_policy_loss   the configured loss on a (micro-)batch; step_keep_mask: a loss's step-wide mask (dispatch.py)
compute_*_loss        the losses' tensor implementations                                (policy_loss.py)
compute_*_advantages  rewards [..., G] -> advantages [..., G]; "gae": compute_gae_advantages(token_rewards,
                      values, mask, gamma, lam) [N, T] -> (adv, returns)               (advantages.py)
value_loss            clipped value loss of a critic                                    (value.py)
kl_penalty            per-token KL estimators k1/k2/k3                                  (kl.py)
agg_loss              per-token loss [N, L] -> scalar                                   (aggregation.py)
global_normalisers    a step's mask [N, L] -> the denominators that make micro-batch losses sum
                      exactly to the step's loss                                        (aggregation.py)
POLICY_LOSSES, STEP_MASK_LOSSES, ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, ADVANTAGE_OPTIONS: read-only views of
the registries.

Importing this package does not import torch (the config imports the registry and the options classes to
validate `algorithm:`): the registry, the options and the built-ins' registrations are imported here; the
tensor functions are imported on first access (`from rlhf_core.algorithms import compute_ppo_loss` works as
ever).
"""

from __future__ import annotations

from rlhf_core.algorithms import builtin as _builtin  # noqa: F401  (registers the built-ins)
from rlhf_core.algorithms.options import (
    IMPORTANCE_LEVELS,
    M2PO_MASKINGS,
    GAEOptions,
    GRPOAdvantageOptions,
    M2POOptions,
    PPOOptions,
)
from rlhf_core.algorithms.registry import (
    AdvantageSpec,
    AlgorithmOptions,
    PolicyLossSpec,
    advantage_spec,
    policy_loss_spec,
    register_advantage,
    register_policy_loss,
)
from rlhf_core.lazy import lazy_exports

_LAZY = {  # torch modules: name -> the module that holds it, imported on first access
    "rlhf_core.algorithms.advantages": (
        "ADVANTAGE_ESTIMATORS",
        "ADVANTAGE_OPTIONS",
        "GROUP_ESTIMATORS",
        "AdvantageInputs",
        "advantages_from_config",
        "compute_advantages",
        "compute_gae_advantages",
        "compute_grpo_advantages",
        "compute_rloo_advantages",
        "masked_whiten",
    ),
    "rlhf_core.algorithms.aggregation": ("AGG_MODES", "agg_loss", "global_normalisers", "masked_mean"),
    "rlhf_core.algorithms.kl": ("KL_ESTIMATORS", "kl_penalty"),
    "rlhf_core.algorithms.dispatch": (
        "POLICY_LOSSES",
        "STEP_MASK_LOSSES",
        "LossInputs",
        "compute_policy_loss",
        "step_keep_mask",
    ),
    "rlhf_core.algorithms.policy_loss": (
        "compute_grpo_loss",
        "compute_m2po_loss",
        "compute_ppo_loss",
        "m2po_keep_mask",
    ),
    "rlhf_core.algorithms.surrogate": ("clipped_surrogate", "importance_ratio", "m2po_trust_region_mask"),
    "rlhf_core.algorithms.value": (
        "explained_variance",
        "value_loss",
    ),  # not value_loss.py: the submodule would shadow the function
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}
__getattr__, __dir__ = lazy_exports(globals(), _WHERE)[1:]  # __all__ is written below


__all__ = [
    "AlgorithmOptions",
    "PolicyLossSpec",
    "AdvantageSpec",
    "register_policy_loss",
    "register_advantage",
    "policy_loss_spec",
    "advantage_spec",
    "PPOOptions",
    "M2POOptions",
    "GRPOAdvantageOptions",
    "GAEOptions",
    "IMPORTANCE_LEVELS",
    "M2PO_MASKINGS",
    *_WHERE,
]
