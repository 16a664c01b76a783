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
    stream_options: Optional[dict] = None
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
    response_format: Optional[dict] = None

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    @property
    def forced_tool(self) -> Optional[str]:
        """'' when tool_choice is "required" (some tool), the function's name when it names one, else None."""
        if self.tool_choice == "required":
            return ""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    def tool_prefill(self) -> str:
        """The text the model's turn starts with when tool_choice forces a call: the template's tool-call opening
        (Qwen2.5 / Hermes `<tool_call>`), and for a named function its name, so the model writes the arguments."""
        forced = self.forced_tool
        if forced is None:
            return ""
        return "<tool_call>\n" + (f'{{"name": {json.dumps(forced)}, "arguments":' if forced else "")


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
    """A chat request, validated. tool_choice: 'auto', 'none', 'required' or a function of `tools` (the last two
    force a call: `ChatRequest.tool_prefill`); response_format other than 'text' is refused (no constrained
    decoding here), never ignored."""
    req = _parse(ChatRequest, body)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" or not fn.get("name"):
            raise APIError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]"
            )
    names = [t["function"]["name"] for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, "tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if fn["name"] not in names:
            raise APIError(400, f"tool_choice names {fn['name']!r}, which is not among tools {names}", "tool_choice")
    elif choice not in (None, "auto", "none", "required"):
        raise APIError(
            400, f"tool_choice {choice!r}: expected 'auto', 'none', 'required' or a function", param="tool_choice"
        )
    if req.forced_tool is not None and not names:
        raise APIError(400, "tool_choice forces a tool call but the request has no tools", param="tool_choice")
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text":
        raise APIError(
            400,
            f"response_format {kind!r} is not supported: this engine has no constrained decoding, so the answer "
            "would not be guaranteed to parse (ask for JSON in the prompt and parse it, or send response_format "
            "'text')",
            param="response_format",
            code="unsupported_parameter",
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


def stream_chunks(answer: dict, include_usage: bool = False) -> list[dict]:
    """A whole answer (`chat.completion` or `text_completion`) as the chunks of an OpenAI stream: per choice, its
    content (and tool calls) in one delta, then its finish reason; with stream_options.include_usage, a last
    chunk with the usage and no choices. The server sends each as a server-sent event, then `[DONE]`."""
    chat = answer["object"] == "chat.completion"
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    chunks = []
    for choice in answer["choices"]:
        if chat:
            message = choice["message"]
            delta = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            first = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
            last = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        else:
            first = {"index": choice["index"], "text": choice["text"], "logprobs": choice["logprobs"]}
            first["finish_reason"] = None
            last = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        chunks += [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks
