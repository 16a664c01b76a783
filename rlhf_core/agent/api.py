"""The OpenAI wire format the agent endpoint speaks (no torch).

Request bodies are validated here (`parse_chat`, `parse_completion`), messages are normalised for the model's
chat template (`normalize_messages`: OpenAI's string `arguments` become the objects a Hugging Face template
renders), the model's tool calls are parsed back into OpenAI `tool_calls` (the Qwen2.5 / Hermes `<tool_call>`
blocks that `rlhf_core.env.tools.parse_tool_calls` reads), and errors are shaped as OpenAI's
(`{"error": {"message", "type", "param", "code"}}`), so that the `openai` client raises its usual exceptions.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlhf_core.env.tools import TOOL_CALL, parse_tool_calls

ROLES = ("system", "user", "assistant", "tool")


class APIError(Exception):
    """An OpenAI-style error answer: HTTP status and the body's message, type, param and code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # fields this endpoint does not use (user, metadata, store, parallel_tool_calls, ...) are accepted and ignored
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None

    @property
    def stops(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]


class ChatRequest(_Body):
    messages: list[Any] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Body):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_tokens

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of the request: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            return [p]
        return list(p)


def _parse(cls, body: Any):
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise APIError(
            400,
            "streaming is not supported yet: this endpoint answers whole responses only (send stream: false)",
            param="stream",
            code="unsupported_parameter",
        )
    try:
        req = cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param=where or None) from None
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported (only 0)", param=name, code="unsupported_parameter")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    if len(req.stops) > 4:
        raise APIError(400, "stop: at most 4 sequences", param="stop")
    return req


def parse_chat(body: Any) -> ChatRequest:
    req = _parse(ChatRequest, body)
    choice = req.tool_choice
    if choice not in (None, "auto", "none"):
        raise APIError(
            400,
            f"tool_choice {choice!r} is not supported: the model decides whether to call a tool ('auto'), or its "
            "calls are left as text ('none')",
            param="tool_choice",
            code="unsupported_parameter",
        )
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise APIError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]"
            )
    return req


def parse_completion(body: Any) -> CompletionRequest:
    req = _parse(CompletionRequest, body)
    if req.echo or req.suffix:
        name = "echo" if req.echo else "suffix"
        raise APIError(400, f"{name} is not supported", param=name, code="unsupported_parameter")
    if not req.prompts() or any(not p for p in req.prompts()):
        raise APIError(400, "prompt must not be empty", param="prompt")
    return req


# ------------------------------------------------------------------------------------------------ messages
def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (""), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise APIError(400, f"{where}: only text content parts are supported", param=where)
        return "".join(parts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param=where)


def _template_call(call: Any, where: str) -> dict:
    """An OpenAI tool call ({id, type, function: {name, arguments: JSON string}}) as a chat template renders it
    ({type, function: {name, arguments: object}})."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise APIError(400, f"{where}.function.arguments is not JSON: {exc.msg}", param=where) from None
    return {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def normalize_messages(messages: list[Any]) -> list[dict]:
    """Messages as the chat template takes them: role (OpenAI's 'developer' is 'system'), content as text,
    an assistant's tool calls with their arguments as objects. A malformed message is a 400 naming it."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"{where} must be an object with a 'role'", param=where)
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ROLES:
            raise APIError(400, f"{where}.role {m['role']!r} is not one of {', '.join(ROLES)}", param=f"{where}.role")
        message = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [
                _template_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])
            ]
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return out


def signature(message: dict) -> tuple:
    """What makes two normalised messages the same turn: role, content, and each tool call's name and
    arguments (tool call ids and other fields do not matter)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return message["role"], message.get("content") or "", calls


def tools_key(tools: Optional[list[dict]]) -> str:
    return json.dumps(tools or [], sort_keys=True)


# ------------------------------------------------------------------------------------------------ answers
def assistant_message(text: str, parse_tools: bool) -> tuple[dict, list[dict]]:
    """(the OpenAI message of a model turn, the same turn normalised as `normalize_messages` makes it). With
    `parse_tools` the turn's <tool_call> blocks become `tool_calls` and leave the content; a block that is not
    a well-formed call stays in the content as text."""
    calls = []
    content = text
    if parse_tools:
        calls, errors = parse_tool_calls(text)
        if calls and not errors:
            content = TOOL_CALL.sub("", text).strip()
        else:
            calls = []
    message = {"role": "assistant", "content": content if content or not calls else None}
    normal = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in calls
        ]
        normal["tool_calls"] = [{"type": "function", "function": dict(c)} for c in calls]
    return message, normal


def token_logprobs(tokenizer, ids: list[int], logprobs: list[float], top: Optional[list[list[tuple]]]) -> list:
    """OpenAI chat `logprobs.content`: one entry per generated token (token text, log-prob, UTF-8 bytes, and the
    top alternatives when asked)."""
    out = []
    for k, (i, lp) in enumerate(zip(ids, logprobs)):
        text = tokenizer.decode([i])
        entry = {"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": []}
        if top is not None:
            entry["top_logprobs"] = [
                {"token": tokenizer.decode([j]), "logprob": float(v), "bytes": list(tokenizer.decode([j]).encode())}
                for j, v in top[k]
            ]
        out.append(entry)
    return out
