"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat path (no torch).

The OpenAI Agents SDK (its default model), the `openai` client's `responses.create` / `responses.stream` and
other frameworks speak this API. A request is translated into the chat request it means (`to_chat`): `input`
(a string, or items: messages, `function_call` and `function_call_output` items, reasoning items skipped) and
`instructions` (a system message first) become chat messages; function tools (flat: `{"type": "function",
"name", "parameters"}`) and `tool_choice` become the chat forms; `max_output_tokens` the token limit;
`text.format` other than text is refused as `response_format` is. `previous_response_id` continues a response
this server gave (kept in memory, the last `KEPT` responses). The chat answer becomes a Response (`to_response`):
an output `message` item with the text and one `function_call` item per tool call; status `incomplete`
(reason `max_output_tokens`) where the model was cut. With `stream: true` the whole answer is sent as the
Responses stream's server-sent events (`stream_events`), as the chat path streams. Inside an episode a
Responses request is recorded exactly as the chat request it translates to (docs/agents.md).
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from typing import Any, Optional

from rlhf_core.agent.api import APIError

KEPT = 1024  # responses kept for previous_response_id
SKIPPED_ITEMS = ("reasoning",)  # input items a model without reasoning has nothing to render for
_PASSED = ("temperature", "top_p", "seed", "stream", "logprobs", "top_logprobs")


def _text(content: Any, where: str) -> str:
    """A Responses message's content as text: a string or a list of input_text / output_text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            else:
                raise APIError(400, f"{where}[{j}]: only text content parts are supported (got {kind!r})", where)
        return "".join(parts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param=where)


def input_messages(items: Any, instructions: Optional[str] = None) -> list[dict]:
    """Chat messages (OpenAI chat format) of a Responses `input`: consecutive `function_call` items (and the
    assistant message before them) are one assistant turn with tool calls; each `function_call_output` a tool
    message. A malformed item is a 400 naming it."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role {role!r} is not user, assistant, system or developer", where)
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise APIError(400, f"{where}: a function_call needs a name and its arguments as a string", where)
            call = {
                "id": str(item.get("call_id") or item.get("id") or ""),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
        elif kind in SKIPPED_ITEMS:
            continue
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param=where)
    return messages


def chat_tools(tools: Any) -> Optional[list[dict]]:
    """Responses function tools ({type, name, description, parameters}) as chat tools; other kinds are a 400."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(
                400, f"tools[{i}]: only function tools are supported here (got {kind!r})", param=f"tools[{i}]"
            )
        # as chat templates render a function (OpenAI's `strict` is a constrained-decoding switch, not shown)
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


class Responses:
    """The translation both ways and the responses kept for previous_response_id."""

    def __init__(self, kept: int = KEPT):
        self.kept = int(kept)
        self._store: OrderedDict[str, list[dict]] = OrderedDict()  # response id -> its whole conversation

    def to_chat(self, body: Any) -> tuple[dict, dict]:
        """(the chat request body, the request's own fields a Response repeats)."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if "input" not in body:
            raise APIError(400, "input: Field required", param="input")
        messages = input_messages(body["input"], body.get("instructions"))
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in self._store:
                raise APIError(
                    400,
                    f"previous_response_id {previous!r} is not a response of this server (it keeps the last "
                    f"{self.kept} in memory): send the whole conversation as input instead",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            kept = self._store[previous]
            messages = kept + [m for m in messages if m["role"] != "system" or not kept]
        chat: dict = {"model": body.get("model", ""), "messages": messages}
        chat.update({k: body[k] for k in _PASSED if body.get(k) is not None})
        if body.get("max_output_tokens") is not None:
            chat["max_completion_tokens"] = body["max_output_tokens"]
        tools = chat_tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if isinstance(fmt, dict):
            chat["response_format"] = {"type": fmt.get("type", "text")}
        echo = {k: body.get(k) for k in ("instructions", "metadata", "temperature", "top_p", "max_output_tokens")}
        echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice") or "auto", messages=messages)
        echo["previous_response_id"] = previous
        return chat, echo

    def to_response(self, answer: dict, echo: dict) -> dict:
        """The Response of a chat answer (one choice); the conversation is kept for previous_response_id."""
        choice = answer["choices"][0]
        message = choice["message"]
        output: list[dict] = []
        if message.get("content") or not message.get("tool_calls"):
            output.append(
                {
                    "type": "message",
                    "id": f"msg_{secrets.token_hex(12)}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}],
                }
            )
        for call in message.get("tool_calls") or []:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{secrets.token_hex(12)}",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
        cut = choice["finish_reason"] == "length"
        usage = answer["usage"]
        rid = f"resp_{secrets.token_hex(12)}"
        response = {
            "id": rid,
            "object": "response",
            "created_at": float(answer["created"]),
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": answer["model"],
            "output": output,
            "parallel_tool_calls": True,
            "instructions": echo["instructions"],
            "metadata": echo["metadata"] or {},
            "temperature": echo["temperature"],
            "top_p": echo["top_p"],
            "max_output_tokens": echo["max_output_tokens"],
            "previous_response_id": echo["previous_response_id"],
            "tools": echo["tools"],
            "tool_choice": echo["tool_choice"],
            "text": {"format": {"type": "text"}},
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
            "policy_version": answer.get("policy_version"),
        }
        reply = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        self._store[rid] = [*echo["messages"], reply]
        while len(self._store) > self.kept:
            self._store.popitem(last=False)
        return response


def stream_events(response: dict) -> list[tuple[str, dict]]:
    """A whole Response as the Responses stream's events (type, data): created, in_progress, each output item
    added / its text or arguments delta and done / done, then completed (or incomplete)."""
    events: list[tuple[str, dict]] = []

    def emit(kind: str, **data) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    opening = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            emit(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            emit("response.content_part.added", **at, part=part)
            emit("response.output_text.delta", **at, delta=text, logprobs=[])
            emit("response.output_text.done", **at, text=text, logprobs=[])
            emit("response.content_part.done", **at, part={**part, "text": text})
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            at = {"item_id": item["id"], "output_index": index}
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return events


def sse(events: list[tuple[str, dict]]):
    """Server-sent events of (type, data) pairs."""
    for kind, data in events:
        yield f"event: {kind}\ndata: {json.dumps(data)}\n\n"
