"""The environment section: a multi-turn environment class (or ToolEnv tools) and its limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, PositiveFloat, model_validator

from rlhf_core.config.base import Count, NonEmptyStr, _Section
from rlhf_core.usercode import is_file_path

ENV_COLUMNS = ("env", "env/turns_mean", "env/tool_calls_mean", "env/truncated_frac")


class EnvToolConfig(_Section):
    """A Python function offered to the model as a tool by the built-in ToolEnv."""

    path: NonEmptyStr = Field(
        ..., description="A .py file (relative to the working directory) or an importable module."
    )
    name: NonEmptyStr = Field(..., description="The function's name there (also the tool's name).")


class EnvConfig(_Section):
    """A multi-turn environment (docs/environments.md): a class with reset(row) and step(action), one instance
    per trajectory, run in the rollout worker's process pool; empty name = single-turn prompts as before."""

    path: str = Field(
        "",
        description="A .py file (relative to the working directory) or an importable module holding the class (with "
        "env.adapter: the factory); empty for the built-in ToolEnv.",
    )
    name: str = Field(
        "",
        description="The environment class's name there; empty = no environment (ToolEnv when env.tools is set). "
        "With env.adapter: the callable that makes the environment or client from env.kwargs, once per episode "
        "(e.g. path 'gem', name 'make', kwargs {env_id: game:GuessTheNumber-v0-easy}).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the class's __init__ (with env.adapter: of the factory, e.g. base_url).",
    )
    adapter: Literal["", "gym", "openenv", "textarena"] = Field(
        "",
        description="Run an environment you already have: 'gym' (gymnasium-style reset(seed=...) and five-value "
        "step, text observations, e.g. gem-llm games), 'textarena' (a TextArena game, single- or multi-player: "
        "env.kwargs num_players, player, opponent) or 'openenv' (an OpenEnv EnvClient); made by the callable "
        "env.path:env.name with env.kwargs. Empty: env.name is the environment class.",
    )
    action_field: str = Field(
        "",
        description="env.adapter openenv: the Action field that gets the model's text; empty = the Action class's "
        "one string field.",
    )
    observation_field: str = Field(
        "",
        description="With env.adapter: the observation field that holds its text when it is not a string; empty = "
        "its one string field.",
    )
    max_sessions: Optional[Count] = Field(
        None,
        description="Most episodes open at once per rollout worker (each holds an environment instance, for OpenEnv a "
        "server session, from reset to close); the others wait to start. None: no limit.",
    )
    max_turns: Count = Field(4, description="Most model turns per trajectory; the trajectory ends after it.")
    step_timeout_s: PositiveFloat = Field(
        30.0,
        description="Longest one reset, step, finish or close (and one tool call) may run; past it the trajectory "
        "fails.",
    )
    max_total_tokens: Optional[int] = Field(
        None,
        ge=2,
        description="Most tokens of a trajectory, prompt plus every turn; it ends, truncated, where it would pass "
        "this (None: the model's context). Also an agent's request: its prompt plus its completion.",
    )
    workers: Count = Field(
        2,
        description="Processes per rollout worker that hold the environment instances (and run the tools' calls).",
    )
    max_observation_chars: Count = Field(
        100_000,
        description="Most characters of one observation (or of reset's opening), its messages' contents together; "
        "a larger one fails its trajectory.",
    )
    observation_role: NonEmptyStr = Field(
        "user", description="Chat role of an observation the environment returns as a plain string."
    )
    reward_weight: float = Field(
        1.0, description="Weight of the environment's summed rewards (reward/env) in the trajectory's reward."
    )
    tools: list[EnvToolConfig] = Field(
        default_factory=list,
        description="Python functions [{path, name}] the built-in ToolEnv offers as tools (schemas from signature and docstring).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.class_name)

    def column_names(self) -> list[str]:
        """The per-row columns a trajectory batch carries after the reward's (`RolloutBatch.reward_components`):
        env (the summed environment reward, logged as reward/env), env/turns_mean, env/tool_calls_mean and
        env/truncated_frac (logged under these names, as batch means); none without an environment."""
        return list(ENV_COLUMNS) if self.enabled else []

    @property
    def class_name(self) -> str:
        """The class to load: the adapter's, `name`, or ToolEnv when only tools are given."""
        if self.adapter:
            from rlhf_core.env.adapters import ADAPTERS

            return ADAPTERS[self.adapter]
        return self.name or ("ToolEnv" if self.tools else "")

    @property
    def class_path(self) -> str:
        """Where class_name is loaded from: env.path, or '' (built in) for ToolEnv and the adapters."""
        return "" if self.adapter else self.path

    @property
    def description(self) -> str:
        """The environment as errors name it: 'GuessEnv (envs/guess.py)', 'gem:make (adapter gym)'."""
        if self.adapter:
            return f"{self.factory} (adapter {self.adapter})"
        return f"{self.class_name} ({self.path or 'built-in'})"

    @property
    def factory(self) -> str:
        """With env.adapter, the callable that makes each episode's environment: 'env.path:env.name'."""
        return f"{self.path}:{self.name}" if self.adapter else ""

    def instance_kwargs(self) -> dict[str, Any]:
        """What each instance is made with: env.kwargs; with env.tools, the tools and their timeout; with
        env.adapter, the factory, its kwargs and the text fields."""
        if self.adapter:
            return {
                "factory": self.factory,
                "kwargs": dict(self.kwargs),
                "action_field": self.action_field,
                "observation_field": self.observation_field,
            }
        kwargs = dict(self.kwargs)
        if self.tools:
            kwargs.setdefault("tools", [{"path": t.path, "name": t.name} for t in self.tools])
            kwargs.setdefault("timeout_s", self.step_timeout_s)
        return kwargs

    @model_validator(mode="after")
    def _env_exists(self) -> EnvConfig:
        """The class's file or module exists and defines it, and each tool's function (read from the source:
        nothing is imported or run here)."""
        from rlhf_core.usercode import check_env_source, check_factory_source, check_tool_source

        if self.adapter:
            if not self.path or not self.name:
                raise ValueError(
                    f"env.adapter: {self.adapter} needs env.path (a module or .py file) and env.name (the callable "
                    "there that makes the environment or client), e.g. path 'gem', name 'make' (docs/environments.md)"
                )
            if self.tools:
                raise ValueError("env.adapter runs the factory's environment: leave env.tools empty")
            check_factory_source(self.factory, "env.path/env.name")
            if is_file_path(self.path) and str(Path(self.path).resolve()) != self.path:
                self.path = str(Path(self.path).resolve())
        if self.enabled and not self.adapter:
            check_env_source(self.path, self.class_name, "env")
            resolved = str(Path(self.path).resolve()) if is_file_path(self.path) else self.path
            if resolved != self.path:  # absolute: Ray workers need not share the working directory
                self.path = resolved  # (assignment validates again: only when it changes)
        seen = set()
        for i, tool in enumerate(self.tools):
            where = f"env.tools[{i}]"
            check_tool_source(tool.path, tool.name, where)
            if tool.name in seen:
                raise ValueError(f"{where}: tool name {tool.name!r} is given twice; tool names must be unique")
            seen.add(tool.name)
            if is_file_path(tool.path):
                tool.path = str(Path(tool.path).resolve())
        return self
