"""An agent written only against the OpenAI client: it offers the model one tool through OpenAI `tools`,
runs the calls the model makes, and scores the answer (configs/tiny-agent.yaml, docs/agents.md).

The row's question ("max of a, b, c? ...") is not shown to the model: the agent asks for the largest of three
hidden digits, and only the `reveal` tool shows them. The model must call the tool, read its result and
answer '#### n' with their maximum. Reward 1.0 for the right maximum, else 0.0.

Any OpenAI-compatible server runs it: `base_url` and `api_key` are all it needs.

    agent: {path: examples/agents/reveal_agent.py, name: run}
"""

from __future__ import annotations

import re

QUESTION = "Which hidden digit is the largest? Call reveal, then answer with #### n."
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
ANSWER = re.compile(r"####\s*(-?\d+)")
DIGITS = re.compile(r"max of (\d+), (\d+), (\d+)")


def hidden_digits(row: dict) -> list[int]:
    """The row's three numbers: from its question ("max of a, b, c? ..."), as a prompt text or messages."""
    prompt = row.get("prompt", "")
    text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)
    found = DIGITS.search(text)
    if found is None:
        raise ValueError(f"the row's prompt quotes no 'max of a, b, c': {text[:80]!r}")
    return [int(x) for x in found.groups()]


def reveal(digits: list[int]) -> str:
    return ", ".join(str(d) for d in digits)


async def run(client, row: dict, model: str = "policy", max_tokens: int = 32, max_turns: int = 3) -> dict:
    """One episode: ask, run the model's tool calls, score its final answer."""
    digits = hidden_digits(row)
    messages = [{"role": "user", "content": QUESTION}]
    calls = 0
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens
        )
        message = response.choices[0].message
        if not message.tool_calls:
            found = ANSWER.findall(message.content or "")
            correct = bool(found) and int(found[-1]) == max(digits)
            return {"reward": float(correct), "metrics": {"success": float(correct), "tool_calls": float(calls)}}
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls += 1
            result = reveal(digits) if call.function.name == "reveal" else f"error: no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": 0.0, "metrics": {"success": 0.0, "tool_calls": float(calls)}}
