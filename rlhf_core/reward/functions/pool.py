"""A long-lived pool of spawned processes that run user reward functions, each call with its own deadline.

The processes are a `pebble.ProcessPool` (spawn): each imports every configured function once (its
initializer), then runs tasks, one per call: a TRL function's one call over a chunk of rows, or a verl
function's call on ONE row (a verl `Call` of n rows is n tasks). Inside a task the call runs under a timer
(SIGALRM, `timeout_s`), so a function that sleeps or loops in Python is interrupted and reported as a
timeout while its process lives on. A task that has not answered `timeout_s + KILL_GRACE_S` after it started
(a function stuck in C code, a regex that backtracks, one that blocks or swallows the timer's signal) has its
process killed by the pool and replaced; that task's rows fail (one row for verl), every other task's rows
are unaffected, finished ones included. A process that dies fails only the task it was running. Nothing
waits without a bound: a run that makes no progress for `START_TIMEOUT_S` plus one task's budget raises.

Results come back as plain Python: per row (value, extras, error), where value is a float or None ("does
not apply": a function's None or NaN) and error a one-line message (then value is None).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import multiprocessing as mp
import signal
import threading
import traceback
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional

from pebble import ProcessExpired, ProcessPool

from rlhf_core.usercode import load_function

Row = tuple[Optional[float], dict, Optional[str]]  # (value or None, extra metrics, error or None)
START_TIMEOUT_S = 120.0  # a pool process must have imported every function within this
KILL_GRACE_S = 1.0  # a task's budget beyond its call's timeout before its process is killed


class FunctionLoadError(RuntimeError):
    """A reward function could not be imported in the pool (the message names reward.functions[i])."""


class CallTimeout(Exception):
    pass


@dataclass
class Call:
    """Function `fn` on `rows` rows.

    kind 'trl': payload = the keyword arguments of ONE call over all rows (lists of length `rows`): one task;
    kind 'verl': payload = a list of `rows` keyword-argument dicts, one call each: one task per row."""

    fn: int
    kind: str
    payload: Any
    rows: int


# ------------------------------------------------------------------------------------------ child side
_loaded: list = []  # [(function, (parameter names, takes **kwargs), kind)] in this pool process
_load_error: Optional[str] = None
_timeout_s = 0.0


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


def _number(x, what: str) -> Optional[float]:
    """A function's value as a float; None for None and NaN ("does not apply", as TRL reads NaN)."""
    if x is None:
        return None
    if isinstance(x, Real) or (hasattr(x, "item") and callable(x.item)):  # numpy / torch scalars too
        value = float(x)
        if math.isnan(value):
            return None
        if math.isfinite(value):
            return value
    raise TypeError(f"{what} is {x!r}, not a finite number, None or NaN")


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
        return [(_number(v, f"value {i}"), {}, None) for i, v in enumerate(out)]
    except BaseException as exc:  # noqa: BLE001 - the user's function may raise anything; the row scores 0
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return [(None, {}, _error_text(exc))] * n


def _run_verl(fn, accepted, timeout_s: float, kwargs: dict) -> Row:
    names, var_kw = accepted
    given = kwargs if var_kw or "extra_info" in names else {k: v for k, v in kwargs.items() if k != "extra_info"}
    try:
        result = _timed(timeout_s, functools.partial(fn, **given))
        extras = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise TypeError(f"returned a dict without 'score' (keys {sorted(result)})")
            extras = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, (Real, bool))}
            result = result["score"]
        return (_number(result, "score"), extras, None)
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return (None, {}, _error_text(exc))


def _load(functions: list[tuple[str, str, str]], timeout_s: float) -> None:
    """A pool process's initializer: import the functions once. Never raises (pebble would only log it): a
    failure is kept and every task answers it."""
    global _load_error, _timeout_s
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled": ours is in place
    _timeout_s = timeout_s
    for path, name, where in functions:
        try:
            fn, kind = load_function(path, name, where)
        except BaseException as exc:  # noqa: BLE001 - importing user code may raise anything
            _load_error = (
                str(exc)
                if isinstance(exc, ValueError)
                else f"{where}: importing {name} from {path or 'built-ins'} failed: {_error_text(exc)}"
            )
            return
        _loaded.append((fn, _accepts(fn), kind))


def _kinds() -> tuple[str, Any]:
    """('ready', [kind per function]) or ('load_error', message), from a pool process."""
    if _load_error is not None:
        return "load_error", _load_error
    return "ready", [kind for *_, kind in _loaded]


def _task(fn: int, kind: str, payload, n: int) -> tuple[str, Any]:
    """('rows', [Row] * n) of one call, or ('load_error', message) from a process that could not import."""
    if _load_error is not None:
        return "load_error", _load_error
    function, accepted, _ = _loaded[fn]
    if kind == "trl":
        return "rows", _run_trl(function, accepted, _timeout_s, payload, n)
    return "rows", [_run_verl(function, accepted, _timeout_s, payload)]


# ----------------------------------------------------------------------------------------- parent side
class FunctionPool:
    """`workers` spawned processes serving the functions [(path, name, where), ...]; `run(calls)`."""

    def __init__(self, functions: list[tuple[str, str, str]], workers: int, timeout_s: float):
        self.functions = list(functions)
        self.workers = workers
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.replaced = 0  # processes killed and replaced (a task past its deadline, or a process that died)
        self.pool = self._start()
        try:
            tag, payload = self.pool.schedule(_kinds).result(timeout=START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            self.close()
            raise FunctionLoadError(
                f"a reward-function process did not import {[w for *_, w in self.functions]} within "
                f"{START_TIMEOUT_S:g} s"
            ) from None
        except Exception as exc:  # noqa: BLE001 - the process died while importing (a crash in C, os._exit)
            self.close()
            raise FunctionLoadError(
                f"a reward-function process failed while importing {[w for *_, w in self.functions]}: {exc}"
            ) from None
        if tag == "load_error":
            self.close()
            raise FunctionLoadError(payload)
        self.kinds: list[str] = payload

    def _start(self) -> ProcessPool:
        return ProcessPool(
            max_workers=self.workers,
            initializer=_load,
            initargs=(self.functions, self.timeout_s),
            context=mp.get_context("spawn"),
        )

    def run(self, calls: list[Call]) -> list[list[Row]]:
        """Run every call across the processes; returns each call's rows, in order. Never raises for a
        function's failure (those are rows with an error); raises FunctionLoadError if a replacement process
        cannot import the functions, or if no task finishes within START_TIMEOUT_S plus a task's budget."""
        with self.lock:
            if not self.pool.active:  # broken (pebble gives up when its processes die while idle): renew
                self.close()
                self.pool = self._start()
            return self._run(calls)

    def _run(self, calls: list[Call]) -> list[list[Row]]:
        budget = self.timeout_s + KILL_GRACE_S
        tasks: dict[concurrent.futures.Future, tuple[int, int]] = {}  # future -> (call, first row)
        for c, call in enumerate(calls):
            if call.kind == "trl":
                tasks[self.pool.schedule(_task, (call.fn, "trl", call.payload, call.rows), timeout=budget)] = (c, 0)
            else:
                for r, row in enumerate(call.payload):
                    tasks[self.pool.schedule(_task, (call.fn, "verl", row, 1), timeout=budget)] = (c, r)
        results: list[list[Optional[Row]]] = [[None] * call.rows for call in calls]
        pending = set(tasks)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=START_TIMEOUT_S + budget, return_when=concurrent.futures.FIRST_COMPLETED
            )
            if not done:
                for future in pending:
                    future.cancel()
                raise FunctionLoadError(
                    f"the reward-function pool finished no call within {START_TIMEOUT_S + budget:g} s (its "
                    "processes do not start or do not import the functions)"
                )
            for future in done:
                c, r = tasks[future]
                rows = self._rows(future, budget, calls[c].rows if calls[c].kind == "trl" else 1)
                results[c][r : r + len(rows)] = rows
        return results  # type: ignore[return-value]

    def _rows(self, future: concurrent.futures.Future, budget: float, n: int) -> list[Row]:
        try:
            tag, payload = future.result()
        except concurrent.futures.TimeoutError:
            self.replaced += 1
            error = (
                f"no answer within {budget:g} s: its process was killed and replaced (the function did not let "
                "the reward.function_timeout_s timer interrupt it)"
            )
        except ProcessExpired as exc:
            self.replaced += 1
            error = f"its process died (exit code {exc.exitcode})"
        except Exception as exc:  # noqa: BLE001 - arguments or a result that do not pickle, a broken pool
            error = f"the pool could not run the call: {type(exc).__name__}: {exc}"
        else:
            if tag == "load_error":
                raise FunctionLoadError(payload)
            return payload
        return [(None, {}, error)] * n

    def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.stop()
            pool.join()  # stopped: ends the processes (SIGTERM, then SIGKILL after pebble's few seconds)
            self.pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
