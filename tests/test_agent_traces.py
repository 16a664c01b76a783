"""Agent episodes as MLflow traces (docs/agents.md): a real held-out evaluation of the agents of
tests/agent_fixtures.py against the endpoint (the tool-calling chat model), logged to a real SQLite MLflow store
and read back: one trace per episode, one span per request with its token counts, versions, latency and
whether it broke the prefix, the reward and the episode's outcome on the root."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_core.agent.runner import AgentRunner, episode_record
from rlhf_core.agent.segments import Call, Completion, EpisodeLog
from rlhf_core.config import AgentConfig
from rlhf_core.data.prompts import Prompt
from rlhf_core.rollout import HFEngine, SamplingParams
from rlhf_core.usercode import load_attr
from tracking.traces import EVAL_TRAJECTORIES, trace_evaluation

FIXTURES = str(Path(__file__).parent / "agent_fixtures.py")
VERSION = 7  # the engine's weights: every generated token's version


def prompts(n: int, meta=None) -> list[Prompt]:
    return [Prompt(i, [1, 2, 3], [], f"count to {i + 2}", str(i + 2), dict((meta or {}).get(i, {}))) for i in range(n)]


@pytest.fixture(scope="module")
def evaluated(tool_policy):
    """Three held-out evaluations with the chat model taught to call `reveal` (conftest's
    tool_policy): `calls_the_tool` on 2 rows (2 requests each, a tool call between), `rewrites_history` on 1 (its
    second request breaks the prefix), `hangs_on_some` on a 'boom' row (one request, then the agent raises).
    name -> (the evaluation's result, its EpisodeLogs)."""
    model, tok, stops = tool_policy
    engine = HFEngine(model, stops, tok.pad_token_id, version=VERSION)
    results = {}
    for name, rows in [
        ("calls_the_tool", prompts(2)),
        ("rewrites_history", prompts(1)),
        ("hangs_on_some", prompts(1, {0: {"boom": True}})),
    ]:
        runner = AgentRunner(AgentConfig(path=FIXTURES, name=name, timeout_s=60), tok, stops)
        try:
            results[name] = (runner.evaluate(engine, rows, 32), runner.last_episodes)
        finally:
            runner.close()
    return results


def spans_of(trace) -> tuple:
    """(the root span, the request spans in order, the other spans by name)."""
    root = next(s for s in trace.data.spans if s.parent_id is None)
    requests = sorted(
        (s for s in trace.data.spans if s.name.startswith("request ")), key=lambda s: int(s.name.split()[1])
    )
    others = {s.name: s for s in trace.data.spans if s is not root and s not in requests}
    return root, requests, others


def test_each_agent_episode_is_a_trace_whose_spans_are_its_requests(evaluated, mlflow_db):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{mlflow_db}")
    experiment_id = client.create_experiment("agent-traces")
    run_id = client.create_run(experiment_id).info.run_id
    tracker = SimpleNamespace(client=client, experiment_id=experiment_id, run_id=run_id)
    records, episodes = [], []
    for result, logs in evaluated.values():
        records += result[EVAL_TRAJECTORIES]
        episodes += logs
    assert len(records) == len(episodes) == 4
    result = {"eval/accuracy": 0.5, EVAL_TRAJECTORIES: records}
    ids = trace_evaluation(tracker, result, step=5)
    assert len(ids) == 4 and EVAL_TRAJECTORIES not in result
    traces = {t.info.trace_id: t for t in client.search_traces(locations=[experiment_id], run_id=run_id)}
    assert sorted(traces) == sorted(ids)

    for trace_id, e in zip(ids, episodes):
        root, requests, _ = spans_of(traces[trace_id])
        assert root.span_type == "AGENT" and root.name == f"episode {ids.index(trace_id)} at step 5"
        assert len(requests) == e.requests >= 1
        attrs = root.attributes
        assert (attrs["reward"], attrs["requests"], attrs["error"]) == (e.reward, e.requests, e.error)
        assert (attrs["prefix_breaks"], attrs["segments"]) == (e.prefix_breaks, len(e.segments))
        assert (attrs["policy_version_first"], attrs["policy_version_last"], attrs["trained_at"]) == (
            VERSION,
            VERSION,
            "eval",
        )
        for span, call in zip(requests, e.calls):
            a = span.attributes
            assert span.span_type == "CHAT_MODEL" and span.parent_id == root.span_id
            assert a["prompt_tokens"] == len(call.prompt_ids) > 0
            assert a["completion_tokens"] == len(call.completions[0].ids) > 0 and a["choices"] == 1
            assert (a["policy_version_first"], a["policy_version_last"]) == (VERSION, VERSION)
            assert a["latency_s"] == pytest.approx(call.latency_s) and 0 < a["latency_s"] < 60
            assert (a["prefix_break"], a["new_segment"]) == (call.prefix_break, call.new_segment)
            # timed as the endpoint timed it, inside the episode's root span
            assert span.start_time_ns == call.started_ns >= root.start_time_ns
            assert span.end_time_ns - span.start_time_ns == pytest.approx(call.latency_s * 1e9, abs=1e3)
            assert span.outputs["content"] == (call.replies[0].get("content") or "")

    # calls_the_tool: the reply's tool call is a TOOL span, its result the next request's new (tool) message
    for trace_id, e in zip(ids[:2], episodes[:2]):
        root, (first, second), others = spans_of(traces[trace_id])
        assert (e.error, e.reward, root.outputs["metrics"]) == (None, 1.0, {"tool_calls": 1.0})
        assert first.inputs["messages"] == [{"role": "user", "content": load_attr(FIXTURES, "QUESTION", "test")}]
        assert first.outputs["tool_calls"] == [{"name": "reveal", "arguments": {}}]
        tool = others["tool reveal"]
        assert tool.span_type == "TOOL" and tool.parent_id == first.span_id
        assert tool.inputs == {"arguments": {}} and tool.outputs == {"result": "3, 8, 1"}
        assert second.inputs["messages"] == [{"role": "tool", "content": "3, 8, 1"}]
        assert not first.attributes["prefix_break"] and first.attributes["new_segment"]
        assert not second.attributes["prefix_break"] and not second.attributes["new_segment"]
        assert str(traces[trace_id].info.state).endswith("OK")

    # rewrites_history: the second request sends the whole rewritten conversation and starts a segment
    root, (first, second), _ = spans_of(traces[ids[2]])
    assert (root.attributes["prefix_breaks"], root.attributes["segments"], root.attributes["reward"]) == (1, 2, 0.5)
    assert second.attributes["prefix_break"] and second.attributes["new_segment"]
    assert [m["role"] for m in second.inputs["messages"]] == ["user", "assistant", "user"]
    assert second.inputs["messages"][1]["content"] == "something else"

    # hangs_on_some on a 'boom' row: its one request, then the agent raised: an ERROR trace with the error
    trace = traces[ids[3]]
    root, requests, _ = spans_of(trace)
    assert str(trace.info.state).endswith("ERROR") and len(requests) == 1
    assert (root.attributes["error"], root.attributes["ended"]) == ("ValueError: boom", "failed: error")
    assert root.attributes["reward"] is None and root.outputs["error"] == "ValueError: boom"


def test_a_request_record_keeps_versions_across_a_weight_update():
    """Recorded by hand from the runner's dataclasses: a text completion whose tokens span two versions (a
    partial rollout), then a request that breaks the prefix; an episode that failed before any request."""
    e = EpisodeLog("e0", {"q": 1})
    e.record(
        Call(
            [1, 2],
            [Completion([5, 6, 7], [0.0] * 3, [3, 3, 4])],
            text="hi",
            texts=["abc"],
            started_ns=10,
            latency_s=0.5,
        )
    )
    e.record(Call([9], [Completion([8], [0.0], [4])], text="other", texts=["d"]))
    e.reward = 0.0
    rec = episode_record(e)
    first, second = rec["requests"]
    assert first["kind"] == "text" and first["messages"] == [{"role": "user", "content": "hi"}]
    assert (first["prompt_tokens"], first["completion_tokens"]) == (2, 3)
    assert (first["policy_version_first"], first["policy_version_last"], first["latency_s"]) == (3, 4, 0.5)
    assert (first["new_segment"], first["prefix_break"]) == (True, False)
    assert (second["new_segment"], second["prefix_break"], second["latency_s"]) == (True, True, None)
    assert (rec["policy_version"], rec["policy_version_last"], rec["prefix_breaks"], rec["segments"]) == (3, 4, 1, 2)
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "user", "assistant"]  # as before
    failed = EpisodeLog("e1", {})
    failed.error, failed.timed_out = "the agent ran past agent.timeout_s=1", True
    rec = episode_record(failed)
    assert (rec["requests"], rec["ended"], rec["policy_version"]) == ([], "failed: timeout", None)


def test_each_distinct_agent_error_reaches_mlflow_once_with_its_count(tool_policy, mlflow_db, tmp_path):
    """An agent that raises on some rows: the runner's stats carry each distinct error text with how many
    episodes it ended ("failed: ..." without agent.error_reward, "raised: ..." with it); the flow's ErrorTexts
    writes them to the run's MLflow artifact agent_errors.json when they change (read back from a real SQLite
    store), with the steps they were first and last seen at."""
    from mlflow import MlflowClient

    from tracking import MlflowTracker
    from tracking.errors import ARTIFACT, ErrorTexts

    model, tok, stops = tool_policy
    engine = HFEngine(model, stops, tok.pad_token_id)
    uri = f"sqlite:///{mlflow_db}"
    mlflow = MlflowClient(uri)
    experiment = mlflow.create_experiment("errors", artifact_location=str(tmp_path / "artifacts"))
    run = mlflow.create_run(experiment)
    tracker = MlflowTracker(uri, run.info.run_id, experiment)
    errors = ErrorTexts()
    boom = {0: {"boom": True}, 2: {"boom": True}}
    for error_reward, step in ((None, 3), (0.0, 5)):
        runner = AgentRunner(AgentConfig(path=FIXTURES, name="hangs_on_some", error_reward=error_reward), tok, stops)
        try:
            runner.run(engine, prompts(3, boom), 1, SamplingParams(4, 0.0))
            texts = runner.stats()["agent_error_texts"]
        finally:
            runner.close()
        fate = "failed" if error_reward is None else "raised"
        assert texts == {f"{fate}: ValueError: boom": 2}
        assert errors.update({"rollout": [{"agent_error_texts": texts}, {}]}, tracker, step)
        assert not errors.update({"rollout": [{"agent_error_texts": texts}]}, tracker, step + 1)  # nothing new
    path = mlflow.download_artifacts(run.info.run_id, ARTIFACT, str(tmp_path / "down"))
    rows = json.loads(Path(path).read_text())
    assert rows == [
        {"error": "failed: ValueError: boom", "episodes": 2, "first_step": 3, "last_step": 3},
        {"error": "raised: ValueError: boom", "episodes": 2, "first_step": 5, "last_step": 5},
    ]
