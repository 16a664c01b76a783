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

An agent episode's record (rlhf_core.agent.runner.episode_record) also carries `requests`, one entry per
request the agent made to the endpoint: its trace has one span per request instead ("request i", CHAT_MODEL;
LLM for a text completion), timed as the endpoint timed it (from its arrival to its answer), under a root
that starts with the first request. A request span's inputs are the messages new in that request (all of
them when the agent rewrote the history), its outputs the reply (content and tool calls, one TOOL span each
with its arguments and the result the next request sent back); its attributes `prompt_tokens`,
`completion_tokens` (every choice's), `choices`, `policy_version_first` / `policy_version_last`, `latency_s`,
`new_segment` and `prefix_break` (it started a segment of its own: the agent rewrote the history). The root
adds `reward`, `requests`, `prefix_breaks`, `segments`, `latency_s` (the episode's) and `error`; the trace is
ERROR when the episode failed (`ended` "failed: error" or "failed: timeout").
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

log = logging.getLogger("tracking")

TRACE_STEP_TAG = "atrlhf.step"
EVAL_TRAJECTORIES = "eval/trajectories"  # the key of an evaluation's traced episodes (rlhf_core.env.score)
REQUEST_ATTRIBUTES = (  # an agent request's span attributes (rlhf_core.agent.runner.request_record)
    "prompt_tokens",
    "completion_tokens",
    "choices",
    "policy_version_first",
    "policy_version_last",
    "latency_s",
    "new_segment",
    "prefix_break",
)


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


def _agent_attributes(rec: dict, requests: list[dict]) -> dict:
    return {
        "reward": rec.get("reward"),
        "requests": len(requests),
        "prefix_breaks": rec.get("prefix_breaks"),
        "segments": rec.get("segments"),
        "latency_s": rec.get("latency_s"),
        "error": rec.get("error"),
    }


def _first_start(requests: Optional[list[dict]]) -> Optional[int]:
    """An agent episode's root span starts with its first request (the spans are timed as the endpoint timed
    the requests); otherwise now."""
    starts = [r["started_ns"] for r in requests or [] if r.get("started_ns") is not None]
    return min(starts) if starts else None


def _log_traces(mlflow, client, experiment_id: str, run_id: str, records: list[dict], step: int) -> list[str]:
    ids = []
    for k, rec in enumerate(records):
        messages, requests = rec.get("messages", []), rec.get("requests")
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
                **(_agent_attributes(rec, requests) if requests is not None else {}),
            },
            tags={TRACE_STEP_TAG: str(step)},
            experiment_id=experiment_id,
            run_id=run_id,
            start_time_ns=_first_start(requests),
        )
        trace_id = root.trace_id
        if requests is not None:
            _request_spans(client, trace_id, root.span_id, requests, episode)
        else:
            _message_spans(client, trace_id, root.span_id, messages, episode)
        client.end_trace(
            trace_id,
            outputs={
                "reward": rec.get("reward"),
                "env_rewards": rec.get("env_rewards"),
                "success": rec.get("success"),
                "turns": rec.get("turns"),
                "error": rec.get("error"),
                "ended": episode["ended"],
                **({"metrics": rec.get("metrics") or {}, "requests": len(requests)} if requests is not None else {}),
            },
            status="ERROR" if rec.get("error") else "OK",
        )
        ids.append(trace_id)
    mlflow.flush_trace_async_logging()
    return ids


def _message_spans(client, trace_id: str, root_id: str, messages: list[dict], episode: dict) -> None:
    """An environment episode: one span per message (the module doc)."""
    for i, m in enumerate(messages):
        role, text = m.get("role", ""), _short(m.get("content", ""))
        if role == "assistant":
            span = client.start_span(
                f"turn {i}: model",
                trace_id=trace_id,
                parent_id=root_id,
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
            _tool_spans(client, trace_id, span.span_id, m.get("tool_calls") or [], results)
            client.end_span(trace_id, span.span_id, outputs={"text": text})
        else:
            span = client.start_span(
                f"turn {i}: {role}",
                trace_id=trace_id,
                parent_id=root_id,
                span_type="CHAIN",
                inputs={"role": role},
                attributes=episode,
            )
            client.end_span(trace_id, span.span_id, outputs={"text": text})


def _tool_spans(client, trace_id: str, parent_id: str, calls: list, results: list, at_ns=None) -> None:
    """One TOOL span per tool call under `parent_id`: its arguments in, the matching tool result out (the j-th
    tool message after the call; None when the episode ended first). `at_ns`: the spans' time (None = now)."""
    for j, call in enumerate(calls):
        call = call if isinstance(call, dict) else {"name": str(call)}
        tool = client.start_span(
            f"tool {call.get('name')}",
            trace_id=trace_id,
            parent_id=parent_id,
            span_type="TOOL",
            inputs={"arguments": call.get("arguments", {})},
            start_time_ns=at_ns,
        )
        result = _short(results[j]) if j < len(results) else None
        client.end_span(trace_id, tool.span_id, outputs={"result": result}, end_time_ns=at_ns)


def _request_spans(client, trace_id: str, root_id: str, requests: list[dict], episode: dict) -> None:
    """An agent episode: one span per request to the endpoint, timed as the endpoint timed it (the module doc),
    with one TOOL span per tool call of its reply (the result: the next request's tool messages, in order)."""
    for i, req in enumerate(requests):
        started, latency = req.get("started_ns"), req.get("latency_s")
        ended = started + int(latency * 1e9) if started is not None and latency is not None else None
        span = client.start_span(
            f"request {i}",
            trace_id=trace_id,
            parent_id=root_id,
            span_type="CHAT_MODEL" if req.get("kind", "chat") == "chat" else "LLM",
            inputs={"messages": [{**m, "content": _short(m.get("content", ""))} for m in req.get("messages", [])]},
            attributes={
                **{k: req.get(k) for k in REQUEST_ATTRIBUTES},
                "policy_version": req.get("policy_version_first"),
                **episode,
            },
            start_time_ns=started,
        )
        reply = req.get("reply") or {}
        following = requests[i + 1]["messages"] if i + 1 < len(requests) else []
        results = [m.get("content", "") for m in following if m.get("role") == "tool"]
        _tool_spans(client, trace_id, span.span_id, reply.get("tool_calls") or [], results, ended)
        outputs = {"content": _short(reply.get("content", "")), "tool_calls": reply.get("tool_calls") or []}
        client.end_span(trace_id, span.span_id, outputs=outputs, end_time_ns=ended)


def trace_evaluation(tracker, result: dict, step: int) -> list[str]:
    """Pop an evaluation result's traced episodes (EVAL_TRAJECTORIES; present with an environment or an
    agent) and log them as traces of the tracker's run. A failure to log is a warning, never the run's end."""
    records = result.pop(EVAL_TRAJECTORIES, None)
    if not records:
        return []
    try:
        return log_trajectory_traces(tracker.client, tracker.experiment_id, tracker.run_id, records, step)
    except Exception as exc:  # noqa: BLE001 - traces are for reading; the run goes on without them
        log.warning("could not log %d episodes as MLflow traces at step %d: %s", len(records), step, exc)
        return []
