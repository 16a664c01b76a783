"""The environment process pool: spawned processes that hold environment instances, one per trajectory,
many in flight per process. This is the parent side; serve.py is what runs in a process. No torch.

`EnvPool` is driven from one thread: `reset` / `step` / `finish` send a request, `close_episode` ends an episode
(its instance's close() runs in its process, once), `poll` returns the replies that arrived. Nothing waits
without a bound.

Failure isolation. A failed request fails its trajectory alone: the reply carries the error (one line: type,
message, file:line) and its kind (checks.ERROR_KINDS: raised, timeout, bad_result, process_died). A process that
dies, or leaves a request unanswered past its timeout plus a grace (an environment that blocks its event loop),
is killed and replaced (`replaced`: env/process_restarts):

  - one trajectory fails: of those it left unanswered, the one whose call blocks it (timeout); when it died,
    the one whose call was running there (process_died). When several calls were running at its death, a
    trajectory that was already running at an earlier death (a suspect) is charged, else the call that started
    last (a crash usually follows its call's start, while the calls beside it wait on I/O);
  - every other trajectory it hosted is lost, not failed: its pending request, or the next one made for it, is
    answered `EnvReply(restart=True)`, and the runner starts it again from reset (same row); those that were
    running become suspects until they end. A process that died between calls charges nobody.

A plain call that overran its timeout keeps a thread of its process busy (Python cannot stop it). A process with
STUCK_THREADS such threads retires: it takes no new episode (a fresh process joins the pool in its place,
counted in `replaced`) and goes once the episodes it hosts have ended (`recycled`): its healthy episodes finish
where they are, and no process runs out of threads. A process that goes (retired, or the pool closing) is told to
stop: it closes every instance it holds, one an overrun call holds once that call ends (within STOP_GRACE_S).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any, Optional

from rlhf_core.env.serve import MARK_SLOTS, MARKS_SIZE, STUCK_THREADS, THREADS_PER_PROCESS, now_us, serve, stop_wait_s

START_TIMEOUT_S = 120.0  # a pool process must have imported the environment within this
KILL_GRACE_S = 5.0  # beyond a request's timeout before its process is killed
DEFAULT_MAX_CHARS = 100_000  # env.max_observation_chars' default


class EnvLoadError(RuntimeError):
    """The environment class could not be imported or instantiated in the pool."""


@dataclass
class EnvReply:
    """The answer to one request: `value` (reset: messages or a string; step: (observation, reward, done,
    info); finish: a float or None), or `error` (one line) with its `kind`, or `restart`: the trajectory's
    process was lost, start it again from reset."""

    eid: int
    op: str
    value: Any = None
    error: Optional[str] = None
    kind: Optional[str] = None
    restart: bool = False


class _Slot:
    def __init__(self, ctx, spec: tuple):
        self.conn, child = ctx.Pipe()
        self.marks = ctx.RawArray("q", MARKS_SIZE)  # eid + 1 of each call running in the process, its start order
        self.process = ctx.Process(target=serve, args=(child, self.marks, *spec), daemon=True)
        self.process.start()
        child.close()
        self.pending: dict[int, tuple[str, float]] = {}  # eid -> (op, deadline) of requests in flight
        self.episodes: set[int] = set()
        self.retiring = False  # too many overrun threads: no new episodes, replaced once its episodes ended
        self.stop_by = 0.0  # told to stop: killed if still alive by then (monotonic)

    def running(self) -> set[int]:
        return set(self.started_at())

    def started_at(self) -> dict[int, int]:
        """eid -> when (µs, `serve.now_us`) each call running in the process started."""
        marks = self.marks[:]
        return {int(v) - 1: int(marks[MARK_SLOTS + k]) for k, v in enumerate(marks[:MARK_SLOTS]) if v}

    def overrun_threads(self, timeout_s: float) -> int:
        """Threads of the process still running a call started more than `timeout_s` (+ 1 s) ago."""
        marks, before = self.marks[:], now_us() - int((timeout_s + 1.0) * 1e6)
        return sum(1 for k in range(THREADS_PER_PROCESS) if marks[k] and marks[MARK_SLOTS + k] < before)

    def stop(self, timeout_s: float) -> None:
        """Tell the process to stop: it closes the instances it holds (those an overrun call holds once the call
        ends, within STOP_GRACE_S) and exits; `kill` it if it is still alive at `stop_by`."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.stop_by = time.monotonic() + stop_wait_s(timeout_s) + 1

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class EnvPool:
    """`workers` spawned processes serving environment `name` from `path` (kwargs for each instance), every
    call under `timeout_s`, observations within `max_chars` characters.

    Trajectory `eid` lives in one process from its `reset` to its `close_episode`; `poll` gives back replies.
    `has_finish`: whether the class defines finish(reason)."""

    def __init__(
        self, path: str, name: str, kwargs: dict, workers: int, timeout_s: float, max_chars: int = DEFAULT_MAX_CHARS
    ):
        self.spec = (path, name, dict(kwargs), float(timeout_s), int(max_chars))
        self.timeout_s = float(timeout_s)
        self.workers = int(workers)
        self.ctx = mp.get_context("spawn")
        self.replaced = 0
        self.recycled = 0  # of those, processes retired for their overrun threads
        self.has_finish = False
        self.slots = [_Slot(self.ctx, self.spec) for _ in range(workers)]
        self.stopping: list[_Slot] = []  # retired processes closing their instances before they exit
        self.where: dict[int, int] = {}  # eid -> slot index
        self.lost: set[int] = set()  # trajectories whose process was replaced: their next request restarts them
        self.suspects: set[int] = set()  # running (and restarted, not charged) when a process died
        self.failed: list[EnvReply] = []  # replies made here, handed out by the next poll
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot in self.slots:
            self._await_ready(slot, deadline)

    def _await_ready(self, slot: _Slot, deadline: float) -> None:
        if not slot.conn.poll(max(0.0, deadline - time.monotonic())):
            self.close()
            raise EnvLoadError(f"an environment process did not import env {self.spec[1]} within {START_TIMEOUT_S:g} s")
        try:
            message = slot.conn.recv()
        except EOFError:
            self.close()
            raise EnvLoadError(
                f"an environment process died while importing env {self.spec[1]} (exit code {slot.process.exitcode})"
            ) from None
        if message[0] == "load_error":
            self.close()
            raise EnvLoadError(message[1])
        self.has_finish = bool(message[1])

    # ------------------------------------------------------------------ requests
    def reset(self, eid: int, row: dict) -> None:
        """Make trajectory `eid`'s environment (in the least loaded process) and reset it with `row`."""
        self.lost.discard(eid)
        open_slots = [k for k, slot in enumerate(self.slots) if not slot.retiring]
        i = min(open_slots, key=lambda k: len(self.slots[k].episodes))
        self.where[eid] = i
        self.slots[i].episodes.add(eid)
        self._send(eid, "reset", row)

    def step(self, eid: int, action: str) -> None:
        self._send(eid, "step", action)

    def finish(self, eid: int, reason: str) -> None:
        """Ask an episode cut short (reason: 'max_turns' or 'max_total_tokens') for its final reward."""
        self._send(eid, "finish", reason)

    def close_episode(self, eid: int) -> None:
        """End trajectory `eid`: its instance's close() runs in its process (once; nothing when it is gone)."""
        self.lost.discard(eid)
        self.suspects.discard(eid)
        i = self.where.pop(eid, None)
        if i is None:
            return
        slot = self.slots[i]
        slot.episodes.discard(eid)
        slot.pending.pop(eid, None)
        try:
            slot.conn.send(("close", eid, None))
        except (OSError, ValueError):
            pass

    def _send(self, eid: int, op: str, payload) -> None:
        if eid in self.lost:
            self.lost.discard(eid)
            self.failed.append(EnvReply(eid, op, restart=True))
            return
        i = self.where.get(eid)
        if i is None:
            self.failed.append(EnvReply(eid, op, error="no environment for this trajectory (it ended)", kind="raised"))
            return
        slot = self.slots[i]
        slot.pending[eid] = (op, time.monotonic() + self.timeout_s + KILL_GRACE_S)
        try:
            slot.conn.send((op, eid, payload))
        except (OSError, ValueError):
            self._lose(i)
        except Exception as exc:  # noqa: BLE001 - an unpicklable row
            slot.pending.pop(eid, None)
            text = f"the {op} request cannot be sent to the process: {exc}"
            self.failed.append(EnvReply(eid, op, error=text, kind="raised"))

    @property
    def in_flight(self) -> int:
        return sum(len(s.pending) for s in self.slots)

    def poll(self, timeout: float) -> list[EnvReply]:
        """Replies that arrived within `timeout` seconds (returns as soon as there is one); a process that died
        or overran a request's timeout plus a grace is killed and replaced (see the module doc)."""
        out, self.failed = self.failed, []
        if out:
            timeout = 0.0
        busy = [s for s in self.slots if s.pending]
        if busy:
            next_deadline = min(d for s in busy for _, d in s.pending.values())
            timeout = min(timeout, max(0.0, next_deadline - time.monotonic()))
            ready = wait_any([s.conn for s in busy], timeout)
        else:
            ready = []
        for i, slot in enumerate(self.slots):
            if slot.conn not in ready:
                continue
            while True:
                try:
                    if not slot.conn.poll():
                        break
                    message = slot.conn.recv()
                except (EOFError, OSError):
                    self._lose(i)
                    break
                tag, eid, op = message[:3]
                if eid not in slot.pending:
                    continue  # closed meanwhile
                del slot.pending[eid]
                if tag == "ok":
                    out.append(EnvReply(eid, op, value=message[3]))
                else:
                    out.append(EnvReply(eid, op, error=message[4], kind=message[3]))
        now = time.monotonic()
        for i, slot in enumerate(self.slots):
            overdue = {eid for eid, (_, d) in slot.pending.items() if d < now}
            if overdue:
                self._lose(i, overdue)
        self._recycle()
        out += self.failed
        self.failed = []
        return out

    def _lose(self, i: int, overdue: frozenset | set = frozenset()) -> None:
        """Kill and replace process i (it died, or left the requests `overdue` unanswered): the trajectories it
        was running (or `overdue`) fail, the others it hosted restart (see the module doc)."""
        slot = self.slots[i]
        if overdue:  # the call blocking the process, when it is one of them (a request never started is innocent)
            charged, kind = (slot.running() & set(overdue)) or set(overdue), "timeout"
            error = (
                f"no answer within {self.timeout_s + KILL_GRACE_S:g} s: its environment process was killed and "
                "replaced (an environment that blocks its event loop or its process)"
            )
        else:
            slot.process.join(1)  # its exit code, when it is exiting
            started = {eid: n for eid, n in slot.started_at().items() if eid in slot.pending}
            charged, kind = self._culprit(started), "process_died"
            error = f"its environment process died (exit code {slot.process.exitcode}) while running this call"
            if len(started) > 1:
                error += f" ({len(started)} calls were running there; this one started last or ran at an earlier death)"
                self.suspects |= set(started) - charged
        for eid in slot.episodes:
            self.where.pop(eid, None)
            op = slot.pending.get(eid, ("step", 0.0))[0]
            if eid in charged:
                self.failed.append(EnvReply(eid, op, error=error, kind=kind))
            elif eid in slot.pending:
                self.failed.append(EnvReply(eid, op, restart=True))
            else:
                self.lost.add(eid)
        slot.kill()
        if slot.retiring:  # its replacement has joined already: _recycle removes it
            slot.episodes.clear()
            slot.pending.clear()
            return
        self.slots[i] = _Slot(self.ctx, self.spec)
        self.replaced += 1
        self._await_ready(self.slots[i], time.monotonic() + START_TIMEOUT_S)

    def _recycle(self) -> None:
        """Retire the processes with STUCK_THREADS overrun threads (a fresh process joins for each, so that new
        episodes have somewhere to go); a retired process goes once the episodes it hosts have ended."""
        for slot in self.slots:
            if not slot.retiring and slot.overrun_threads(self.timeout_s) >= STUCK_THREADS:
                slot.retiring = True
        for _ in range(self.workers - sum(not slot.retiring for slot in self.slots)):
            self.slots.append(_Slot(self.ctx, self.spec))
            self.replaced += 1
            self._await_ready(self.slots[-1], time.monotonic() + START_TIMEOUT_S)
        for i in reversed(range(len(self.slots))):
            slot = self.slots[i]
            if slot.retiring and not slot.episodes and not slot.pending:
                slot.stop(self.timeout_s)  # it closes what it holds (the closes sent before this one first)
                self.stopping.append(slot)
                del self.slots[i]
                self.where = {eid: k - (k > i) for eid, k in self.where.items()}
                self.recycled += 1
        now = time.monotonic()
        for slot in [s for s in self.stopping if not s.process.is_alive() or s.stop_by < now]:
            slot.kill()
            self.stopping.remove(slot)

    def _culprit(self, started: dict[int, int]) -> set[int]:
        """The one trajectory charged with a process's death, of those whose calls were running there (eid ->
        start time): a suspect (running at an earlier death too), else the call that started last."""
        if not started:
            return set()
        suspects = [eid for eid in started if eid in self.suspects]
        return {max(suspects or started, key=started.__getitem__)}

    def close(self) -> None:
        """Stop every process; each first closes the instances it still holds (within the timeout; those a call
        that overran holds once that call ends, within STOP_GRACE_S)."""
        for slot in self.slots:
            slot.stop(self.timeout_s)
        for slot in self.slots + self.stopping:
            slot.process.join(max(0.0, slot.stop_by - time.monotonic()))
            slot.kill()
        self.slots, self.stopping = [], []
        self.where.clear()
        self.lost.clear()
        self.suspects.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
