"""The built-in algorithms, registered by name like any other (`register_policy_loss`, `register_advantage`).

Each registered function has the one signature of its kind and calls the tensor implementation with its
options. This module does not import torch (the config validates against the registries without it): an
implementation is imported when its function is first called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_core.algorithms.options import GAEOptions, GRPOAdvantageOptions, M2POOptions, PPOOptions
from rlhf_core.algorithms.registry import AlgorithmOptions, register_advantage, register_policy_loss

if TYPE_CHECKING:
    import torch

    from rlhf_core.algorithms.advantages import AdvantageInputs
    from rlhf_core.algorithms.dispatch import LossInputs


@register_policy_loss("ppo", options=PPOOptions, aliases=("grpo",))
def ppo_loss(inputs: LossInputs, options: PPOOptions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate (compute_ppo_loss). 'grpo' names the same loss: compute_grpo_loss is
    compute_ppo_loss with the same arguments, the group advantages being the advantage estimator's business."""
    from rlhf_core.algorithms.policy_loss import compute_ppo_loss

    return compute_ppo_loss(
        *inputs.ratio_tensors(),
        clip_eps=options.clip_eps,
        clip_eps_high=options.clip_eps_high,
        dual_clip=options.dual_clip,
        **inputs.shared(),
    )


def m2po_step_mask(inputs: LossInputs, options: M2POOptions) -> torch.Tensor:
    """M2PO's keep mask over the whole step's batch (m2po_keep_mask): the second moment is the batch's."""
    from rlhf_core.algorithms.policy_loss import m2po_keep_mask

    return m2po_keep_mask(
        *inputs.ratio_tensors(),
        options.m2_threshold,
        options.masking,
        options.ratio_sq_threshold,
        importance_level=inputs.importance_level,
    )


@register_policy_loss("m2po", options=M2POOptions, step_mask=m2po_step_mask)
def m2po_loss(inputs: LossInputs, options: M2POOptions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO against the behaviour policy (compute_m2po_loss), with the step's keep mask when given."""
    from rlhf_core.algorithms.policy_loss import compute_m2po_loss

    return compute_m2po_loss(
        *inputs.ratio_tensors(),
        m2_threshold=options.m2_threshold,
        masking=options.masking,
        clip_eps=options.clip_eps,
        ratio_sq_threshold=options.ratio_sq_threshold,
        clip_eps_high=options.clip_eps_high,
        dual_clip=options.dual_clip,
        keep_mask=inputs.keep_mask,
        kept_norm=inputs.kept_norm,
        **inputs.shared(),
    )


@register_advantage("grpo", options=GRPOAdvantageOptions, grouped=True)
def grpo_advantages(inputs: AdvantageInputs, options: GRPOAdvantageOptions) -> torch.Tensor:
    """Group-relative advantages (compute_grpo_advantages), one per sequence: [N]."""
    from rlhf_core.algorithms.advantages import compute_grpo_advantages

    grouped = inputs.grouped()
    return compute_grpo_advantages(grouped, eps=options.eps, scale=options.scale, unbiased=options.unbiased).reshape(-1)


@register_advantage("rloo", grouped=True)
def rloo_advantages(inputs: AdvantageInputs, options: AlgorithmOptions) -> torch.Tensor:
    """REINFORCE leave-one-out (compute_rloo_advantages), one per sequence: [N]. No options."""
    from rlhf_core.algorithms.advantages import compute_rloo_advantages

    return compute_rloo_advantages(inputs.grouped()).reshape(-1)


@register_advantage("gae", options=GAEOptions, critic=True)
def gae_advantages(inputs: AdvantageInputs, options: GAEOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens with the critic's values (compute_gae_advantages): (advantages, returns) [N, T]."""
    from rlhf_core.algorithms.advantages import compute_gae_advantages

    if inputs.values is None or inputs.token_rewards is None or inputs.mask is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values, per-token rewards and the mask")
    return compute_gae_advantages(
        inputs.token_rewards, inputs.values, inputs.mask, options.gamma, options.lam, whiten=options.whiten
    )
