"""A multi-turn evaluation's episodes as MLflow traces, linked to the run.

Each traced episode (a trajectory-file record, rlhf_core.env.score.trajectory_record) becomes one trace:
its root span holds the dataset row and the outcome (reward, success, turns); under it one span per turn,
in order: the model's turns (LLM spans: the text, the step's reward, with one TOOL span per tool call the turn
made: its name, arguments and result) and the opening and the environment's observations (CHAIN spans: role
and text). The UI shows them in the run's Traces tab.

Every span, the root and each turn's, carries in its attributes where the episode's tokens came from and how
it ended: `policy_version_first` and `policy_version_last` (the versions of the weights that generated its
first and its last model token: the episode's on the root, the turn's on a model turn; they differ only with
partial rollouts; `policy_version` is the first), `trained_at` (the trainer step it was trained at, or
"eval") and `ended` ("done", "cut: max_turns", "cut: max_total_tokens" or "failed: <kind>").
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("tracking")

TRACE_STEP_TAG = "atrlhf.step"
EVAL_TRAJECTORIES = "eval/trajectories"  # the key of an evaluation's traced episodes (rlhf_core.run.evaluation)


def _short(value: Any, limit: int = 20_000) -> Any:
    return value[:limit] if isinstance(value, str) else value


def log_trajectory_traces(client, experiment_id: str, run_id: str, records: list[dict], step: int) -> list[str]:
    """One trace per record, linked to run `run_id`; returns the trace ids once they are stored.

    MLflow exports spans through this process's tracer, to the process's tracking URI: it is set to the
    client's here (in the flow's process that is the run's store already), the export is flushed, and the URI
    is put back as it was (MLflow's setter also writes MLFLOW_TRACKING_URI: left set, every later run in this
    process, a sweep's next point or a worker's next flow run, would log to this run's store)."""
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(client.tracking_uri)
    try:
        return _log_traces(mlflow, client, experiment_id, run_id, records, step)
    finally:
        mlflow.set_tracking_uri(previous)  # None unsets it


def _log_traces(mlflow, client, experiment_id: str, run_id: str, records: list[dict], step: int) -> list[str]:
    ids = []
    for k, rec in enumerate(records):
        messages = rec.get("messages", [])
        episode = {
            "trained_at": str(rec.get("trained_at", "eval")),
            "ended": rec.get("ended") or ("failed" if rec.get("error") else "done"),
        }
        first = rec.get("policy_version")
        last = rec.get("policy_version_last", first)
        root = client.start_trace(
            f"episode {k} at step {step}",
            span_type="AGENT",
            inputs={"row": rec.get("row", {})},
            attributes={
                "step": step,
                "policy_version": first,
                "policy_version_first": first,
                "policy_version_last": last,
                **episode,
            },
            tags={TRACE_STEP_TAG: str(step)},
            experiment_id=experiment_id,
            run_id=run_id,
        )
        trace_id = root.trace_id
        for i, m in enumerate(messages):
            role, text = m.get("role", ""), _short(m.get("content", ""))
            if role == "assistant":
                span = client.start_span(
                    f"turn {i}: model",
                    trace_id=trace_id,
                    parent_id=root.span_id,
                    span_type="LLM",
                    attributes={
                        "reward": m.get("reward"),
                        "policy_version": m.get("policy_version"),
                        "policy_version_first": m.get("policy_version"),
                        "policy_version_last": m.get("policy_version_last", m.get("policy_version")),
                        **episode,
                    },
                )
                results = [x.get("content", "") for x in messages[i + 1 :] if x.get("role") == "tool"]
                for j, call in enumerate(m.get("tool_calls") or []):
                    call = call if isinstance(call, dict) else {"name": str(call)}
                    tool = client.start_span(
                        f"tool {call.get('name')}",
                        trace_id=trace_id,
                        parent_id=span.span_id,
                        span_type="TOOL",
                        inputs={"arguments": call.get("arguments", {})},
                    )
                    client.end_span(
                        trace_id, tool.span_id, outputs={"result": _short(results[j]) if j < len(results) else None}
                    )
                client.end_span(trace_id, span.span_id, outputs={"text": text})
            else:
                span = client.start_span(
                    f"turn {i}: {role}",
                    trace_id=trace_id,
                    parent_id=root.span_id,
                    span_type="CHAIN",
                    inputs={"role": role},
                    attributes=episode,
                )
                client.end_span(trace_id, span.span_id, outputs={"text": text})
        client.end_trace(
            trace_id,
            outputs={
                "reward": rec.get("reward"),
                "env_rewards": rec.get("env_rewards"),
                "success": rec.get("success"),
                "turns": rec.get("turns"),
                "error": rec.get("error"),
                "ended": episode["ended"],
            },
            status="ERROR" if rec.get("error") else "OK",
        )
        ids.append(trace_id)
    mlflow.flush_trace_async_logging()
    return ids


def trace_evaluation(tracker, result: dict, step: int) -> list[str]:
    """Pop an evaluation result's traced episodes (EVAL_TRAJECTORIES; present with an environment) and log
    them as traces of the tracker's run. A failure to log is a warning, never the run's end."""
    records = result.pop(EVAL_TRAJECTORIES, None)
    if not records:
        return []
    try:
        return log_trajectory_traces(tracker.client, tracker.experiment_id, tracker.run_id, records, step)
    except Exception as exc:  # noqa: BLE001 - traces are for reading; the run goes on without them
        log.warning("could not log %d episodes as MLflow traces at step %d: %s", len(records), step, exc)
        return []
