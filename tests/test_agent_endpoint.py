"""The OpenAI-compatible endpoint (rlhf_core.agent.server) with the real `openai` client over HTTP on 127.0.0.1:
the small chat model (ChatML, byte-level BPE) and the HF engine, no mocks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from rlhf_core.agent.server import AgentServer
from rlhf_core.env.chat import ChatFormat
from rlhf_core.model.policy import load_policy, stop_token_ids
from rlhf_core.rollout import HFEngine


class CountingEngine(HFEngine):
    """HFEngine that counts its generate calls and the rows of each."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate(self, prompts, samples_per_prompt, sampling, between_steps=None):
        self.calls.append(len(prompts) * samples_per_prompt)
        return super().generate(prompts, samples_per_prompt, sampling, between_steps=between_steps)


@pytest.fixture(scope="module")
def served(chat_policy_dir):
    model, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    stops = stop_token_ids(chat_policy_dir, tok)
    engine = CountingEngine(model, stops, tok.pad_token_id, seed=0)
    server = AgentServer(tok, stops, model_name="tiny-chat", max_body_bytes=20_000).start()
    server.serve(engine)
    try:
        yield server, engine, tok, stops
    finally:
        server.close()


def client(server, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key or server.key, max_retries=0)


@pytest.mark.slow  # 6 s idle
def test_an_idle_connection_outlives_a_client_pools_keep_alive(served):
    """The endpoint keeps an idle connection open past httpx's 5 s keep-alive expiry (the pool of the openai client
    every agent uses), so a client never reuses a connection the server is closing at that moment: at uvicorn's
    default 5 s the second request on this connection found it closed."""
    import socket

    server = served[0]
    request = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.key}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)  # past httpx's keepalive_expiry and uvicorn's default keep-alive (5 s each)
        sock.sendall(request)
        again = sock.recv(65536)
        assert again.startswith(b"HTTP/1.1 200"), again[:80]


def test_a_plain_chat_request(served):
    server, engine, tok, stops = served
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny-chat"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "max of 1, 2, 3?"}]
    r = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5, temperature=0, n=2)
    assert r.object == "chat.completion" and r.system_fingerprint == "atrlhf-v0" and len(r.choices) == 2
    assert all(isinstance(ch.message.content, str) and ch.finish_reason in ("stop", "length") for ch in r.choices)
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    # the prompt is the chat template's rendering with the generation prompt, tokenized once
    fmt = ChatFormat(tok, stops)
    assert r.usage.prompt_tokens == len(fmt.prompt_ids(messages))  # once, as OpenAI counts it
    assert 1 <= r.usage.completion_tokens <= 10
    # log-probs: one entry per token the client reads; greedy picks the most likely token
    r = c.chat.completions.create(
        model="m", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = r.choices[0].logprobs.content
    assert 1 <= len(entries) <= 4 and "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
    # a seeded sampled request is reproducible; top_p and temperature are the request's own
    kwargs = dict(model="m", messages=messages, max_tokens=6, temperature=1.0, top_p=0.9, seed=7)
    a, b = (c.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2))
    assert a == b


def test_text_completions_and_stop_strings(served):
    server, engine, tok, stops = served
    c = client(server)
    r = c.completions.create(model="m", prompt=["max of 1, 2", "the answer"], max_tokens=4, temperature=0, logprobs=2)
    assert r.object == "text_completion" and len(r.choices) == 2
    assert all(len(ch.logprobs.top_logprobs[0]) == 2 for ch in r.choices if ch.logprobs.tokens)
    full = c.completions.create(model="m", prompt="max of 1, 2", max_tokens=8, temperature=0).choices[0].text
    if len(full) > 2:  # a stop string ends the text before it
        stop = full[2:4]
        cut = c.completions.create(model="m", prompt="max of 1, 2", max_tokens=8, temperature=0, stop=[stop])
        assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_wrong_key_malformed_oversized_and_unsupported_are_refused(served):
    server, *_ = served
    with pytest.raises(openai.AuthenticationError) as err:
        client(server, key="sk-wrong").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, key="sk-wrong").models.list()
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:  # a message without a role
        c.chat.completions.create(model="m", messages=[{"content": "no role"}])
    assert err.value.body["param"] == "messages[0]" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="no tools") as err:  # a forced call needs a tool to call
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required")
    assert err.value.body["param"] == "tool_choice"
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}):
        with pytest.raises(openai.BadRequestError, match="no constrained decoding") as err:  # refused, not ignored
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], response_format=fmt)
        assert err.value.body["param"] == "response_format" and err.value.body["code"] == "unsupported_parameter"
    headers = {"Authorization": f"Bearer {server.key}", "Content-Type": "application/json"}
    url = f"{server.base_url}/chat/completions"
    bad = httpx.post(url, content=b"{not json", headers=headers)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    missing = httpx.post(url, json={"model": "m"}, headers=headers)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    huge = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 30_000}]})
    assert httpx.post(url, content=huge, headers=headers).status_code == 413
    assert httpx.post(f"{server.base_url}/nowhere", json={}, headers=headers).json()["error"]["code"] == "not_found"
    closed = httpx.post(server.episode_url("nope") + "/chat/completions", json={}, headers=headers)
    assert closed.status_code == 404 and closed.json()["error"]["code"] == "episode_closed"
    long = {"model": "m", "messages": [{"role": "user", "content": "max " * 600}]}
    answer = httpx.post(url, json=long, headers=headers)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"


def test_concurrent_requests_are_generated_together(served):
    server, engine, *_ = served

    async def many():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=server.key, max_retries=0) as c:
            asks = [
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3)
                for i in range(8)
            ]
            return await asyncio.gather(*asks)

    before = len(engine.calls)
    answers = asyncio.run(many())
    assert len(answers) == 8 and all(a.choices for a in answers)
    calls = engine.calls[before:]
    assert sum(calls) == 8 and len(calls) < 8, calls  # requests that arrive together share an engine call


def test_a_text_continuation_after_a_stop_string_keeps_the_generated_ids_once(served):
    """A ReAct-style text agent: stop=[s] ends the completion at s (returned without it, generated with it); the
    agent appends s and an observation and asks again. The episode is one segment whose model tokens are the
    generated ids as generated (s's tokens included, once) and whose observation tokens are the appended text
    alone: the stop string is not tokenized a second time. A prompt that drops s is not the model's context:
    it starts a new segment (a prefix break). A request answered after its episode closed is not recorded."""
    from rlhf_core.agent.segments import EpisodeLog

    server, engine, tok, stops = served
    c = client(server)
    prompt = "max of 1, 2, 3 ="
    full = c.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert len(full) >= 4, full  # the fixture's greedy text: long enough to stop inside it
    stop = full[2:4]
    returned = full[: full.find(stop)]

    log = EpisodeLog("react", {})
    server.open_episode(log)
    agent = openai.OpenAI(base_url=server.episode_url("react"), api_key=server.key, max_retries=0)
    first = agent.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert first.choices[0].text == returned and first.choices[0].finish_reason == "stop"
    generated = list(log.calls[0].completions[0].ids)
    assert stop in tok.decode(generated)  # generated with the stop string, returned without it
    observation = " 42\n"
    agent.completions.create(model="m", prompt=prompt + returned + stop + observation, max_tokens=3, temperature=0)
    assert len(log.segments) == 1 and log.prefix_breaks == 0
    seg = log.segments[0]
    first_prompt = log.calls[0].prompt_ids
    assert seg.prompt_ids == first_prompt and seg.ids[: len(generated)] == generated
    obs_ids = seg.ids[len(generated) : len(generated) + len(seg.model) - sum(seg.model)]
    assert not any(seg.model[len(generated) : len(generated) + len(obs_ids)])
    assert tok.decode(obs_ids) == observation  # the appended text alone: the stop string is not there twice
    assert tok.decode(seg.full).count(stop) == tok.decode(first_prompt + generated).count(stop)
    # the agent dropped the stop string: not what the model saw, so a new segment
    agent.completions.create(model="m", prompt=prompt + returned + observation, max_tokens=2, temperature=0)
    assert len(log.segments) == 2 and log.prefix_breaks == 1
    server.close_episode("react")
    calls = len(log.calls)
    late = EpisodeLog("late", {})
    server.open_episode(late)
    late.close()  # the runner read the episode: a request still in flight is answered, not recorded
    assert not late.record(log.calls[0]) and late.calls == [] and len(log.calls) == calls


def test_streamed_answers_are_the_whole_answers_as_server_sent_events(served):
    """stream: true (LangChain's .stream, the Agents SDK's run_streamed, LiteLLM): the openai client's stream of
    chunks joins to the answer the same request gets unstreamed (greedy), with its finish reason and, with
    stream_options.include_usage, its usage; text completions too. Inside an episode a streamed request is
    recorded like any other."""
    from rlhf_core.agent.segments import EpisodeLog

    server, engine, tok, stops = served
    c = client(server)
    messages = [{"role": "user", "content": "max of 4, 9, 2?"}]
    whole = c.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    chunks = list(
        c.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    plain = c.completions.create(model="m", prompt="max of 1, 2", max_tokens=5, temperature=0)
    streamed = list(c.completions.create(model="m", prompt="max of 1, 2", max_tokens=5, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == plain.choices[0].text

    log = EpisodeLog("streamed", {})
    server.open_episode(log)
    try:
        agent = openai.OpenAI(base_url=server.episode_url("streamed"), api_key=server.key, max_retries=0)
        list(agent.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0, stream=True))
    finally:
        server.close_episode("streamed")
    (call,) = log.calls
    assert tok.decode(call.completions[0].ids, skip_special_tokens=True).startswith(text)
    assert len(log.segments) == 1 and sum(log.segments[0].model) == len(call.completions[0].ids)
