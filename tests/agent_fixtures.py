"""Agents the agent tests load by path (tests/test_agent_episodes.py): not a test module. Each is written
against the `openai` client (and httpx, for posting a reward as an agent in another process would), or against an
agent framework with its defaults (`agents_sdk`: the OpenAI Agents SDK)."""

from __future__ import annotations

import asyncio
import time

import httpx

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "reveal",
            "description": "Show the three hidden digits.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
QUESTION = "Which hidden digit is the largest? Call reveal, then answer with #### n."


async def two_requests(client, row, max_tokens: int = 6, **sampling):
    """Asks, then continues the conversation with the model's reply and one more user turn."""
    messages = [{"role": "user", "content": f"count to {row['answer']}"}]
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, **sampling)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and again"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, **sampling)
    return 1.0


async def closes_its_client(client, row, max_tokens: int = 6):
    """Uses its client as a context manager (`async with client:` closes it on the way out), as openai's docs do."""
    async with client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"count to {row['answer']}"}], max_tokens=max_tokens
        )
    return 1.0


async def rewrites_history(client, row, max_tokens: int = 6):
    """Asks, then sends a conversation whose assistant turn is not what the model said."""
    messages = [{"role": "user", "content": f"count to {row['answer']}"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens)
    messages += [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "and again"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens)
    return {"reward": 0.5, "metrics": {"success": 1.0}}


async def calls_the_tool(client, row, max_tokens: int = 32):
    """Offers the tool; when the model calls it, answers with the digits and asks again."""
    messages = [{"role": "user", "content": QUESTION}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=max_tokens)
    message = first.choices[0].message
    if not message.tool_calls:
        return {"reward": 0.0, "metrics": {"tool_calls": 0.0}}
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "3, 8, 1"})
    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=max_tokens)
    return {"reward": 1.0, "metrics": {"tool_calls": float(len(message.tool_calls))}}


async def posts_reward(client, row, value: float = 0.25):
    """Posts its reward to <base_url>/reward (as an agent in another process would) and returns None."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    async with httpx.AsyncClient() as http:
        answer = await http.post(
            f"{client.base_url}reward", json={"reward": value}, headers={"Authorization": f"Bearer {client.api_key}"}
        )
        answer.raise_for_status()
    return None


async def hangs_on_some(client, row, max_tokens: int = 4):
    """Hangs (awaits forever) on rows whose 'hang' column is true, raises on 'boom' rows, else answers."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens)
    if row.get("hang"):
        await asyncio.sleep(3600)
    if row.get("boom"):
        raise ValueError("boom")
    return 1.0


async def returns_nothing(client, row):
    return None


async def blocks(client, row):
    time.sleep(600)


async def agents_sdk(client, row, max_tokens: int = 32):
    """The OpenAI Agents SDK with its defaults: its Responses API model on the given client, a function tool; the
    SDK runs the tool and asks again. Reward 1 when the final answer names the largest digit (8)."""
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no network: the SDK's traces would go to OpenAI

    async def reveal(context, arguments: str) -> str:
        return "3, 8, 1"

    fn = TOOLS[0]["function"]  # the schema the demo tool model was taught with (an SDK tool as users declare one)
    tool = FunctionTool(fn["name"], fn["description"], fn["parameters"], reveal, strict_json_schema=False)
    agent = Agent(
        name="digits",
        tools=[tool],
        model=OpenAIResponsesModel(model="m", openai_client=client),
        model_settings=ModelSettings(max_tokens=max_tokens),
    )
    result = await Runner.run(agent, QUESTION, max_turns=3)
    tool_calls = sum(1 for item in result.new_items if item.type == "tool_call_item")
    return {"reward": float("8" in str(result.final_output)), "metrics": {"tool_calls": float(tool_calls)}}
