"""The OpenAI-compatible endpoint over the policy: an HTTP server on loopback behind a per-run random key.

    POST /v1/chat/completions   messages (+ tools, rendered through the model's own chat template), sampling
    POST /v1/completions        a text (or token ids) prompt
    POST /v1/responses          OpenAI's Responses API, as the chat request it means (rlhf_core.agent.responses)
    GET  /v1/models             the one model served
    POST /episodes/<id>/v1/...  the same, recorded for episode <id> (an agent's base_url)
    POST /episodes/<id>/reward  {"reward": float, "metrics": {...}}: the episode's reward, posted

A wrong or missing key is a 401, a malformed request an OpenAI-style 400 error body, a body over
`max_body_bytes` a 413; `stream: true` answers as server-sent events. Prompts are built as token ids here (the
chat template, `rlhf_core.env.chat.ChatFormat`); a request that continues a recorded conversation reuses the
ids the policy generated and appends the new messages' ids, as environments do (docs/agents.md).

Generation goes through the rollout engine on one thread of its own; requests that arrive together are
generated in one engine call (`rlhf_core.agent.batching`). While the policy serves a
training run (`serve(engine, sampling=...)`) the run's sampling settings replace the request's temperature,
top_p and seed (the trainer recomputes the behaviour log-probs under those; max_tokens still applies, capped
by rollout.max_new_tokens); otherwise (`atrlhf serve`) the request's own settings apply.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Optional

from rlhf_core.agent import api
from rlhf_core.agent.batching import Batcher, cut_at_stop
from rlhf_core.agent.responses import Responses, sse, stream_events
from rlhf_core.agent.segments import Call, Completion, EpisodeLog
from rlhf_core.env.chat import ChatFormat, ChatFormatError
from rlhf_core.rollout.base import SamplingParams

KEEP_ALIVE_S = 120
"""How long the endpoint keeps an idle connection open (uvicorn's default is 5 s). Longer than a client pool's own
idle expiry (httpx's 5 s, the openai client's pool; aiohttp's 15 s), so the client drops an idle connection first:
at equal expiries a client could reuse a connection the server was closing at that moment, and with max_retries=0
(a request is never sent twice) its episode failed ("APIConnectionError: Connection error")."""


class AgentServer:
    """The endpoint (module doc) over `tokenizer` and an engine given by `serve`. `start()` binds 127.0.0.1
    (port 0: a free one) and serves on a thread of its own; `close()` stops it."""

    def __init__(
        self,
        tokenizer,
        stop_ids,
        *,
        model_name: str = "policy",
        max_context: Optional[int] = None,
        max_requests: Optional[int] = None,
        max_body_bytes: int = 4 << 20,
        batch_wait_s: float = 0.02,
        default_max_tokens: int = 256,
        port: int = 0,
    ):
        self.tokenizer = tokenizer
        self.stop_ids = [int(i) for i in stop_ids]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.model_name = model_name
        limit = getattr(tokenizer, "model_max_length", None)
        self.max_context = max_context or (limit if isinstance(limit, int) and limit < 1_000_000 else None)
        self.max_requests = max_requests
        self.max_body_bytes = int(max_body_bytes)
        self.batch_wait_s = float(batch_wait_s)
        self.default_max_tokens = int(default_max_tokens)
        self.port = int(port)
        self.key = "sk-atrlhf-" + secrets.token_urlsafe(24)
        self.engine = None
        self.sampling: Optional[SamplingParams] = None  # a training run's sampling settings (module doc)
        self.between_steps: Optional[Callable] = None  # partial rollouts: the worker's weights hook
        self.episodes: dict[str, EpisodeLog] = {}
        self.requests = 0  # answered, over the server's life
        self.streamed = 0  # of them, answered as server-sent events (stream: true)
        self._formats: dict[str, ChatFormat] = {}
        self.batcher = Batcher(self.stop_ids, self.pad_token_id, batch_wait_s, self._idle_episodes)
        self.responses = Responses()  # the Responses API's translation and its kept responses
        self._server = None
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def episode_url(self, eid: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{eid}/v1"

    def start(self, timeout_s: float = 30.0) -> AgentServer:
        if self._thread is not None:
            return self
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))  # loopback only
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app(), log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="agent-endpoint", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on 127.0.0.1:{self.port}")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = self._thread = None
        self.batcher.close()

    def serve(self, engine, sampling: Optional[SamplingParams] = None, between_steps: Optional[Callable] = None):
        """Generate with `engine` from now on; `sampling`: a training run's settings (module doc), None: the
        request's own; `between_steps`: the partial-rollout hook, asked before every engine call."""
        self.engine, self.sampling, self.between_steps = engine, sampling, between_steps
        self.batcher.engine, self.batcher.between_steps = engine, between_steps

    def open_episode(self, log: EpisodeLog) -> None:
        self.episodes[log.eid] = log

    def close_episode(self, eid: str) -> None:
        log = self.episodes.pop(eid, None)
        if log is not None:
            log.close()

    # ------------------------------------------------------------------ HTTP
    def _app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        def route(path: str, fn, method: str):
            async def endpoint(request):
                try:
                    self._auth(request)
                    answer = await fn(request)
                    if isinstance(answer, Streamed):
                        self.streamed += 1
                        return StreamingResponse(answer.events(), media_type="text/event-stream")
                    return JSONResponse(answer)
                except api.APIError as exc:
                    return JSONResponse(exc.body(), status_code=exc.status)
                except Exception as exc:  # noqa: BLE001 - the client gets the error, the server keeps serving
                    error = api.APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")
                    return JSONResponse(error.body(), status_code=500)

            return Route(path, endpoint, methods=[method])

        async def not_found(request, exc):
            status = getattr(exc, "status_code", 404)
            error = api.APIError(status, f"no route {request.method} {request.url.path}", code="not_found")
            return JSONResponse(error.body(), status_code=status)

        routes = []
        for prefix in ("", "/episodes/{eid}"):
            routes += [
                route(f"{prefix}/v1/models", self._models, "GET"),
                route(f"{prefix}/v1/chat/completions", self._chat, "POST"),
                route(f"{prefix}/v1/completions", self._completions, "POST"),
                route(f"{prefix}/v1/responses", self._responses, "POST"),
            ]
        routes += [route(p, self._reward, "POST") for p in ("/episodes/{eid}/reward", "/episodes/{eid}/v1/reward")]
        return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})

    def _auth(self, request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
            raise api.APIError(
                401, "invalid API key (this endpoint's key is printed when it starts)", code="invalid_api_key"
            )

    async def _json(self, request):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_body_bytes:
            raise api.APIError(413, f"the request body is over {self.max_body_bytes} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise api.APIError(
                    413, f"the request body is over {self.max_body_bytes} bytes", code="request_too_large"
                )
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise api.APIError(400, f"the request body is not JSON: {exc}") from None

    def _episode(self, request) -> Optional[EpisodeLog]:
        eid = request.path_params.get("eid")
        if eid is None:
            return None
        log = self.episodes.get(eid)
        if log is None:
            raise api.APIError(404, f"no open episode {eid!r} (it has ended, or never started)", code="episode_closed")
        return log

    async def _models(self, request) -> dict:
        self._episode(request)
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "atrlhf"}
        return {"object": "list", "data": [entry]}

    async def _reward(self, request) -> dict:
        log = self._episode(request)
        body = await self._json(request)
        if not isinstance(body, dict) or "reward" not in body:
            raise api.APIError(400, 'the body must be {"reward": <number>, "metrics": {...}}', param="reward")
        try:
            log.post(body["reward"], body.get("metrics"))
        except (TypeError, ValueError) as exc:
            raise api.APIError(400, str(exc), param="reward") from None
        return {"object": "reward", "episode": log.eid, "reward": log.posted["reward"]}

    # ------------------------------------------------------------------ chat and text completions
    def _chat_format(self, tools: Optional[list[dict]]) -> ChatFormat:
        key = api.tools_key(tools)
        if key not in self._formats:
            try:
                self._formats[key] = ChatFormat(self.tokenizer, self.stop_ids, tools=tools, where="the served model")
            except ChatFormatError as exc:
                raise api.APIError(400, str(exc).replace("env.tools", "tools").replace("env:", ""), "tools") from None
        return self._formats[key]

    def _budget(self, requested: Optional[int], prompt_len: int) -> int:
        if self.max_context is not None and prompt_len >= self.max_context:
            raise api.APIError(
                400,
                f"the prompt has {prompt_len} tokens; the model's context is {self.max_context}",
                param="messages",
                code="context_length_exceeded",
            )
        cap = self.sampling.max_new_tokens if self.sampling is not None else self.default_max_tokens
        budget = min(requested or cap, cap) if self.sampling is not None else (requested or cap)
        if self.max_context is not None:
            budget = min(budget, self.max_context - prompt_len)
        return budget

    def _params(self, req, budget: int) -> tuple[SamplingParams, Optional[int]]:
        if self.sampling is not None:  # a training run's settings: the trainer recomputes under these
            return replace(self.sampling, max_new_tokens=budget), None
        temperature = 1.0 if req.temperature is None else req.temperature
        return SamplingParams(budget, temperature, 1.0 if req.top_p is None else req.top_p), req.seed

    def _begin(self, log: Optional[EpisodeLog]) -> None:
        if self.engine is None:
            raise api.APIError(503, "no policy is being served yet", type="server_error")
        if log is not None and self.max_requests is not None and log.requests + log.inflight >= self.max_requests:
            raise api.APIError(
                400, f"this episode has made agent.max_requests={self.max_requests} requests", code="max_requests"
            )

    async def _chat(self, request) -> dict:
        started, t0 = time.time_ns(), time.perf_counter()
        log = self._episode(request)
        req = api.parse_chat(await self._json(request))
        return Streamed.wrap(req, await self._chat_answer(log, req, started, t0))

    async def _responses(self, request):
        """POST /v1/responses: the chat request it means, answered as a Response (rlhf_core.agent.responses)."""
        started, t0 = time.time_ns(), time.perf_counter()
        log = self._episode(request)
        body, echo = self.responses.to_chat(await self._json(request))
        try:
            req = api.parse_chat(body)
        except api.APIError as exc:  # name the Responses field
            if exc.param == "response_format":
                exc.param, exc.message = "text.format", exc.message.replace("response_format", "text.format")
            elif exc.param == "max_completion_tokens":
                exc.param, exc.message = "max_output_tokens", exc.message.replace(exc.param, "max_output_tokens")
            raise
        response = self.responses.to_response(await self._chat_answer(log, req, started, t0), echo)
        return Streamed(sse(stream_events(response))) if req.stream else response

    async def _chat_answer(self, log: Optional[EpisodeLog], req: api.ChatRequest, started: int, t0: float) -> dict:
        self._begin(log)
        messages = api.normalize_messages(req.messages)
        fmt = self._chat_format(req.tools)
        tools = api.tools_key(req.tools)
        base = log.chat_base(messages, tools, api.signature) if log is not None else None
        if base is not None:
            ids, last, rest = base
            prompt_ids = ids + fmt.observation_ids(rest, last)
        else:
            prompt_ids = fmt.prompt_ids(messages)
        prefill = req.tool_prefill()  # a forced call: the turn opens with it (masked)
        if prefill:
            prompt_ids = prompt_ids + list(self.tokenizer(prefill, add_special_tokens=False)["input_ids"])
        params, seed = self._params(req, self._budget(req.token_limit, len(prompt_ids)))
        top = (req.top_logprobs or 0) if req.logprobs else 0
        completions, tops = await self._generate(log, [prompt_ids] * req.n, params, seed, top, req.stops)
        parse = bool(req.tools) and req.tool_choice != "none"
        choices, replies = [], []
        for i, (c, top_i) in enumerate(zip(completions, tops)):
            message, normal = api.assistant_message(prefill + self._text(c), parse)
            replies.append(normal)
            content = self._content(c)
            choice = {"index": i, "message": message, "logprobs": None, "finish_reason": _finish(c, message)}
            if req.logprobs:
                choice["logprobs"] = {
                    "content": api.token_logprobs(self.tokenizer, content, c.logprobs[: len(content)], top_i)
                }
            choices.append(choice)
        call = Call(prompt_ids, completions, messages=messages, replies=replies, tools=tools, started_ns=started)
        call.latency_s = time.perf_counter() - t0
        return self._answer("chat.completion", log, [call], choices)

    async def _completions(self, request) -> dict:
        started, t0 = time.time_ns(), time.perf_counter()
        log = self._episode(request)
        req = api.parse_completion(await self._json(request))
        self._begin(log)
        calls, choices = [], []
        for p in req.prompts():
            if isinstance(p, str):
                base = log.text_base(p, self.stop_ids) if log is not None else None
                if base is not None:
                    prompt_ids = base[0] + list(self.tokenizer(base[1], add_special_tokens=False)["input_ids"])
                else:
                    prompt_ids = list(self.tokenizer(p)["input_ids"])
            else:
                prompt_ids = [int(i) for i in p]
            params, seed = self._params(req, self._budget(req.token_limit, len(prompt_ids)))
            top = req.logprobs or 0
            completions, tops = await self._generate(log, [prompt_ids] * req.n, params, seed, top, req.stops)
            texts, seen = [], []
            for c, top_i in zip(completions, tops):
                text = self._text(c)
                texts.append(text)
                seen.append(
                    text if c.cut is None else self.tokenizer.decode(self._content(c), skip_special_tokens=True)
                )
                choice = {"index": len(choices), "text": text, "logprobs": None, "finish_reason": _finish(c, {})}
                if req.logprobs is not None:
                    choice["logprobs"] = _legacy_logprobs(self.tokenizer, self._content(c), c.logprobs, top_i)
                choices.append(choice)
            call = Call(prompt_ids, completions, text=p if isinstance(p, str) else None, texts=texts, seen=seen)
            call.started_ns, call.latency_s = started, time.perf_counter() - t0
            calls.append(call)
            started, t0 = time.time_ns(), time.perf_counter()  # the next prompt's generation starts now
        return Streamed.wrap(req, self._answer("text_completion", log, calls, choices))

    def _answer(self, kind: str, log: Optional[EpisodeLog], calls: list[Call], choices: list[dict]) -> dict:
        if log is not None:
            for call in calls:
                log.record(call)  # not kept once the episode closed (a request still in flight at its end)
        version = int(getattr(self.engine, "version", 0))
        prompt_tokens = sum(len(c.prompt_ids) for c in calls)
        completion_tokens = sum(len(x.ids) for c in calls for x in c.completions)
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{secrets.token_hex(12)}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": f"atrlhf-v{version}",
            "policy_version": version,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _content(self, c: Completion) -> list[int]:
        """The completion's ids without a final stop id (what the client reads)."""
        return c.ids[:-1] if c.ids and c.ids[-1] in self.stop_ids else c.ids

    def _text(self, c: Completion) -> str:
        return c.cut if c.cut is not None else self.tokenizer.decode(self._content(c), skip_special_tokens=True)

    # ------------------------------------------------------------------ generation (rlhf_core.agent.batching)
    async def _generate(self, log, rows, params, seed, top, stops) -> tuple[list[Completion], list]:
        if top and not hasattr(self.engine, "top_logprobs"):
            raise api.APIError(400, f"top log-probs: {type(self.engine).__name__} has none", param="top_logprobs")
        if log is not None:
            log.inflight += 1
        try:
            completions, tops = await self.batcher.generate(rows, params, seed, top)
        finally:
            if log is not None:
                log.inflight -= 1
        self.requests += 1
        for c in completions:
            if stops:
                cut_at_stop(self.tokenizer, c, stops, self.stop_ids)
        return completions, tops

    def _idle_episodes(self) -> int:
        return sum(1 for log in list(self.episodes.values()) if log.inflight == 0)


class Streamed:
    """An answer asked for with stream: true. It is generated and recorded whole, as any request, then sent as
    server-sent events: a chat or text completion as chunks (`api.stream_chunks`, then `data: [DONE]`), a
    Response as the Responses stream's events (`responses.stream_events`); what streaming clients read."""

    def __init__(self, lines):
        self.lines = list(lines)

    @classmethod
    def wrap(cls, req, answer: dict):
        if not req.stream:
            return answer
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        chunks = api.stream_chunks(answer, include_usage)
        return cls([*(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks), "data: [DONE]\n\n"])

    async def events(self):
        for line in self.lines:
            yield line


def _finish(c: Completion, message: dict) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "stop" if c.stopped else "length"


def _legacy_logprobs(tokenizer, ids: list[int], logprobs: list[float], top) -> dict:
    tokens = [tokenizer.decode([i]) for i in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [float(x) for x in logprobs[: len(ids)]],
        "top_logprobs": [{tokenizer.decode([j]): float(v) for j, v in row} for row in top] if top else None,
        "text_offset": offsets,
    }
