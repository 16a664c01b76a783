"""ToolEnv: Python functions as tools (`env.tools: [{path, name}]`), in the Qwen2.5 / Hermes tool format.

The model sees the tools' JSON schemas (made from each function's signature and Google-style docstring by
`transformers.utils.get_json_schema`, as chat templates take them with `tools=`) through its own chat
template. It calls a tool by writing

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

(one or more blocks in a turn). Each call runs under the step timeout (env.step_timeout_s, the calls of
a turn at once); its result, or the error it raised, comes back as a `tool` message, as does what is wrong
with a malformed call (not JSON, no name, a `<tool_call>` never closed). The episode ends when the model
answers: a turn with no `<tool_call>` at all (or at env.max_turns). A call that overruns the timeout fails
the step (an infrastructure failure, not a bad answer). The run's configured rewards score the final answer;
when the row has an `answer`, the final step asks the runner to grade it (info["check_answer"]): the
project's answer matcher on the final answer's tokens sets info["success"] (the answer as a whole number or
word, number forms equal: "It is 1,000." answers 1000, "so 15" does not answer 5).

The environment side imports no torch and no transformers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from typing import Any, Optional

from rlhf_core.usercode import load_tools

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"


def tool_schemas(tools: list[tuple[str, str]]) -> list[dict]:
    """The JSON schemas of the tools [(path, name)], as chat templates take them (`tools=`)."""
    from transformers.utils import get_json_schema

    out = []
    for i, (path, name) in enumerate(tools):
        fn = load_tools([(path, name)], "env.tools")[name]
        try:
            out.append(get_json_schema(fn))
        except Exception as exc:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"env.tools[{i}]: no JSON schema for {name} in {path}: {exc} (a tool needs type hints on every "
                "argument and a docstring with an Args: section describing each)"
            ) from None
    return out


def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The <tool_call> blocks of a model turn: (calls [{name, arguments}], errors for blocks that are not a
    JSON object with a string name and an object of arguments, and for a <tool_call> never closed)."""
    calls, errors = [], []
    unclosed = TOOL_CALL.sub("", text)
    if OPEN_TAG in unclosed:
        rest = unclosed[unclosed.index(OPEN_TAG) + len(OPEN_TAG) :].strip()
        errors.append(f"the tool call {rest[:80]!r} is not closed with </tool_call>")
    for block in TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as exc:
            errors.append(f"the tool call {block[:80]!r} is not JSON: {exc.msg}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append(f"the tool call {block[:80]!r} has no string 'name'")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f"the arguments of tool call {call['name']!r} are not a JSON object")
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    return calls, errors


def _result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class ToolEnv:
    """The built-in tool-calling environment. kwargs: tools [{path, name}] (env.tools, filled in by the
    runner), timeout_s (env.step_timeout_s, likewise), system (an optional system message put before the
    row's prompt)."""

    def __init__(self, tools: Optional[list[dict]] = None, timeout_s: float = 30.0, system: str = "", **kwargs):
        self.functions = load_tools([(t["path"], t["name"]) for t in tools or []])
        self.timeout_s = float(timeout_s)
        self.system = system
        self.answer = ""

    def reset(self, row: dict):
        self.answer = str(row.get("answer") or "")
        prompt = row.get("messages") or row.get("prompt")
        messages = (
            list(prompt)
            if isinstance(prompt, list)
            else [{"role": "user", "content": str(row.get("question", prompt))}]
        )
        if self.system and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system}] + messages
        return messages

    async def step(self, action: str):
        calls, errors = parse_tool_calls(action)
        if not calls and not errors:  # an answer (no <tool_call> at all): the episode ends
            info = {"tool_calls": 0}
            if self.answer.strip():
                info["check_answer"] = self.answer  # graded by the runner (EnvRunner._grade)
            return None, 0.0, True, info
        results = await asyncio.gather(*(self._run(call) for call in calls))
        messages = [{"role": "tool", "content": f"error: {e}"} for e in errors]
        messages += [{"role": "tool", "content": r} for r in results]
        return messages, 0.0, False, {"tool_calls": calls}

    async def _run(self, call: dict) -> str:
        fn = self.functions.get(call["name"])
        if fn is None:
            return f"error: no tool named {call['name']!r} (tools: {', '.join(sorted(self.functions))})"
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(**call["arguments"]), self.timeout_s)
            else:
                value = await asyncio.wait_for(asyncio.to_thread(fn, **call["arguments"]), self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"tool {call['name']} timed out after {self.timeout_s:g} s (env.step_timeout_s)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a tool's error is the model's to read, not a failure
            return f"error: {type(exc).__name__}: {exc}"
        return _result_text(value)
