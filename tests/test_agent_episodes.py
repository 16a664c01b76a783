"""Agent episodes end to end: the agents of tests/agent_fixtures.py (real `openai` clients) against the endpoint
over the small chat model and the HF engine; what they generated becomes segments and one RolloutBatch the
trainer accepts (token-in/token-out, observations masked, on-policy log-probs), failures stay with their
episode. A copy of the chat model is first taught to call the tool (examples/agents/tool_model.py, 40 steps)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlhf_core.agent.api import normalize_messages
from rlhf_core.agent.runner import AgentError, AgentRunner
from rlhf_core.agent.segments import Call, Completion, EpisodeLog, Segment, episode_batch
from rlhf_core.config import AgentConfig, validate_config
from rlhf_core.data.prompts import Prompt
from rlhf_core.env.chat import ChatFormat
from rlhf_core.reward.components import build_reward_fn
from rlhf_core.rollout import HFEngine, RolloutWorker, SamplingParams
from rlhf_core.trainer.trainer import sequence_logprobs
from rlhf_core.usercode import load_attr

FIXTURES = str(Path(__file__).parent / "agent_fixtures.py")


def runner_for(tok, stops, name: str, max_failures: int = 20, **agent) -> AgentRunner:
    cfg = AgentConfig(path=FIXTURES, name=name, **agent)
    return AgentRunner(cfg, tok, stops, max_failures=max_failures)


def prompts(n: int, meta=None) -> list[Prompt]:
    return [Prompt(i, [1, 2, 3], [], f"count to {i + 2}", str(i + 2), dict((meta or {}).get(i, {}))) for i in range(n)]


def worker_for(tok, stops, runner, sampling: SamplingParams, G: int, engine) -> RolloutWorker:
    cfg = validate_config({"agent": {"path": FIXTURES, "name": runner.cfg.name}})
    reward = build_reward_fn(cfg.reward, tok, stops, sampling.max_new_tokens)
    names = cfg.reward.column_names() + cfg.env.column_names() + cfg.agent.column_names()
    return RolloutWorker(engine, reward, sampling, G, tok.pad_token_id, component_names=names, agent=runner)


def test_tool_calls_round_trip_and_two_requests_make_one_trajectory(tool_policy):
    """The model's <tool_call> comes back as OpenAI tool_calls; the agent sends them back with the tool's
    result, and the second request's prompt is the first's ids + the generated ids + the tool message's ids
    (equal to tokenizing the whole conversation at once): one segment, the observation masked out."""
    model, tok, stops = tool_policy
    runner = runner_for(tok, stops, "calls_the_tool")
    try:
        (e,) = runner.run(HFEngine(model, stops, tok.pad_token_id), prompts(1), 1, SamplingParams(32, 0.0))
    finally:
        runner.close()
    assert e.error is None and e.reward == 1.0 and e.metrics == {"tool_calls": 1.0}
    first, second = e.calls
    call = first.replies[0]["tool_calls"][0]["function"]
    assert call == {"name": "reveal", "arguments": {}}
    tools = load_attr(FIXTURES, "TOOLS", "test")
    fmt = ChatFormat(tok, stops, tools=tools)
    generated = first.completions[0].ids
    tool_message = [{"role": "tool", "content": "3, 8, 1"}]
    observation = fmt.observation_ids(tool_message, generated[-1])
    assert second.prompt_ids == first.prompt_ids + generated + observation
    conversation = normalize_messages(second.messages)  # the agent's messages, tool_calls as the client sent them
    assert conversation[1]["tool_calls"][0]["function"] == call
    assert fmt.prompt_ids(conversation) == second.prompt_ids  # the same ids as the whole conversation at once
    assert len(e.segments) == 1 and e.prefix_breaks == 0
    (s,) = e.segments
    assert s.prompt_ids == first.prompt_ids
    answer = second.completions[0].ids
    assert s.ids == generated + observation + answer
    assert s.model == [True] * len(generated) + [False] * len(observation) + [True] * len(answer)


def test_a_forced_tool_choice_makes_the_call_and_trains_only_what_the_model_wrote(tool_policy):
    """tool_choice "required" (smolagents' ToolCallingAgent, LangChain's function-calling structured output) and
    a named function: the model's turn is opened with the template's tool-call opening (and the function's
    name), so the reply is a call. The opening is part of the prompt ids (an observation: masked), the
    completion is what the model generated; the recorded turn continues like any tool call."""
    import openai

    from rlhf_core.agent.server import AgentServer

    model, tok, stops = tool_policy
    tools = load_attr(FIXTURES, "TOOLS", "test")
    question = load_attr(FIXTURES, "QUESTION", "test")
    server = AgentServer(tok, stops, model_name="tool").start()
    server.serve(HFEngine(model, stops, tok.pad_token_id))
    log = EpisodeLog("forced", {})
    server.open_episode(log)
    try:
        c = openai.OpenAI(base_url=server.episode_url("forced"), api_key=server.key, max_retries=0)
        messages = [{"role": "user", "content": question}]
        named = {"type": "function", "function": {"name": "reveal"}}
        for choice in ("required", named):
            r = c.chat.completions.create(
                model="m", messages=messages, tools=tools, tool_choice=choice, max_tokens=32, temperature=0
            )
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
            assert r.choices[0].message.tool_calls[0].function.name == "reveal"
        fmt = ChatFormat(tok, stops, tools=tools)
        for call, prefill in zip(log.calls, ("<tool_call>\n", '<tool_call>\n{"name": "reveal", "arguments":')):
            opening = tok(prefill, add_special_tokens=False)["input_ids"]
            assert call.prompt_ids == fmt.prompt_ids(messages) + opening
            assert not tok.decode(call.completions[0].ids).startswith("<tool_call>")  # the model wrote the rest
        assert log.segments[0].prompt_ids == log.calls[0].prompt_ids  # the opening: prompt, never trained
    finally:
        server.close_episode("forced")
        server.close()


def test_the_responses_api_round_trips_a_tool_call_recorded_as_the_chat_path_records_it(tool_policy):
    """POST /v1/responses (the Agents SDK's default model, the openai client's responses.create): the model's
    tool call is a function_call item; sending it back with a function_call_output (the whole input, or only the
    output after previous_response_id) continues the recorded conversation exactly as the chat path does: the
    second prompt is the first's ids + the generated ids + the tool message's ids, one segment. stream: true
    gives the Responses events ending in response.completed with the same output; text.format json and an
    unknown previous_response_id are 400s naming the field."""
    import openai

    from rlhf_core.agent.server import AgentServer

    model, tok, stops = tool_policy
    chat_tools = load_attr(FIXTURES, "TOOLS", "test")
    tools = [{"type": "function", **t["function"]} for t in chat_tools]  # the Responses API's flat form
    question = load_attr(FIXTURES, "QUESTION", "test")
    server = AgentServer(tok, stops, model_name="tool").start()
    server.serve(HFEngine(model, stops, tok.pad_token_id))
    fmt = ChatFormat(tok, stops, tools=chat_tools)
    try:
        for way in ("input", "previous_response_id"):
            log = EpisodeLog(way, {})
            server.open_episode(log)
            c = openai.OpenAI(base_url=server.episode_url(way), api_key=server.key, max_retries=0)
            first = c.responses.create(
                model="m", input=question, tools=tools, max_output_tokens=32, temperature=0, instructions="Be brief."
            )
            (call,) = [item for item in first.output if item.type == "function_call"]
            assert call.name == "reveal" and first.status == "completed"
            result = {"type": "function_call_output", "call_id": call.call_id, "output": "3, 8, 1"}
            if way == "input":
                conversation = [{"role": "user", "content": question}, *[i.model_dump() for i in first.output]]
                second = c.responses.create(
                    model="m", input=[*conversation, result], tools=tools, instructions="Be brief.",
                    max_output_tokens=8, temperature=0,
                )  # fmt: skip
            else:
                second = c.responses.create(
                    model="m", input=[result], previous_response_id=first.id, tools=tools, max_output_tokens=8,
                    temperature=0,
                )  # fmt: skip
            assert second.output[0].type == "message" and second.usage.output_tokens >= 1
            server.close_episode(way)
            one, two = log.calls
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
            assert one.prompt_ids == fmt.prompt_ids(messages)
            observation = fmt.observation_ids([{"role": "tool", "content": "3, 8, 1"}], one.completions[0].ids[-1])
            assert two.prompt_ids == one.prompt_ids + one.completions[0].ids + observation, way
            assert len(log.segments) == 1 and log.prefix_breaks == 0
        c = openai.OpenAI(base_url=server.base_url, api_key=server.key, max_retries=0)
        whole = c.responses.create(model="m", input="max of 4, 9, 2?", max_output_tokens=6, temperature=0)
        events = list(c.responses.create(model="m", input="max of 4, 9, 2?", max_output_tokens=6, temperature=0,
                                         stream=True))  # fmt: skip
        assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        delta = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert delta == whole.output_text == events[-1].response.output_text
        assert events[-1].response.status == whole.status
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model="m", input="x", text={"format": {"type": "json_object"}})
        assert err.value.body["param"] == "text.format"
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model="m", input="x", previous_response_id="resp_nope")
        assert err.value.body["param"] == "previous_response_id"
    finally:
        server.close()


def test_an_openai_agents_sdk_agent_with_its_defaults_is_one_recorded_episode(tool_policy):
    """The OpenAI Agents SDK (openai-agents) unchanged: its default Responses model on the episode's client, a
    function tool the SDK runs itself. The model's call comes back as a function_call, the SDK sends the tool's
    output, and the two requests are one segment whose second prompt extends the first by the generated ids and
    the tool message's ids, as with the chat API."""
    import copy

    model, tok, stops = tool_policy
    model = copy.deepcopy(model)  # taught here to end its answer after the tool's output too (the SDK refuses an
    tool_model = str(Path(__file__).resolve().parents[1] / "examples" / "agents" / "tool_model.py")  # incomplete)
    torch.manual_seed(0)
    pairs = load_attr(tool_model, "examples", "test")(tok, stops, 16, 0, 2)  # turn 1 and turn 2 in turn
    load_attr(tool_model, "supervised", "test")(model, pairs, 60, 1e-2, 4)
    runner = runner_for(tok, stops, "agents_sdk")
    try:
        (e,) = runner.run(HFEngine(model, stops, tok.pad_token_id), prompts(1), 1, SamplingParams(32, 0.0))
    finally:
        runner.close()
    assert e.error is None and e.metrics == {"tool_calls": 1.0}, e.error
    first, second = e.calls
    assert first.replies[0]["tool_calls"][0]["function"] == {"name": "reveal", "arguments": {}}
    # the SDK's tool arrives as the same chat tool (its schema, key order included) as the chat fixture's TOOLS
    assert json.loads(first.tools) == load_attr(FIXTURES, "TOOLS", "test")
    fmt = ChatFormat(tok, stops, tools=load_attr(FIXTURES, "TOOLS", "test"))
    assert first.prompt_ids == fmt.prompt_ids(
        [
            {"role": "user", "content": load_attr(FIXTURES, "QUESTION", "test")},
        ]
    )
    generated = first.completions[0].ids
    observation = fmt.observation_ids([{"role": "tool", "content": "3, 8, 1"}], generated[-1])
    assert second.prompt_ids == first.prompt_ids + generated + observation
    assert len(e.segments) == 1 and e.prefix_breaks == 0


def test_a_two_request_episode_trains_on_policy(tool_policy):
    """Sampled (temperature 1, top-p 0.9) through the rollout worker: each episode is one row, its model tokens
    trained on with the engine's log-probs, which the trainer's recomputation matches (ratio 1 within 1e-5);
    observation tokens are attended to and masked out of the loss."""
    model, tok, stops = tool_policy
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9)
    runner = runner_for(tok, stops, "two_requests")
    worker = worker_for(tok, stops, runner, sampling, 2, HFEngine(model, stops, tok.pad_token_id, seed=3))
    try:
        batch, components = worker.rollout(prompts(2))
        groups = runner.split(batch)
    finally:
        worker.close()
    assert len(batch) == 4 and [len(g) for g in groups] == [2, 2]
    for e in runner.last_episodes:
        assert e.error is None and e.requests == 2 and len(e.segments) == 1 and e.prefix_breaks == 0
    assert batch.rewards.tolist() == [1.0] * 4
    assert components["agent/requests_mean"].tolist() == [2.0] * 4
    observed = batch.response_mask & ~batch.loss_mask
    assert observed.any(-1).all() and (batch.loss_mask & ~batch.response_mask).sum() == 0
    assert batch.behavior_logprobs[observed].abs().sum() == 0
    with torch.no_grad():
        logps, _ = sequence_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, sampling=sampling
        )
    ratio = torch.exp(logps[batch.loss_mask] - batch.behavior_logprobs[batch.loss_mask])
    assert float((ratio - 1).abs().max()) <= 1e-5


def test_a_rewritten_history_starts_a_second_segment(tool_policy):
    model, tok, stops = tool_policy
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    runner = runner_for(tok, stops, "rewrites_history")
    worker = worker_for(tok, stops, runner, sampling, 2, HFEngine(model, stops, tok.pad_token_id, seed=0))
    try:
        batch, components = worker.rollout(prompts(1))
    finally:
        worker.close()
    for e in runner.last_episodes:
        assert e.requests == 2 and len(e.segments) == 2 and e.prefix_breaks == 1
        assert [s.requests for s in e.segments] == [1, 1] and e.metrics == {"success": 1.0}
    # block-major: rows 0-1 the episodes' first segments, rows 2-3 their second; every row the reward 0.5
    assert len(batch) == 4 and batch.rewards.tolist() == [0.5] * 4
    assert components["agent/prefix_breaks"].tolist()[:2] == [1.0, 1.0]
    assert all(math.isnan(v) for v in components["agent/prefix_breaks"].tolist()[2:])  # per episode, once
    assert batch.loss_mask.any(-1).all() and not (batch.response_mask & ~batch.loss_mask).any()


def test_segments_of_unequal_episodes_keep_per_episode_advantages():
    """Block-major rows with a filler: every G contiguous rows hold the G episodes' rewards once, so the group
    advantages per block are the episodes' own."""
    from rlhf_core.algorithms.advantages import advantages_from_config
    from rlhf_core.config import AlgorithmConfig

    p = Prompt(5, [7, 8], [])
    a, b = EpisodeLog("a", {}, p), EpisodeLog("b", {}, p)
    for log, reward, prompts_ in ((a, 1.0, ([7, 8], [9, 9])), (b, 0.0, ([7, 8],))):
        log.reward = reward
        for ids in prompts_:
            log.record(Call(ids, [Completion([4, 2], [-0.5, -0.25], [3, 3], True)]))
    assert len(a.segments) == 2 and a.prefix_breaks == 1 and len(b.segments) == 1
    batch, owners = episode_batch([[a, b]], 0, 3)
    assert [(e.eid, first) for e, first in owners] == [("a", True), ("b", True), ("a", False), ("b", False)]
    assert batch.loss_mask.tolist()[3] == [False, False] and batch.loss_mask[:3].all()
    assert batch.group_ids.tolist() == [0, 0, 0, 0] and batch.prompt_uids.tolist() == [5] * 4
    rewards = torch.tensor([e.reward for e, _ in owners])
    adv = advantages_from_config(AlgorithmConfig(), rewards.view(-1, 2)).reshape(-1)
    assert adv[0] == adv[2] and adv[1] == adv[3] and adv[0] > 0 > adv[1]
    # a segment extended by a later request: the observation between gets the version before it
    s = Segment([1])
    s.extend([], Completion([2], [-1.0], [4]))
    s.extend([5, 6], Completion([3], [-2.0], [6]))
    assert s.versions == [4, 4, 4, 6] and s.model == [True, False, False, True]


def test_a_reward_posted_to_the_endpoint(tool_policy):
    model, tok, stops = tool_policy
    engine = HFEngine(model, stops, tok.pad_token_id)
    runner = runner_for(tok, stops, "posts_reward", kwargs={"value": 0.25})
    try:
        episodes = runner.run(engine, prompts(2), 1, SamplingParams(3, 0.0))
        assert [e.reward for e in episodes] == [0.25, 0.25] and all(e.error is None for e in episodes)
        runner.fn = load_attr(FIXTURES, "returns_nothing", "test")
        runner.cfg.kwargs = {}
        (e,) = runner.run(engine, prompts(1), 1, SamplingParams(3, 0.0))
        assert "posted no reward" in e.error and runner.errors == 1
    finally:
        runner.close()
    runner = runner_for(tok, stops, "two_requests", max_requests=1)  # the second request is refused
    try:
        (e,) = runner.run(engine, prompts(1), 1, SamplingParams(3, 0.0))
        assert "BadRequestError" in e.error and "agent.max_requests=1" in e.error and e.requests == 1
    finally:
        runner.close()


def test_an_agent_that_raises_is_scored_agent_error_reward_and_trains(tool_policy, caplog):
    """agent.error_reward: the episodes whose agent raised (as a framework does on malformed model output) keep what
    they generated and train with that reward instead of failing; they do not count toward the failures in a row
    that stop the run (two in a row here would, with max_failures 2); the error is printed once for the batch
    with how many episodes it ended. Without error_reward the same episodes fail (the test below)."""
    import logging

    model, tok, stops = tool_policy
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
    runner = runner_for(tok, stops, "hangs_on_some", timeout_s=30.0, max_failures=2, error_reward=-1.0)
    worker = worker_for(tok, stops, runner, sampling, 2, HFEngine(model, stops, tok.pad_token_id))
    try:
        with caplog.at_level(logging.WARNING, logger="rlhf_core.agent"):
            batch, _ = worker.rollout(prompts(2, {1: {"boom": True}}))
        assert batch.prompt_uids.tolist() == [0, 0, 1, 1]  # both groups train
        assert batch.rewards.tolist() == [1.0, 1.0, -1.0, -1.0]
        assert batch.loss_mask[2:].sum() > 0  # the raising episodes' generated tokens are trained
        assert [e.error for e in runner.last_episodes] == [None] * 4
        assert [e.raised for e in runner.last_episodes] == [None, None, "ValueError: boom", "ValueError: boom"]
        stats = worker.stats()
        assert stats["agent/errors"] == 0 and stats["agent/errors_rewarded"] == 2
        lines = [r.getMessage() for r in caplog.records if "boom" in r.getMessage()]
        assert lines == [
            "agent hangs_on_some: 2 of 4 episode(s) raised (scored agent.error_reward): ValueError: boom"
        ], lines
    finally:
        worker.close()


def test_an_agent_that_closes_its_client_closes_no_other_episodes_connections(tool_policy):
    """Every episode's client shares the runner's one connection pool; an agent that closes its client (`async with
    client:`) leaves the pool open: every episode of two batches, all closing their clients, ends well."""
    model, tok, stops = tool_policy
    runner = runner_for(tok, stops, "closes_its_client")
    engine = HFEngine(model, stops, tok.pad_token_id)
    try:
        for _ in range(2):
            episodes = runner.run(engine, prompts(4), 2, SamplingParams(4, 1.0))
            assert [e.error for e in episodes] == [None] * 8 and [e.reward for e in episodes] == [1.0] * 8
        assert runner._http is not None and not runner._http[1].is_closed  # one pool, still open
    finally:
        runner.close()
    assert runner._http is None


def test_an_agent_that_hangs_or_raises_fails_its_episode_alone(tool_policy):
    """Group 0's agents hang past agent.timeout_s, group 1's raise; group 2 trains. Counted in agent/errors and
    agent/timeouts; enough failures in a row stop the run with the agent's error."""
    model, tok, stops = tool_policy
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
    runner = runner_for(tok, stops, "hangs_on_some", timeout_s=1.0, max_failures=5)
    worker = worker_for(tok, stops, runner, sampling, 2, HFEngine(model, stops, tok.pad_token_id))
    try:
        batch, _ = worker.rollout(prompts(3, {0: {"hang": True}, 1: {"boom": True}}))
        assert len(batch) == 2 and batch.prompt_uids.tolist() == [2, 2]
        errors = [e.error for e in runner.last_episodes]
        assert [e.timed_out for e in runner.last_episodes] == [True, True, False, False, False, False]
        assert "timeout_s=1" in errors[0] and errors[2] == "ValueError: boom" and errors[4:] == [None, None]
        assert worker.stats()["agent/errors"] == 4 and worker.stats()["agent/timeouts"] == 2
        with pytest.raises(AgentError, match="failed 5 episodes in a row.*boom"):
            worker.rollout(prompts(3, {0: {"boom": True}, 1: {"boom": True}, 2: {"boom": True}}))
    finally:
        worker.close()
