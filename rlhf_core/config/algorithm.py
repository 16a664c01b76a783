"""The algorithm section: the policy loss and the advantage estimator, by registered name, with their options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeFloat, ValidationInfo, field_validator, model_validator

from rlhf_core.algorithms.options import RolloutCorrection, move_flat_keys
from rlhf_core.algorithms.registry import (
    REGISTRIES,
    AdvantageSpec,
    AlgorithmOptions,
    OptionsField,
    PolicyLossSpec,
    options_for,
)
from rlhf_core.config.base import Count, _Section, section


class AlgorithmConfig(_Section):
    """Policy loss and advantage estimator, each by registered name with its own options (rlhf_core.algorithms:
    register_policy_loss, register_advantage; the options classes of the built-ins in algorithms/options.py)."""

    loss: str = Field(
        "grpo",
        description="Policy loss by registered name: built in 'ppo' ('grpo' is the same loss) and 'm2po'; others "
        "registered with rlhf_core.algorithms.register_policy_loss, or '<file.py or module>:<name>' (the file is "
        "imported in every process that builds a trainer, where its decorator registers the name).",
    )
    loss_options: OptionsField = Field(
        default_factory=dict,
        validate_default=True,
        description="The options of algorithm.loss, validated against its options class: ppo/grpo clip_eps "
        "(0.2), clip_eps_high, dual_clip; m2po those and m2_threshold, masking, ratio_sq_threshold.",
    )
    advantage: str = Field(
        "grpo",
        description="Advantage estimator by registered name: built in 'grpo', 'rloo' and 'gae' (a learned critic, "
        "configured under critic:); others registered with rlhf_core.algorithms.register_advantage, or "
        "'<file.py or module>:<name>' as algorithm.loss.",
    )
    advantage_options: OptionsField = Field(
        default_factory=dict,
        validate_default=True,
        description="The options of algorithm.advantage, validated against its options class: grpo scale "
        "(group|batch|none), eps (1e-4), unbiased (the sample std, as TRL; false: the population std); rloo none; gae "
        "gamma, lam, whiten.",
    )
    kl_in_reward: bool = Field(
        False,
        description="Apply kl_coef x KL(behaviour || reference) as a per-token reward penalty (the classic PPO "
        "recipe; advantage 'gae') instead of as a KL loss term.",
    )
    filter_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: groups whose rewards are all equal are not trained on; the step is "
        "filled from further groups (logged as buffer/filtered_groups_frac).",
    )
    filter_max_rounds: Count = Field(
        10,
        description="filter_groups: once this many steps' worth of groups (x trainer.prompts_per_step) arrived "
        "since the last step and fewer than a step passed, the step trains on the groups it has (the newest "
        "filtered ones when none passed) instead of waiting; every host alike.",
    )
    mask_truncated: bool = Field(
        False,
        description="Samples cut at rollout.max_new_tokens (no stop id) contribute no tokens to the loss.",
    )
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean",
        description="How per-token losses are aggregated into a scalar ('seq-mean-token-sum-norm' divides by rows x rollout.max_new_tokens).",
    )
    importance_level: Literal["token", "sequence"] = Field(
        "token", description="Per-token ratios (PPO) or one geometric-mean ratio per sequence (GSPO)."
    )
    rollout_correction: RolloutCorrection = section(
        RolloutCorrection,
        "Off-policy correction between the rollout engine and the trainer: {mode: none|tis|mis|icepop, "
        "level: token|sequence, lower, upper} (rlhf_core.algorithms.correction). Turn it on when the engine's "
        "log-probs differ from the trainer's (bf16/vLLM engines: see mismatch/engine_kl).",
    )
    kl_coef: NonNegativeFloat = Field(
        0.0, description="Weight of the KL penalty to the frozen reference policy; 0 loads no reference model."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator used for the penalty.")

    @model_validator(mode="before")
    @classmethod
    def _flat_option_keys(cls, data: Any) -> Any:
        # an option written under its old flat key (algorithm.clip_eps) moves to its home, with a note
        return move_flat_keys(data, {kind: cls.model_fields[kind].default for kind in ("loss", "advantage")})

    @field_validator("loss", "advantage")
    @classmethod
    def _registered(cls, name: str, info: ValidationInfo) -> str:
        REGISTRIES[info.field_name].get(name)  # the ValueError names the registered ones
        return name

    @field_validator("loss_options", "advantage_options", mode="before")
    @classmethod
    def _options(cls, value: Any, info: ValidationInfo) -> AlgorithmOptions:
        kind = info.field_name.removesuffix("_options")
        if kind not in info.data:  # the name was refused, and its error says why
            return AlgorithmOptions()
        return options_for(kind, info.data[kind], value, getattr(value, "flat", None))

    @model_validator(mode="after")
    def _algorithm_rules(self) -> AlgorithmConfig:
        for kind in ("loss", "advantage"):  # after an assignment of the name alone, its options follow
            options = getattr(self, f"{kind}_options")
            if type(options) is not REGISTRIES[kind].get(getattr(self, kind)).options:
                self.__dict__[f"{kind}_options"] = options_for(kind, getattr(self, kind), options)
        if self.kl_in_reward and not self.advantage_spec.critic:
            raise ValueError(
                "algorithm.kl_in_reward needs algorithm.advantage 'gae' (or another estimator with a critic: a "
                "per-token reward penalty needs per-token advantages); with group advantages use the KL loss "
                "(algorithm.kl_coef alone)"
            )
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("algorithm.kl_in_reward needs algorithm.kl_coef > 0 (the penalty's weight)")
        return self

    @property
    def loss_spec(self) -> PolicyLossSpec:
        """The registered loss (its function, options class and step mask)."""
        return REGISTRIES["loss"].get(self.loss)  # type: ignore[return-value]

    @property
    def advantage_spec(self) -> AdvantageSpec:
        """The registered advantage estimator (its function, options class, grouped, critic)."""
        return REGISTRIES["advantage"].get(self.advantage)  # type: ignore[return-value]
