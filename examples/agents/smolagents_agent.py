"""The reveal agent written with smolagents, its defaults: a `ToolCallingAgent` (tool_choice "required" on every
step, its own system prompt and `final_answer` tool) over an `OpenAIServerModel` on the run's endpoint.

    agent: {path: examples/agents/smolagents_agent.py, name: run}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # frameworks_common beside it, loaded by path

import asyncio

from frameworks_common import QUESTION, endpoint, hidden_digits, reveal, score


async def run(client, row: dict, model: str = "policy", max_tokens: int = 32, max_steps: int = 3) -> dict:
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

    digits = hidden_digits(row)
    calls = []

    class Reveal(Tool):
        name = "reveal"
        description = "Show the three hidden digits."
        inputs = {}
        output_type = "string"

        def forward(self) -> str:
            calls.append(1)
            return reveal(digits)

    base_url, key = endpoint(client)
    llm = OpenAIServerModel(model_id=model, api_base=base_url, api_key=key, max_tokens=max_tokens)
    agent = ToolCallingAgent(tools=[Reveal()], model=llm, max_steps=max_steps, verbosity_level=0)
    answer = await asyncio.to_thread(agent.run, QUESTION)  # smolagents is synchronous
    return score(answer, digits, len(calls))
