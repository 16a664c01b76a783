"""Advantage estimators: pure functions on reward tensors.

Group estimators (GRPO, RLOO): rewards arrive grouped, shape [..., G], the last dim holding the G
completions of one prompt; they return a tensor of the same shape.
GAE (`compute_gae_advantages`): per-token rewards and a critic's values [N, T] -> per-token advantages and
returns [N, T]. It needs values, so `compute_advantages` (rewards only) refuses it; the trainer calls it
with the critic's values.
By name: each is registered (`rlhf_core.algorithms.builtin`) with its options class and called through the
one signature fn(inputs: AdvantageInputs, options).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from rlhf_core.algorithms.options import GRPO_STD_EPS, GRPO_STD_UNBIASED
from rlhf_core.algorithms.registry import ADVANTAGE_REGISTRY, advantage_spec


def compute_grpo_advantages(
    rewards: torch.Tensor, eps: float = GRPO_STD_EPS, scale: str = "group", unbiased: bool = GRPO_STD_UNBIASED
) -> torch.Tensor:
    """Group-relative advantages (GRPO, arXiv 2402.03300).

    rewards: FloatTensor [..., G]. Returns FloatTensor [..., G].
    scale "group": (R - mu_g) / (sigma_g + eps), sigma_g the std of the group;
          "batch": (R - mu_g) / (sigma_all + eps), sigma_all the std of all rewards;
          "none":  R - mu_g (Dr.GRPO, arXiv 2503.20783).
    unbiased: the sample std (/ (G - 1), Bessel's correction: TRL's GRPOTrainer and verl) when true, the
    population std (/ G) when false. The defaults (sample std, eps 1e-4) are the `grpo` options' (options.py).
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
        one = rewards.shape[-1] == 1
        std = torch.zeros_like(centered) if one else rewards.std(dim=-1, unbiased=unbiased, keepdim=True)
    elif scale == "batch":
        std = rewards.std(unbiased=unbiased) if rewards.numel() > 1 else rewards.new_zeros(())
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


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid positions of `mask` (var unbiased, as verl's masked_whiten);
    0 at masked positions. x, mask: [N, T]. Fewer than 2 valid positions: centred only (var taken as 0)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    centered = (x - mean) * m
    var = centered.square().sum() / (n - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)


def compute_gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens, verl's
    compute_gae_advantage_return semantics.

    token_rewards: FloatTensor [N, T], the reward of each response token (a sequence reward sits on its
                   last response token; a per-token KL penalty, when used, on every token).
    values:        FloatTensor [N, T], the critic's value of the state before each response token.
    response_mask: Bool/FloatTensor [N, T], the valid response tokens.
    Returns (advantages [N, T], returns [N, T]), both 0 at masked positions.

    Masked positions carry no value: going backwards, a masked position passes on the next valid token's
    value and running advantage unchanged, so padding (or a masked gap) between tokens is skipped and the
    value after a sequence's last valid token is 0 (the episode ends there). For a valid token t with next
    valid token t': delta_t = r_t + gamma V_t' - V_t, A_t = delta_t + gamma lam A_t'; returns = A + V (before
    whitening). whiten: advantages (x - mean) / sqrt(var + 1e-8) over the batch's valid tokens.
    One reverse pass over T, batched over N.
    """
    if token_rewards.shape != values.shape or values.shape != response_mask.shape or values.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must all be [N, T]"
        )
    mask = response_mask.float()
    rewards = token_rewards.float() * mask
    values = values.float() * mask
    N, T = values.shape
    next_value = values.new_zeros(N)
    running = values.new_zeros(N)
    advantages = torch.zeros_like(values)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        running = candidate * m + running * (1.0 - m)
        next_value = values[:, t] * m + next_value * (1.0 - m)
        advantages[:, t] = running * m
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """What a registered advantage estimator gets besides its options: fn(inputs: AdvantageInputs, options).

    rewards:       FloatTensor [N], one reward per sequence; the G = group_size completions of a prompt are
                   contiguous rows (`grouped()` gives them as [N/G, G]).
    mask:          Bool/FloatTensor [N, T], the response tokens trained on (None when not known).
    values:        FloatTensor [N, T], a critic's values (estimators registered with critic=True; else None).
    token_rewards: FloatTensor [N, T], per-token rewards (critic=True): the sequence reward on its last
                   response token, minus the per-token KL penalty with algorithm.kl_in_reward.
    """

    rewards: torch.Tensor
    group_size: int
    mask: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None

    def grouped(self) -> torch.Tensor:
        """rewards as [N/G, G], one row per prompt."""
        if self.rewards.numel() % self.group_size:
            raise ValueError(f"{self.rewards.numel()} rewards are not made of whole groups of {self.group_size}")
        return self.rewards.reshape(-1, self.group_size)


ADVANTAGE_ESTIMATORS = ADVANTAGE_REGISTRY.view(lambda spec: spec.fn)
"""Read-only view of the registry: every estimator name -> its registered fn(inputs, options)."""
GROUP_ESTIMATORS = ADVANTAGE_REGISTRY.names_where(lambda spec: spec.grouped)
"""Read-only view: the estimators that compare the completions of one prompt (rewards only, no critic)."""
ADVANTAGE_OPTIONS = ADVANTAGE_REGISTRY.view(
    lambda spec: {name: f"advantage_options.{name}" for name in spec.options.model_fields}
)
"""Read-only view: every estimator -> {option: the AlgorithmConfig field that sets it}."""


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    eps: Optional[float] = None,
    scale: Optional[str] = None,
    unbiased: Optional[bool] = None,
) -> torch.Tensor:
    """Advantages by estimator name (config `algorithm.advantage`). rewards: [..., G] -> [..., G].

    eps, scale, unbiased: options of the estimator (None: the default of its options class). Passing one the
    estimator does not take (any of them to "rloo") is a ValueError, not silently ignored.
    """
    spec = advantage_spec(name)
    if spec.critic:
        raise ValueError(
            f"advantage estimator {name!r} needs a critic's values and per-token rewards, not group rewards: "
            "call compute_gae_advantages(token_rewards, values, response_mask, gamma, lam)"
        )
    given = (("eps", eps), ("scale", scale), ("unbiased", unbiased))
    options = {k: v for k, v in given if v is not None}
    unused = sorted(set(options) - set(spec.options.model_fields))
    if unused:
        raise ValueError(f"advantage estimator {name!r} takes no option {unused[0]!r}")
    inputs = AdvantageInputs(rewards.reshape(-1), rewards.shape[-1])
    return spec.fn(inputs, spec.options(**options)).reshape(rewards.shape)


def advantages_from_config(algo_cfg: Any, rewards: torch.Tensor) -> torch.Tensor:
    """The advantages of `algo_cfg.advantage` (an AlgorithmConfig) with `algo_cfg.advantage_options`.

    rewards: FloatTensor [..., G]. Returns FloatTensor [..., G] (one advantage per sequence; an estimator that
    needs a critic is refused: the trainer calls it with the critic's values).
    """
    spec = advantage_spec(algo_cfg.advantage)
    if spec.critic:
        return compute_advantages(algo_cfg.advantage, rewards)  # the error naming the critic
    inputs = AdvantageInputs(rewards.reshape(-1), rewards.shape[-1])
    return spec.fn(inputs, algo_cfg.advantage_options).reshape(rewards.shape)
