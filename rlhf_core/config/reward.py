"""The reward section: built-in components, Python reward functions, a learned reward model, overlong shaping."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveFloat, model_validator

from rlhf_core.config.base import Count, NonEmptyStr, _Section, section
from rlhf_core.usercode import check_source, is_file_path

REWARD_COMPONENT_NAMES: tuple[str, ...] = ("exact_match", "contains", "answer_after_marker", "format", "length_penalty")
"""The built-in reward components, named here so that validating a config does not import torch (they are
the keys of rlhf_core.reward.REWARD_COMPONENTS; tests/test_config.py checks the two agree)."""


class RewardFunctionConfig(_Section):
    """A Python reward function (TRL's or verl's signature), run in the rollout worker's process pool."""

    path: str = Field(
        "",
        description="A .py file (relative to the working directory) or an importable module; empty for a built-in (math_verify).",
    )
    name: NonEmptyStr = Field(
        ..., description="The function's name in that file or module (verl's is usually compute_score)."
    )
    weight: float = Field(1.0, description="Weight of the function's score in the total reward.")
    label: str = Field("", description="Metric name: logged as reward/<label>; empty uses `name`.")
    metrics: list[str] = Field(
        default_factory=list,
        description="Keys of a verl function's returned dict (besides 'score') to log as reward/<label>/<key> means.",
    )

    @property
    def metric_name(self) -> str:
        return self.label or self.name


class RewardModelConfig(_Section):
    """A learned reward model: a local sequence-classification model giving one score per sequence. Code shipped
    inside its directory runs only with model.trust_remote_code (the one switch for the run's model directories)."""

    path: str = Field(
        "",
        description="Local Hugging Face AutoModelForSequenceClassification directory (num_labels=1); empty = no "
        "reward model.",
    )
    weight: float = Field(1.0, description="Weight of the reward model's score in the total reward.")
    batch_size: Count = Field(64, description="Sequences per reward-model forward pass.")
    max_length: int = Field(
        1024,
        ge=2,
        description="Longest scored sequence in RM tokens (capped at the RM's context); longer ones keep their "
        "last max_length tokens.",
    )
    normalize: Literal["none", "running"] = Field(
        "none",
        description="'running': scores are standardised by the running mean and std of all scores so far; "
        "'none': raw scores.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Reward model parameter dtype; 'auto' takes the checkpoint's."
    )
    device: str = Field(
        "auto", description="'auto' (CUDA when its process has one, else CPU), 'cpu', 'cuda' or 'cuda:N'."
    )


class OverlongConfig(_Section):
    """DAPO's soft overlong punishment: no penalty up to max_new_tokens - buffer_len generated tokens, then
    linear down to -penalty at max_new_tokens (logged as reward/overlong)."""

    buffer_len: Count = Field(..., description="Tokens before rollout.max_new_tokens where the penalty starts.")
    penalty: PositiveFloat = Field(1.0, description="The penalty at rollout.max_new_tokens (the reward gets -penalty).")


class RewardConfig(_Section):
    """Reward: a weighted sum of tensor-native components (token space) and Python reward functions."""

    components: dict[str, float] = Field(
        default_factory=lambda: {"exact_match": 1.0},
        description="Reward components by name (rlhf_core.reward.REWARD_COMPONENTS) and their weights.",
    )
    marker: str = Field(
        "####", description="Text whose LAST occurrence precedes the answer, for the 'answer_after_marker' component."
    )
    continuation_chars: str = Field(
        "0123456789.,",
        description="Characters that may not directly follow the answer in 'answer_after_marker' ('42' must not match '421').",
    )
    format_sequences: list[str] = Field(
        default_factory=list, description="Texts that must appear in order in the response, for the 'format' component."
    )
    length_target: NonNegativeInt = Field(
        0,
        description="Responses longer than this many tokens are penalised by the 'length_penalty' component (0 = max_new_tokens).",
    )
    match: Literal["text", "tokens"] = Field(
        "text",
        description="How exact_match, contains, answer_after_marker and format compare: 'text' = as text on the "
        "device, any tokenization, numbers normalised (docs/rewards.md); 'tokens' = the answers' token sequences "
        "(special-token answers, one known tokenization: docs/rewards.md).",
    )
    model: RewardModelConfig = section(
        RewardModelConfig, "A learned reward model scored beside the components (logged as reward/reward_model)."
    )

    overlong: Optional[OverlongConfig] = Field(
        None,
        description="DAPO overlong shaping {buffer_len, penalty}, added to the reward (reward/overlong); null = off.",
    )

    functions: list[RewardFunctionConfig] = Field(
        default_factory=list,
        description="Python reward functions [{path, name, weight}], TRL or verl signature, added to the total by weight (docs/rewards.md).",
    )
    function_timeout_s: PositiveFloat = Field(
        30.0, description="Longest one call of a Python reward function may run; past it the call fails."
    )
    function_workers: Count = Field(2, description="Processes per rollout worker that run the Python reward functions.")

    @model_validator(mode="after")
    def _known_components(self) -> RewardConfig:
        unknown = sorted(set(self.components) - set(REWARD_COMPONENT_NAMES))
        if unknown:
            raise ValueError(f"unknown reward component(s) {unknown}; known: {sorted(REWARD_COMPONENT_NAMES)}")
        return self

    @model_validator(mode="after")
    def _functions_exist(self) -> RewardConfig:
        """Each function's file or module exists, defines the function, with TRL's or verl's signature (read
        from the source: nothing is imported or run here), and its metric names are free."""
        seen = set(self.components)
        for i, fn in enumerate(self.functions):
            where = f"reward.functions[{i}]"
            kind = check_source(fn.path, fn.name, where)
            label = fn.metric_name
            if label in seen or "/" in label:
                raise ValueError(
                    f"{where}: metric name {label!r} is already a reward component or function, or has a '/'; "
                    f"give this function a unique `label`"
                )
            seen.add(label)
            if fn.metrics and kind != "verl":
                raise ValueError(
                    f"{where}: metrics {fn.metrics} are the keys of a verl function's dict; {fn.name} is TRL-style"
                )
            if "failed" in fn.metrics or len(set(fn.metrics)) < len(fn.metrics):
                raise ValueError(
                    f"{where}: metrics must be distinct and not 'failed' (reward/<label>/failed is logged always)"
                )
            if is_file_path(fn.path):  # absolute: Ray workers need not share the working directory
                fn.path = str(Path(fn.path).resolve())
            if not fn.path and fn.name == "math_verify":
                if importlib.util.find_spec("math_verify") is None:
                    raise ValueError(
                        f'{where}: the built-in math_verify needs the math-verify package: pip install -e ".[math]"'
                    )
        return self

    def column_names(self) -> list[str]:
        """The per-row reward columns a rollout batch carries (`RolloutBatch.reward_components`), logged as
        reward/<column>: the components, then per function its score, <label>/failed (1 where the call
        failed) and <label>/<key> for each declared verl metric; then reward_model when reward.model.path is
        set; then overlong when reward.overlong is set."""
        return (
            list(self.components)
            + self.function_column_names()
            + (["reward_model"] if self.model.path else [])
            + (["overlong"] if self.overlong is not None else [])
        )

    def function_column_names(self) -> list[str]:
        """The Python reward functions' columns, in order: per function its score, <label>/failed and
        <label>/<key> for each declared verl metric."""
        names = []
        for fn in self.functions:
            names += [fn.metric_name, f"{fn.metric_name}/failed", *(f"{fn.metric_name}/{k}" for k in fn.metrics)]
        return names
