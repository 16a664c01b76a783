"""The base of every config section: ConfigError, the section base class, the limits that need no model, and the
constrained types the sections' fields share (with pydantic's PositiveFloat, NonNegativeInt, NonNegativeFloat)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

RUN_CONFIG_FILE = "train_config.yaml"  # the run's config, inside every checkpoint and exported policy


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


MAX_LR = 1.0
"""Largest trainer.lr accepted: above it AdamW diverges at once (1e38 overflows to inf in its update)."""

MAX_CONSECUTIVE_FAILURES = 20
"""Default of supervision.max_consecutive_failures, and of the runners of user code built without a config."""
PRIORITY_FLOOR = 0.1
"""Default of data.priority_floor, and of the prompt sources and queues built without a config."""
MAX_SEQUENCE_TOKENS = 131072
"""Largest rollout.max_new_tokens (and data.max_prompt_tokens) accepted before any model is loaded: the
longest context of current open models. The model's own limit is checked at launch
(rlhf_core.run.preflight.check_lengths)."""


Count = Annotated[int, Field(ge=1)]
"""At least 1: a number of things, a size, a cadence in steps."""
NonEmptyStr = Annotated[str, Field(min_length=1)]
PositiveFraction = Annotated[float, Field(gt=0, le=1)]
"""A share in (0, 1]."""


def section(cls: type[BaseModel], description: str) -> Any:
    """The field of a nested section `cls`: a key left out of the config is the section's defaults."""
    return Field(default_factory=cls, description=description)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
