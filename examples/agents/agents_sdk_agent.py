"""The reveal agent written with the OpenAI Agents SDK (openai-agents), its defaults: the Responses API model on
the client the run hands the agent, a function tool the SDK runs itself. With `agent.kwargs: {stream: true}`
the agent runs with `Runner.run_streamed` (the Responses stream's events).

    agent: {path: examples/agents/agents_sdk_agent.py, name: run}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # frameworks_common beside it, loaded by path

from frameworks_common import QUESTION, TOOLS, hidden_digits, reveal, score


async def run(
    client, row: dict, model: str = "policy", max_tokens: int = 32, max_turns: int = 3, stream: bool = False
) -> dict:
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK sends traces to OpenAI by default; a training run has no business there
    digits = hidden_digits(row)
    calls = []

    async def reveal_digits(context, arguments: str) -> str:
        calls.append(1)
        return reveal(digits)

    fn = TOOLS[0]["function"]  # the tool's schema as the model was taught it (@function_tool derives a stricter one)
    tool = FunctionTool(fn["name"], fn["description"], fn["parameters"], reveal_digits, strict_json_schema=False)
    agent = Agent(
        name="digits",
        tools=[tool],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=max_tokens),
    )
    if stream:
        result = Runner.run_streamed(agent, QUESTION, max_turns=max_turns)
        async for _ in result.stream_events():  # a failed run raises here, as Runner.run raises
            pass
    else:
        result = await Runner.run(agent, QUESTION, max_turns=max_turns)
    return score(result.final_output, digits, len(calls))
