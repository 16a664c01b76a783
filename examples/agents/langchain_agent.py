"""The reveal agent written with LangChain (langchain-openai), its defaults: `ChatOpenAI` on the run's endpoint,
the tool bound with `bind_tools`, LangChain's tool loop (AIMessage.tool_calls -> ToolMessage). With
`agent.kwargs: {stream: true}` each turn is read with `.astream` (server-sent events) and its chunks added up.

    agent: {path: examples/agents/langchain_agent.py, name: run}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # frameworks_common beside it, loaded by path

from frameworks_common import QUESTION, TOOLS, endpoint, hidden_digits, reveal, score


async def run(
    client, row: dict, model: str = "policy", max_tokens: int = 32, max_turns: int = 3, stream: bool = False
) -> dict:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    digits = hidden_digits(row)
    calls = 0
    base_url, key = endpoint(client)
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=key, max_tokens=max_tokens, max_retries=0)
    bound = llm.bind_tools(TOOLS)  # OpenAI-format tool dicts (a @tool function binds the same way)
    messages = [HumanMessage(QUESTION)]
    for _ in range(max_turns):
        if stream:
            reply = None
            async for chunk in bound.astream(messages):  # AIMessageChunks: text and tool-call pieces add up
                reply = chunk if reply is None else reply + chunk
        else:
            reply = await bound.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return score(reply.content, digits, calls)
        for call in reply.tool_calls:
            calls += 1
            result = reveal(digits) if call["name"] == "reveal" else f"error: no tool {call['name']}"
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    return score("", digits, calls)
