"""The environment process pool: spawned processes that hold environment instances, one per trajectory,
many in flight per process. No torch.

Each process imports the environment class once, then serves requests on an asyncio event loop:
`reset` (make an instance with env.kwargs and call its reset(row)), `step` (call its step(action)) and
`close` (drop it). Every reset and step runs as a task of its own, under `env.step_timeout_s`: a coroutine
method is awaited, a plain one runs in a thread, so an environment waiting on a slow tool never holds up
the other trajectories of its process. A call that raises or overruns its timeout answers with an error
(one line: type, message, file:line). A process that does not answer within the timeout plus a grace (an
environment that blocks its event loop, or dies) is killed and replaced; its trajectories fail.

The parent side (`EnvPool`) is driven from one thread: `reset`/`step`/`close` send, `poll` returns the
replies that arrived (and failures of overdue requests). Nothing waits without a bound.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing as mp
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from numbers import Real
from typing import Any, Optional

START_TIMEOUT_S = 120.0  # a pool process must have imported the environment within this
KILL_GRACE_S = 5.0  # beyond a request's timeout before its process is killed
THREADS_PER_PROCESS = 64  # plain (non-async) reset/step calls in flight at once in one process


class EnvLoadError(RuntimeError):
    """The environment class could not be imported or instantiated in the pool."""


class EnvStepTimeout(Exception):
    pass


@dataclass
class EnvReply:
    """The answer to one request: `value` (reset: messages or a string; step: (observation, reward, done,
    info)) or `error` (one line)."""

    eid: int
    op: str
    value: Any = None
    error: Optional[str] = None


# ------------------------------------------------------------------------------------------ child side
def error_text(exc: BaseException) -> str:
    """'Type: message (at file:line)' of the innermost frame outside this package, one line."""
    if isinstance(exc, EnvStepTimeout):
        text = str(exc)
    else:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " ")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/rlhf_core/env/pool.py" not in f.filename]
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text


def _check_messages(value, what: str):
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    ):
        return [dict(m) for m in value]
    raise TypeError(f"{what} is {str(value)[:80]!r}: expected a string or a list of {{'role', 'content'}} messages")


def check_step_result(result) -> tuple:
    """(observation, reward, done, info) with observation None/str/messages, reward a finite float, done a
    bool, info a dict; TypeError naming what is wrong otherwise."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise TypeError(
            f"step returned {type(result).__name__} {str(result)[:80]!r}: expected a tuple "
            "(observation, reward, done, info)"
        )
    observation, reward, done, info = result
    if observation is not None:
        observation = _check_messages(observation, "step's observation")
    if not (isinstance(reward, Real) or (hasattr(reward, "item") and callable(reward.item))) or isinstance(
        reward, bool
    ):
        raise TypeError(f"step's reward is {reward!r}, not a number")
    reward = float(reward)
    if not math.isfinite(reward):
        raise TypeError(f"step's reward is {reward!r}, not a finite number")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise TypeError(f"step's info is {type(info).__name__}, not a dict")
    return observation, reward, bool(done), info


async def _call(loop, executor, fn, arg, timeout_s: float):
    """fn(arg) under the timeout: awaited when it is a coroutine function, else run in a thread (a thread that
    overruns is left to finish on its own: Python cannot stop it)."""
    deadline = time.monotonic() + timeout_s
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(arg), timeout_s)
        result = await asyncio.wait_for(loop.run_in_executor(executor, fn, arg), timeout_s)
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, max(0.0, deadline - time.monotonic()))
        return result
    except asyncio.TimeoutError:
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", "call"))
        raise EnvStepTimeout(f"{name} timed out after {timeout_s:g} s (env.step_timeout_s)") from None


def _serve(conn, path: str, name: str, kwargs: dict, timeout_s: float) -> None:
    from rlhf_core.env.spec import load_env_class

    try:
        cls = load_env_class(path, name, "env")
    except BaseException as exc:  # noqa: BLE001 - the user's module may raise anything at import
        text = (
            str(exc) if isinstance(exc, ValueError) else f"env: importing {name} from {path} failed: {error_text(exc)}"
        )
        conn.send(("load_error", text))
        return
    conn.send(("ready",))
    try:
        asyncio.run(_main(conn, cls, kwargs, timeout_s))
    except KeyboardInterrupt:
        pass


async def _main(conn, cls, kwargs: dict, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(THREADS_PER_PROCESS, thread_name_prefix="env")
    inbox: asyncio.Queue = asyncio.Queue()

    def reader() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the owner is gone
                message = None
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message is None:
                return

    threading.Thread(target=reader, daemon=True).start()
    envs: dict[int, Any] = {}
    tasks: set = set()

    def send(message) -> None:
        try:
            conn.send(message)
        except (OSError, ValueError):
            pass
        except Exception as exc:  # noqa: BLE001 - an unpicklable observation or info
            conn.send(("error", message[1], message[2], f"its result cannot be sent between processes: {exc}"))

    async def handle(op: str, eid: int, payload) -> None:
        try:
            if op == "reset":
                env = await _call(loop, executor, lambda kw: cls(**kw), kwargs, timeout_s)
                envs[eid] = env
                value = _check_messages(await _call(loop, executor, env.reset, payload, timeout_s), "reset's result")
            else:
                env = envs.get(eid)
                if env is None:
                    raise RuntimeError(f"no environment for trajectory {eid} (it failed or was closed)")
                value = check_step_result(await _call(loop, executor, env.step, payload, timeout_s))
            send(("ok", eid, op, value))
        except Exception as exc:  # noqa: BLE001 - the environment may raise anything: the trajectory fails
            envs.pop(eid, None)
            send(("error", eid, op, error_text(exc)))

    while True:
        message = await inbox.get()
        if message is None:
            break
        op, eid, payload = message
        if op == "close":
            env = envs.pop(eid, None)
            if env is not None and callable(getattr(env, "close", None)):
                try:
                    result = env.close()
                    if inspect.isawaitable(result):
                        await asyncio.wait_for(result, timeout_s)
                except Exception:  # noqa: BLE001, S110 - closing is best effort
                    pass
            continue
        task = asyncio.create_task(handle(op, eid, payload))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in tasks:
        task.cancel()
    executor.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------------- parent side
class _Slot:
    def __init__(self, ctx, spec: tuple):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, *spec), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.pending: dict[int, tuple[str, float]] = {}  # eid -> (op, deadline) of requests in flight
        self.episodes: set[int] = set()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class EnvPool:
    """`workers` spawned processes serving environment `name` from `path` (kwargs for each instance).

    Trajectory `eid` lives in one process from its `reset` to its `close`; `poll` gives back replies."""

    def __init__(self, path: str, name: str, kwargs: dict, workers: int, timeout_s: float):
        self.spec = (path, name, dict(kwargs), float(timeout_s))
        self.timeout_s = float(timeout_s)
        self.ctx = mp.get_context("spawn")
        self.replaced = 0
        self.slots = [_Slot(self.ctx, self.spec) for _ in range(workers)]
        self.where: dict[int, int] = {}  # eid -> slot index
        self.failed: list[EnvReply] = []  # replies made here (lost processes), handed out by the next poll
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
        slot.ready = True

    # ------------------------------------------------------------------ requests
    def reset(self, eid: int, row: dict) -> None:
        """Make trajectory `eid`'s environment (in the least loaded process) and reset it with `row`."""
        i = min(range(len(self.slots)), key=lambda k: len(self.slots[k].episodes))
        self.where[eid] = i
        self.slots[i].episodes.add(eid)
        self._send(eid, "reset", row)

    def step(self, eid: int, action: str) -> None:
        self._send(eid, "step", action)

    def close_episode(self, eid: int) -> None:
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
        i = self.where.get(eid)
        if i is None:
            self.failed.append(EnvReply(eid, op, error="its environment process was lost"))
            return
        slot = self.slots[i]
        slot.pending[eid] = (op, time.monotonic() + self.timeout_s + KILL_GRACE_S)
        try:
            slot.conn.send((op, eid, payload))
        except (OSError, ValueError) as exc:
            self._lose(i, f"its environment process could not be reached ({exc})")
        except Exception as exc:  # noqa: BLE001 - an unpicklable row
            slot.pending.pop(eid, None)
            self.failed.append(EnvReply(eid, op, error=f"the {op} request cannot be sent to the process: {exc}"))

    @property
    def in_flight(self) -> int:
        return sum(len(s.pending) for s in self.slots)

    def poll(self, timeout: float) -> list[EnvReply]:
        """Replies that arrived within `timeout` seconds (returns as soon as there is one); requests past their
        timeout plus a grace fail, and their process is killed and replaced."""
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
            if slot.conn in ready:
                while True:
                    try:
                        if not slot.conn.poll():
                            break
                        message = slot.conn.recv()
                    except (EOFError, OSError):
                        self._lose(i, f"its environment process died (exit code {slot.process.exitcode})")
                        break
                    tag, eid, op, value = message
                    if eid not in slot.pending:
                        continue  # closed meanwhile
                    del slot.pending[eid]
                    if tag == "ok":
                        out.append(EnvReply(eid, op, value=value))
                    else:
                        out.append(EnvReply(eid, op, error=value))
                        self.where.pop(eid, None)
                        slot.episodes.discard(eid)
        now = time.monotonic()
        for i, slot in enumerate(self.slots):
            if any(d < now for _, d in slot.pending.values()):
                self._lose(
                    i,
                    f"no answer within {self.timeout_s + KILL_GRACE_S:g} s: its environment process was killed "
                    "and replaced (an environment that blocks its event loop or its process)",
                )
        out += self.failed
        self.failed = []
        return out

    def _lose(self, i: int, error: str) -> None:
        """Kill and replace process i; every trajectory living there fails with `error`."""
        slot = self.slots[i]
        for eid in slot.episodes:
            op = slot.pending.get(eid, ("step", 0.0))[0]
            self.failed.append(EnvReply(eid, op, error=error))
            self.where.pop(eid, None)
        slot.kill()
        self.slots[i] = _Slot(self.ctx, self.spec)
        self.replaced += 1
        self._await_ready(self.slots[i], time.monotonic() + START_TIMEOUT_S)

    def close(self) -> None:
        for slot in self.slots:
            try:
                slot.conn.send(None)
            except (OSError, ValueError):
                pass
        for slot in self.slots:
            slot.process.join(1)
            slot.kill()
        self.slots = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
