"""Trajectory files: written from trajectories, scored again with the environment's rewards (`atrlhf score`
with an `env:` section). No torch.

A trajectory file is JSONL, one trajectory a line:

    {"row": {...the dataset row reset saw...},
     "messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...],
     "env_rewards": [...], "reward": ..., "turns": ..., "success": ..., "policy_version": ...}

Only `messages` is required (`row` defaults to {}; without it reset sees an empty row). Scoring replays it:
a fresh environment instance is reset with the row, then stepped with each assistant message's content in
order, until it says done; the line's score is the sum of the step rewards (reward/env), with the turns
stepped, info["success"] where given, and whether each observation the environment gave equals the one
recorded after that turn (an environment that draws at random gives other observations, and so may give
other rewards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rlhf_core.env.pool import EnvPool

REPLAY_POLL_S = 1.0
EVAL_TRAJECTORIES = "eval/trajectories"  # an evaluation's traced episodes, as trajectory records (not a metric)
TRACED_TRAJECTORIES = 4  # episodes of each evaluation logged as MLflow traces


def trajectory_record(t, trained_at: int | str = "eval") -> dict:
    """A trajectory (rlhf_core.rollout.multiturn_batch.Trajectory) as one line of a trajectory file. trained_at: the
    trainer step it was trained at, or "eval" for a held-out evaluation's episode."""
    messages = []
    for turn in t.transcript:
        message = {"role": turn.role, "content": turn.text}
        if turn.role == "assistant":  # what a trace shows beside the text
            last = turn.version if turn.last_version is None else turn.last_version
            message.update(
                {
                    "reward": turn.reward,
                    "policy_version": turn.version,
                    "policy_version_last": last,
                    "tool_calls": turn.tool_calls,
                }
            )
        messages.append(message)
    first, last = t.version_span()
    return {
        "row": _jsonable(t.row),
        "messages": messages,
        "env_rewards": list(t.env_rewards),
        "reward": t.reward,
        "turns": t.turns,
        "tool_calls": t.tool_calls,
        "success": t.success,
        "truncated": t.truncated,
        "cut": t.cut,
        "finish_reward": t.finish_reward,
        "error": t.error,
        "error_kind": t.error_kind,
        "policy_version": first,
        "policy_version_last": last,
        "trained_at": trained_at,
        "ended": t.ending,
    }


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return {k: str(v) for k, v in value.items()} if isinstance(value, dict) else str(value)


def write_trajectories(path: str | Path, trajectories) -> Path:
    """Write trajectories as a trajectory file (JSONL)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(trajectory_record(t)) + "\n")
    return path


def read_trajectories(path: str | Path) -> list[dict]:
    """[{'where', 'row', 'messages'}] of a trajectory file; ValueError naming file:line for a bad line."""
    out = []
    text = Path(path).read_text(encoding="utf-8")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"{where}: 'messages' must be a list of {{'role', 'content'}} messages")
        row = record.get("row", {})
        if not isinstance(row, dict):
            raise ValueError(f"{where}: 'row' must be an object (the dataset row reset sees)")
        out.append({"where": where, "line": lineno, "row": row, "messages": messages})
    if not out:
        raise ValueError(f"{path} has no trajectories")
    return out


def score_trajectories(env_cfg, records: list[dict], workers: int = 1) -> list[dict]:
    """Replay each record in a fresh environment; per record: env_reward, turns, success, observations_match,
    error (None or the failing call's error)."""
    pool = EnvPool(
        env_cfg.class_path,
        env_cfg.class_name,
        env_cfg.instance_kwargs(),
        workers,
        env_cfg.step_timeout_s,
        env_cfg.max_observation_chars,
    )
    results = [
        {"env_reward": 0.0, "turns": 0, "success": None, "observations_match": True, "done": False, "error": None}
        for _ in records
    ]
    actions = [[i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"] for r in records]
    try:
        for i, r in enumerate(records):
            pool.reset(i, r["row"])
        waiting = set(range(len(records)))
        while waiting:
            for reply in pool.poll(REPLAY_POLL_S):
                i = reply.eid
                res = results[i]
                if reply.error is not None or reply.restart:
                    res["error"] = f"{reply.op}: {reply.error or 'its environment process was lost'}"
                    waiting.discard(i)
                    pool.close_episode(i)
                    continue
                if reply.op == "step":
                    observation, reward, done, info = reply.value
                    res["env_reward"] += reward
                    if "success" in info:
                        res["success"] = bool(info["success"])
                    given = None if done else observation  # a done step's observation is not shown
                    res["observations_match"] &= _matches(records[i]["messages"], actions[i][res["turns"]], given)
                    res["turns"] += 1
                    res["done"] = bool(done or observation is None)
                    if res["done"]:
                        waiting.discard(i)
                        pool.close_episode(i)
                        continue
                if res["turns"] >= len(actions[i]):  # no more recorded turns
                    waiting.discard(i)
                    pool.close_episode(i)
                    continue
                pool.step(i, records[i]["messages"][actions[i][res["turns"]]]["content"])
    finally:
        pool.close()
    return results


def _matches(messages: list[dict], at: int, observation: Optional[object]) -> bool:
    """Whether the messages recorded after the assistant message `at` (up to the next assistant message) are
    the observation given now."""
    recorded = []
    for m in messages[at + 1 :]:
        if m["role"] == "assistant":
            break
        recorded.append(m["content"])
    if observation is None:
        return not recorded
    given = [observation] if isinstance(observation, str) else [m.get("content") for m in observation]
    return given == recorded
