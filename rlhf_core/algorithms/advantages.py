"""Advantage estimators: pure functions on reward tensors.

Rewards arrive grouped: `rewards` has shape [..., G], the last dim holding the G completions of one
prompt. Every estimator returns a tensor of the same shape.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def compute_grpo_advantages(rewards: torch.Tensor, eps: float = 1e-8, scale: str = "group") -> torch.Tensor:
    """Group-relative advantages (GRPO, arXiv 2402.03300).

    rewards: FloatTensor [..., G]. Returns FloatTensor [..., G].
    scale "group": (R - mu_g) / (sigma_g + eps), sigma_g the population std (1/G) of the group;
          "batch": (R - mu_g) / (sigma_all + eps), sigma_all the population std of all rewards;
          "none":  R - mu_g (Dr.GRPO, arXiv 2503.20783).
    A group whose rewards are all equal gets advantages of exactly 0 (never NaN).
    """
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    # The float mean of equal values need not equal them exactly; force constant groups to exactly 0.
    constant = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    centered = centered.masked_fill(constant, 0.0)
    if scale == "none":
        return centered
    if scale == "group":
        std = rewards.std(dim=-1, unbiased=False, keepdim=True) if rewards.shape[-1] > 1 else torch.zeros_like(centered)
    elif scale == "batch":
        std = rewards.std(unbiased=False) if rewards.numel() > 1 else rewards.new_zeros(())
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; expected 'group', 'batch' or 'none'")
    return centered / (std + eps)


def compute_rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: R_i minus the mean of the other G-1 rewards of its group; 0 when G = 1.

    rewards: FloatTensor [..., G]. Returns FloatTensor [..., G].
    """
    rewards = rewards.float()
    G = rewards.shape[-1]
    if G == 1:
        return torch.zeros_like(rewards)
    total = rewards.sum(dim=-1, keepdim=True)
    return rewards - (total - rewards) / (G - 1)


ADVANTAGE_ESTIMATORS = {
    "grpo": compute_grpo_advantages,
    "rloo": compute_rloo_advantages,
}

# The options each estimator takes (compute_advantages refuses any other), and the AlgorithmConfig field
# that sets each. RLOO has none: its baseline is the leave-one-out mean and it is never scaled.
ADVANTAGE_OPTIONS: dict[str, dict[str, str]] = {
    "grpo": {"eps": "adv_eps", "scale": "adv_scale"},
    "rloo": {},
}


def compute_advantages(
    name: str, rewards: torch.Tensor, eps: Optional[float] = None, scale: Optional[str] = None
) -> torch.Tensor:
    """Advantages by estimator name (config `algorithm.advantage`). rewards: [..., G] -> [..., G].

    eps, scale: options of the estimator (None: its default). Passing one the estimator does not take
    (any of them to "rloo") is a ValueError, not silently ignored.
    """
    try:
        fn = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    options = {k: v for k, v in (("eps", eps), ("scale", scale)) if v is not None}
    unused = sorted(set(options) - set(ADVANTAGE_OPTIONS.get(name, {})))
    if unused:
        raise ValueError(f"advantage estimator {name!r} takes no option {unused[0]!r}")
    return fn(rewards, **options)


def advantages_from_config(algo_cfg: Any, rewards: torch.Tensor) -> torch.Tensor:
    """The advantages of `algo_cfg.advantage` (an AlgorithmConfig) with the options that estimator takes.

    rewards: FloatTensor [..., G]. Returns FloatTensor [..., G]. The config refuses adv_scale/adv_eps set
    for an estimator that has no use for them, so leaving them out here hides nothing.
    """
    fields = ADVANTAGE_OPTIONS.get(algo_cfg.advantage, {})
    return compute_advantages(
        algo_cfg.advantage, rewards, **{option: getattr(algo_cfg, field) for option, field in fields.items()}
    )
