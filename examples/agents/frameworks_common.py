"""What the framework examples share: the reveal task of reveal_agent.py (the question, the hidden digits, the
tool's answer) and its score. Each example (agents_sdk_agent.py, smolagents_agent.py, langchain_agent.py,
litellm_agent.py, dspy_agent.py) is the framework's own way to write that agent, with its defaults; the only
glue is handing the framework the endpoint's base URL and key (`endpoint`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reveal_agent import ANSWER, QUESTION, TOOLS, hidden_digits, reveal  # noqa: E402

__all__ = ["ANSWER", "QUESTION", "TOOLS", "endpoint", "hidden_digits", "reveal", "score"]


def endpoint(client) -> tuple[str, str]:
    """(base_url, api_key) of the `openai.AsyncOpenAI` client the run hands an agent: what a framework that makes
    its own client needs."""
    return str(client.base_url).rstrip("/"), client.api_key


def score(answer, digits: list[int], tool_calls: int) -> dict:
    """Reward 1.0 when the final answer's last '#### n' is the largest digit."""
    found = ANSWER.findall(str(answer or ""))
    correct = bool(found) and int(found[-1]) == max(digits)
    return {"reward": float(correct), "metrics": {"success": float(correct), "tool_calls": float(tool_calls)}}
