"""A long-lived pool of spawned processes that run user reward functions with a per-call timeout.

Each process imports every configured function once, then serves calls: one call per chunk of rows for
TRL's list signature, one call per row (several rows per message) for verl's. Every call runs under a
timer (SIGALRM, `timeout_s`), so a function that sleeps or loops in Python is interrupted and reported as
a timeout; a process that does not answer within its message's whole budget (a function stuck in C code,
or one that swallows the timer's exception) is killed and replaced, and its rows are reported as failed.
Nothing waits without a bound. Results come back as plain Python: per row (value, extras, error), where
value is a float or None ("does not apply") and error a one-line message (then value is None).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import multiprocessing as mp
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from numbers import Real
from typing import Any, Optional

from rlhf_core.pyreward.spec import load_function

Row = tuple[Optional[float], dict, Optional[str]]  # (value or None, extra metrics, error or None)
START_TIMEOUT_S = 120.0  # a pool process must have imported every function within this
KILL_GRACE_S = 5.0  # a message's budget beyond its calls' timeouts before its process is killed


class FunctionLoadError(RuntimeError):
    """A reward function could not be imported in the pool (the message names reward.functions[i])."""


class CallTimeout(Exception):
    pass


@dataclass
class Call:
    """One message to a pool process: function `fn` on `rows` rows.

    kind 'trl': payload = the keyword arguments of ONE call over all rows (lists of length `rows`);
    kind 'verl': payload = a list of `rows` keyword-argument dicts, one call each."""

    fn: int
    kind: str
    payload: Any
    rows: int

    @property
    def timed_calls(self) -> int:
        return 1 if self.kind == "trl" else self.rows


# ------------------------------------------------------------------------------------------ child side
def _error_text(exc: BaseException) -> str:
    """'Type: message (at file:line)' of the innermost frame outside this module, one line."""
    if isinstance(exc, CallTimeout):
        text = str(exc)
    else:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " ")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text


def _timed(seconds: float, fn):
    def on_alarm(signum, frame):
        raise CallTimeout(f"timed out after {seconds:g} s (reward.function_timeout_s)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        result = fn()
        if inspect.isawaitable(result):  # an async TRL function: run it here, under the same timer
            result = asyncio.run(_awaited(result))
        return result
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


async def _awaited(awaitable):
    return await awaitable


def _number(x, what: str) -> float:
    if isinstance(x, Real) or (hasattr(x, "item") and callable(x.item)):  # numpy / torch scalars too
        value = float(x)
        if math.isfinite(value):
            return value
    raise TypeError(f"{what} is {x!r}, not a finite number")


def _accepts(fn) -> tuple[set[str], bool]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params}, any(p.kind == p.VAR_KEYWORD for p in params)


def _run_trl(fn, accepted, timeout_s: float, kwargs: dict, n: int) -> list[Row]:
    names, var_kw = accepted
    given = kwargs if var_kw else {k: v for k, v in kwargs.items() if k in names}
    try:
        out = _timed(timeout_s, functools.partial(fn, **given))
        if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != n:
            raise TypeError(f"returned {type(out).__name__} {str(out)[:60]!r}, not a list of {n} floats or None")
        return [(None if v is None else _number(v, f"value {i}"), {}, None) for i, v in enumerate(out)]
    except BaseException as exc:  # noqa: BLE001 - the user's function may raise anything; the row scores 0
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return [(None, {}, _error_text(exc))] * n


def _run_verl(fn, accepted, timeout_s: float, rows: list[dict]) -> list[Row]:
    names, var_kw = accepted
    out: list[Row] = []
    for kwargs in rows:
        given = kwargs if var_kw or "extra_info" in names else {k: v for k, v in kwargs.items() if k != "extra_info"}
        try:
            result = _timed(timeout_s, functools.partial(fn, **given))
            extras = {}
            if isinstance(result, dict):
                if "score" not in result:
                    raise TypeError(f"returned a dict without 'score' (keys {sorted(result)})")
                extras = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, (Real, bool))}
                result = result["score"]
            out.append((None if result is None else _number(result, "score"), extras, None))
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            out.append((None, {}, _error_text(exc)))
    return out


def _serve(conn, functions: list[tuple[str, str, str]], timeout_s: float) -> None:
    """A pool process: import the functions once, then answer calls until the pipe closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled": ours is in place
    loaded = []
    for path, name, where in functions:
        try:
            loaded.append(load_function(path, name, where))
        except BaseException as exc:  # noqa: BLE001 - importing user code may raise anything
            text = (
                str(exc)
                if isinstance(exc, ValueError)
                else f"{where}: importing {name} from {path or 'built-ins'} failed: {_error_text(exc)}"
            )
            conn.send(("load_error", text))
            return
    accepted = [_accepts(fn) for fn, _ in loaded]
    conn.send(("ready", [kind for _, kind in loaded]))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the owner is gone
            return
        if message is None:
            return
        call_id, call = message
        fn = loaded[call.fn][0]
        if call.kind == "trl":
            rows = _run_trl(fn, accepted[call.fn], timeout_s, call.payload, call.rows)
        else:
            rows = _run_verl(fn, accepted[call.fn], timeout_s, call.payload)
        conn.send(("result", call_id, rows))


# ----------------------------------------------------------------------------------------- parent side
class _Slot:
    def __init__(self, ctx, functions, timeout_s):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, functions, timeout_s), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.call: Optional[int] = None  # index of the call in flight
        self.deadline = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class FunctionPool:
    """`workers` spawned processes serving the functions [(path, name, where), ...]; `run(calls)`."""

    def __init__(self, functions: list[tuple[str, str, str]], workers: int, timeout_s: float):
        self.functions = list(functions)
        self.timeout_s = timeout_s
        self.ctx = mp.get_context("spawn")
        self.lock = threading.Lock()
        self.replaced = 0  # processes killed and replaced (stuck past their budget, or died)
        self.slots = [_Slot(self.ctx, self.functions, timeout_s) for _ in range(workers)]
        self.kinds: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot in self.slots:
            self.kinds = self._await_ready(slot, deadline)

    def _await_ready(self, slot: _Slot, deadline: float) -> list[str]:
        if not slot.conn.poll(max(0.0, deadline - time.monotonic())):
            self.close()
            raise FunctionLoadError(
                f"a reward-function process did not import {[w for *_, w in self.functions]} within "
                f"{START_TIMEOUT_S:g} s"
            )
        try:
            tag, payload = slot.conn.recv()
        except EOFError:
            self.close()
            raise FunctionLoadError(
                f"a reward-function process died while importing {[w for *_, w in self.functions]} "
                f"(exit code {slot.process.exitcode})"
            ) from None
        if tag == "load_error":
            self.close()
            raise FunctionLoadError(payload)
        slot.ready = True
        return payload

    def _replace(self, i: int) -> None:
        self.slots[i].kill()
        self.slots[i] = _Slot(self.ctx, self.functions, self.timeout_s)
        self.replaced += 1

    def run(self, calls: list[Call]) -> list[list[Row]]:
        """Run every call across the processes; returns each call's rows, in order. Never raises for a
        function's failure (those are rows with an error); raises FunctionLoadError if a replacement process
        cannot import the functions."""
        with self.lock:
            return self._run(calls)

    def _run(self, calls: list[Call]) -> list[list[Row]]:
        results: list[Optional[list[Row]]] = [None] * len(calls)
        pending = list(range(len(calls)))[::-1]  # pop() takes the first
        while pending or any(s.call is not None for s in self.slots):
            for slot in self.slots:
                if slot.ready and slot.call is None and pending:
                    c = pending.pop()
                    slot.call = c
                    slot.deadline = time.monotonic() + calls[c].timed_calls * self.timeout_s + KILL_GRACE_S
                    slot.conn.send((c, calls[c]))
            waiting = [s for s in self.slots if s.call is not None or not s.ready]
            busy = [s.deadline for s in waiting if s.call is not None]
            timeout = max(0.0, min(busy) - time.monotonic()) if busy else START_TIMEOUT_S
            ready_conns = wait_any([s.conn for s in waiting], timeout)
            for i, slot in enumerate(self.slots):
                if slot.conn in ready_conns:
                    try:
                        message = slot.conn.recv()
                    except (EOFError, OSError):
                        self._fail_slot(i, calls, results, f"its process died (exit code {slot.process.exitcode})")
                        continue
                    if message[0] == "ready":
                        slot.ready = True
                    elif message[0] == "load_error":
                        raise FunctionLoadError(message[1])
                    else:
                        _, c, rows = message
                        results[c] = rows
                        slot.call = None
                elif slot.call is not None and time.monotonic() > slot.deadline:
                    budget = calls[slot.call].timed_calls * self.timeout_s + KILL_GRACE_S
                    self._fail_slot(
                        i,
                        calls,
                        results,
                        f"no answer within {budget:g} s: its process was killed and replaced (the function did "
                        "not let the reward.function_timeout_s timer interrupt it)",
                    )
                elif not slot.ready and not slot.process.is_alive():
                    raise FunctionLoadError(
                        f"a replacement reward-function process died (exit code {slot.process.exitcode})"
                    )
        return results  # type: ignore[return-value]

    def _fail_slot(self, i: int, calls: list[Call], results: list, error: str) -> None:
        c = self.slots[i].call
        if c is not None:
            results[c] = [(None, {}, error)] * calls[c].rows
        self._replace(i)

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
