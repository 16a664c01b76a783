"""A multi-turn evaluation's episodes as MLflow traces of the run (real SQLite MLflow store)."""

from __future__ import annotations

from types import SimpleNamespace

from tracking.traces import EVAL_TRAJECTORIES, trace_evaluation

RECORD = {
    "row": {"question": "2 + 3?", "answer": "5"},
    "messages": [
        {"role": "user", "content": "2 + 3?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
            "reward": 0.0,
            "policy_version": 7,
            "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5.", "reward": 1.0, "policy_version": 7, "tool_calls": []},
    ],
    "env_rewards": [0.0, 1.0],
    "reward": 1.0,
    "turns": 2,
    "success": True,
    "error": None,
    "policy_version": 7,
}


def test_evaluation_episodes_become_traces_linked_to_the_run(mlflow_db):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{mlflow_db}")
    experiment_id = client.create_experiment("traces")
    run_id = client.create_run(experiment_id).info.run_id
    tracker = SimpleNamespace(client=client, experiment_id=experiment_id, run_id=run_id)
    result = {"eval/accuracy": 1.0, EVAL_TRAJECTORIES: [RECORD, {**RECORD, "error": "step: boom"}]}
    ids = trace_evaluation(tracker, result, step=25)
    assert len(ids) == 2 and EVAL_TRAJECTORIES not in result  # popped: the rest is metrics
    traces = client.search_traces(experiment_ids=[experiment_id], run_id=run_id)
    assert sorted(t.info.trace_id for t in traces) == sorted(ids)
    trace = next(t for t in traces if t.info.trace_id == ids[0])
    spans = {s.name: s for s in trace.data.spans}
    assert set(spans) == {
        "episode 0 at step 25",
        "turn 0: user",
        "turn 1: model",
        "tool add",
        "turn 2: tool",
        "turn 3: model",
    }
    assert spans["turn 1: model"].attributes["policy_version"] == 7
    assert spans["turn 3: model"].attributes["reward"] == 1.0
    assert spans["turn 3: model"].outputs == {"text": "It is 5."}
    assert spans["tool add"].inputs == {"arguments": {"a": 2, "b": 3}} and spans["tool add"].outputs == {"result": "5"}
    assert spans["tool add"].parent_id == spans["turn 1: model"].span_id
    assert spans["episode 0 at step 25"].outputs["success"] is True
    assert str(next(t for t in traces if t.info.trace_id == ids[1]).info.state).endswith("ERROR")
    assert trace_evaluation(tracker, {"eval/accuracy": 1.0}, step=26) == []  # single-turn runs: nothing
