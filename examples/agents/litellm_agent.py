"""The reveal agent written with LiteLLM, its defaults: `litellm.acompletion` with the OpenAI-compatible provider
(`openai/<model>` and the run's endpoint as `api_base`), OpenAI tools, the usual tool loop. With
`agent.kwargs: {stream: true}` each turn is streamed (`stream=True`) and rebuilt with `litellm.stream_chunk_builder`.

    agent: {path: examples/agents/litellm_agent.py, name: run}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # frameworks_common beside it, loaded by path

from frameworks_common import QUESTION, TOOLS, endpoint, hidden_digits, reveal, score


async def run(
    client, row: dict, model: str = "policy", max_tokens: int = 32, max_turns: int = 3, stream: bool = False
) -> dict:
    import litellm

    digits = hidden_digits(row)
    base_url, key = endpoint(client)
    messages = [{"role": "user", "content": QUESTION}]
    calls = 0
    for _ in range(max_turns):
        response = await litellm.acompletion(
            model=f"openai/{model}", api_base=base_url, api_key=key, messages=messages, tools=TOOLS,
            max_tokens=max_tokens, num_retries=0, stream=stream,
        )  # fmt: skip
        if stream:
            response = litellm.stream_chunk_builder([chunk async for chunk in response], messages=messages)
        message = response.choices[0].message
        if not message.tool_calls:
            return score(message.content, digits, calls)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": reveal(digits)})
    return score("", digits, calls)
