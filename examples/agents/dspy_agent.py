"""The reveal agent written with DSPy, its defaults: `dspy.ReAct` with the tool, over `dspy.LM` on the run's
endpoint (the OpenAI-compatible provider). DSPy parses the model's text into its fields; output it cannot parse
raises `AdapterParseError`, which fails the episode, or, with `agent.error_reward`, scores it (docs/agents.md).
The LM's cache is off: a training run samples afresh every time.

    agent: {path: examples/agents/dspy_agent.py, name: run}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # frameworks_common beside it, loaded by path

from frameworks_common import QUESTION, endpoint, hidden_digits, reveal, score


async def run(client, row: dict, model: str = "policy", max_tokens: int = 64, max_iters: int = 2) -> dict:
    import dspy

    digits = hidden_digits(row)
    calls = []

    def reveal_digits() -> str:
        """Show the three hidden digits."""
        calls.append(1)
        return reveal(digits)

    reveal_digits.__name__ = "reveal"
    base_url, key = endpoint(client)
    lm = dspy.LM(f"openai/{model}", api_base=base_url, api_key=key, max_tokens=max_tokens, cache=False, num_retries=0)
    agent = dspy.ReAct("question -> answer", tools=[reveal_digits], max_iters=max_iters)
    with dspy.context(lm=lm):
        prediction = await agent.acall(question=QUESTION)
    return score(prediction.answer, digits, len(calls))
