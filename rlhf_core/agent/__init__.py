"""Agents as black boxes (docs/agents.md): an OpenAI-compatible endpoint over the policy that records what the
policy generated, token-in/token-out, and the runner that calls the user's agent once per episode.

    async def run(client: openai.AsyncOpenAI, row: dict, **kwargs) -> float | dict | None: ...

Modules:
  api.py        the OpenAI wire format: request bodies, messages for the chat template, tool calls, errors
  server.py     AgentServer: the HTTP endpoint on loopback (per-run key), batching requests into the engine
  segments.py   what an episode's requests become: segments joined by token ids, one RolloutBatch
  runner.py     AgentRunner: episodes (timeouts, failures), the rollout worker's and the evaluator's hook

This package's __init__ imports nothing; the names below load their module on first use.
"""

from __future__ import annotations

from rlhf_core.lazy import lazy_exports

_LAZY = {
    "AgentError": "rlhf_core.agent.runner",
    "AgentRunner": "rlhf_core.agent.runner",
    "AgentServer": "rlhf_core.agent.server",
    "EpisodeLog": "rlhf_core.agent.segments",
}

__all__, __getattr__, __dir__ = lazy_exports(globals(), _LAZY)
