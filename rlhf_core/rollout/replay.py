"""Replaying an episode whose environment process was lost under it (another episode's call crashed or blocked
the process): its recorded exchange is played into a fresh instance, so the episode goes on where it was,
with every model turn it already generated, instead of starting again from reset.

The runner records, per trajectory, the opening reset gave (`opening`), every action it sent (`sent`) and every
step answer it got (`answers`: observation, reward, done). On a lost process (`EnvReply.restart`) the episode is
reset with its row in a fresh instance and each answered action is sent again, in order; each answer must be
the recorded one (reset's opening as it was; a step's observation, reward and done, its info aside). When all
match, the action that was in flight (sent, not answered) is sent again and the episode continues: the
environment is deterministic given its row and actions, as most games and tool sandboxes are. At the first
difference, error or loss, the replay is given up: the episode starts again from reset, as before (the
environment is not deterministic, or the replay itself failed). An episode replays at most MAX_REPLAYS times.

A replay costs environment calls only; a restart from reset costs every model turn again (docs/benchmarks.md,
"Blast radius").
"""

from __future__ import annotations

from typing import Any, Optional

MAX_REPLAYS = 10  # an episode lost under it more often than this starts again from reset instead


def _same(value: Any, recorded: Any, op: str) -> bool:
    if op == "step":  # (observation, reward, done, info): the info may hold timings, ids
        return tuple(value[:3]) == tuple(recorded[:3])
    return value == recorded


def start(runner, t, op: str) -> Optional[str]:
    """Begin replaying trajectory t (its process was lost while its `op` request was pending or about to be
    sent): 'env' (its reset is sent), or None where there is nothing to replay (lost at its reset, or while
    being asked to finish) or it has replayed MAX_REPLAYS times: the caller restarts it from reset."""
    if op not in ("step", "reset") or t.opening is None or t.replays >= MAX_REPLAYS:
        return None
    t.replaying, t.replays = 0, t.replays + 1
    runner.pool.reset(t.eid, t.row)
    return "env"


def take(runner, t, reply) -> Optional[str]:
    """A reply to trajectory t while it replays: 'env' (the next recorded action is sent, or the one in flight),
    'model' (its exchange is restored: the model's turn), or None: the replay is given up (an answer differs from
    the recorded one, a call failed, or the process was lost again past MAX_REPLAYS); the caller restarts it."""
    if reply.restart:  # lost again: replay again from the start, in yet another instance
        t.replaying = None
        return start(runner, t, "step")
    index = t.replaying
    recorded = t.opening if reply.op == "reset" else (t.answers[index - 1] if 0 < index <= len(t.answers) else None)
    if reply.error is not None or recorded is None or not _same(reply.value, recorded, reply.op):
        t.replaying = None
        runner.pool.close_episode(t.eid)  # the instance that diverged
        return None
    if index < len(t.answers):
        t.replaying = index + 1
        runner.pool.step(t.eid, t.sent[index])
        return "env"
    t.replaying = None
    runner.replayed += 1
    if len(t.sent) > len(t.answers):  # the action in flight when the process was lost
        runner.pool.step(t.eid, t.sent[-1])
        return "env"
    return "model"
