"""The agent section (docs/agents.md): an agent written against the OpenAI client, run once per episode on the
policy's OpenAI-compatible endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import Field, PositiveFloat, model_validator

from rlhf_core.config.base import Count, _Section
from rlhf_core.usercode import check_tool_source, is_file_path

AGENT_COLUMNS = ("agent", "agent/requests_mean", "agent/prefix_breaks", "agent/latency_s")


class AgentConfig(_Section):
    """An agent written against the OpenAI client (docs/agents.md): `async def run(client, row, **kwargs)`,
    called once per episode with an `openai.AsyncOpenAI` on the policy's endpoint; empty name = no agent."""

    path: str = Field("", description="A .py file (relative to the working directory) or an importable module.")
    name: str = Field("", description="The agent's async function there; empty = no agent.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to it every call.")
    timeout_s: PositiveFloat = Field(
        120.0, description="Longest one episode may run; past it the episode fails (agent/timeouts)."
    )
    max_requests: Count = Field(32, description="Most requests one episode may make; later ones get a 400.")
    error_reward: Optional[float] = Field(
        None,
        description="The reward of an episode whose agent raised (e.g. a framework's parse error on malformed model "
        "output): the episode trains on what it generated with this reward (agent/errors_rewarded), so the policy "
        "learns to avoid the output. None: the episode fails, its group is left out (agent/errors). A timeout "
        "fails the episode either way.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def column_names(self) -> list[str]:
        """The per-row columns an agent batch carries after the reward's and the environment's: agent (the
        episode's reward, logged as reward/agent), agent/requests_mean, agent/prefix_breaks, agent/latency_s."""
        return list(AGENT_COLUMNS) if self.enabled else []

    @model_validator(mode="after")
    def _agent_exists(self) -> AgentConfig:
        if self.enabled:
            if not self.path:
                raise ValueError("agent.path is empty: give the .py file or module that defines agent.name")
            check_tool_source(self.path, self.name, "agent")
            resolved = str(Path(self.path).resolve()) if is_file_path(self.path) else self.path
            if resolved != self.path:  # absolute: Ray workers need not share the working directory
                self.path = resolved
        return self
