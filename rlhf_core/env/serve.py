"""The environment pool's process side (the parent side is pool.py). No torch.

A process imports the environment class once, says whether it defines `finish`, then serves requests on an
asyncio event loop, each as a task of its own:

  reset   make an instance with env.kwargs and call its reset(row)
  step    call its step(action)
  finish  call its finish(reason) (an episode cut by env.max_turns or env.max_total_tokens)
  close   call its close(), once, and drop it; every instance still open is closed when the process is told
          to stop (one a call that overran still holds once that call ends, within STOP_GRACE_S)

Every call runs under env.step_timeout_s: a coroutine method is awaited, a plain one runs in a thread, so an
environment waiting on a slow tool never holds up the other trajectories of its process. A plain call that
overruns keeps its thread (Python cannot stop it): the instance's close() waits until that call ends, never
running beside it; the parent stops sending new episodes to a process with STUCK_THREADS such threads and
replaces it once its episodes have ended (pool.py). A call that fails
answers with its kind (checks.ERROR_KINDS) and one line: type, message, file:line. An instance whose call
failed is kept until its close.

While a call runs, its trajectory is marked in `marks`, memory shared with the parent (a slot per thread of
the process's thread pool, one for the event loop: a coroutine is running while the loop executes it), with the
time each running call started (the second half of `marks`): when the process dies or blocks, the parent reads
there whose calls were running, and charges one of them; it also counts there the threads that overran (pool.py).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlhf_core.env.checks import BadResult, check_finish_result, check_opening, check_step_result

THREADS_PER_PROCESS = 64  # plain (non-async) calls in flight at once in one process
STUCK_THREADS = THREADS_PER_PROCESS // 4  # overrun threads that retire a process (its episodes end first)
MARK_SLOTS = THREADS_PER_PROCESS + 1  # marks: a slot per thread, then one for the event loop
MARKS_SIZE = 2 * MARK_SLOTS  # marks: eid + 1 per slot, then when each slot's call started (monotonic clock, µs)
STOP_GRACE_S = 5.0  # a stopping process waits this long beyond the timeout for calls that overran it (see _main)


def stop_wait_s(timeout_s: float) -> float:
    """How long a process told to stop waits for its calls and closes before it exits (see _main)."""
    return timeout_s + 1 + STOP_GRACE_S


_OWN_FILES = {"serve.py", "checks.py", "pool.py"}  # frames of this package's machinery, left out of errors


class EnvStepTimeout(Exception):
    pass


def error_text(exc: BaseException) -> str:
    """'Type: message (at file:line)' of the innermost frame outside this package, one line."""
    if isinstance(exc, EnvStepTimeout):
        text = str(exc)
    else:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " ")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.basename(f.filename) not in _OWN_FILES]
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, EnvStepTimeout):
        return "timeout"
    return "bad_result" if isinstance(exc, BadResult) else "raised"


def now_us() -> int:
    """The monotonic clock in µs (system-wide: comparable between the pool's processes)."""
    return time.monotonic_ns() // 1000


class _Marks:
    """Which trajectory's call runs where: slot value eid + 1 (0: free). A slot per pool thread (a plain method
    is running while its thread runs it), and one for the event loop (a coroutine is running while the loop
    executes it, between its awaits): one coroutine runs at a time. `shared[MARK_SLOTS + slot]`: when the call
    in the slot started (time.monotonic_ns() // 1000, the system-wide clock the parent reads too; a coroutine:
    its first step)."""

    def __init__(self, shared):
        self.shared = shared
        self.local = threading.local()
        self.next_thread = iter(range(THREADS_PER_PROCESS))

    def init_thread(self) -> None:
        self.local.slot = next(self.next_thread, None)

    def in_thread(self, eid: int, fn, arg):
        """fn(arg) in a pool thread, marked while it runs."""
        slot = getattr(self.local, "slot", None)
        if slot is not None:
            self.shared[MARK_SLOTS + slot] = now_us()
            self.shared[slot] = eid + 1
        try:
            return fn(arg)
        finally:
            if slot is not None:
                self.shared[slot] = 0

    def on_loop(self, eid: int, awaitable):
        """An awaitable running `awaitable`, marked in the loop's slot while the loop executes it."""
        coro = awaitable if inspect.iscoroutine(awaitable) else _awaiting(awaitable)
        return _OnLoop(self.shared, eid + 1, coro, now_us())


async def _awaiting(awaitable):
    return await awaitable


class _OnLoop:
    """Drives a coroutine step by step (as `await coro` would), marking the loop's slot during each step."""

    def __init__(self, shared, mark: int, coro, started: int):
        self.shared, self.mark, self.coro, self.started = shared, mark, coro, started

    def __await__(self):
        value, error = None, None
        while True:
            self.shared[MARK_SLOTS + THREADS_PER_PROCESS] = self.started
            self.shared[THREADS_PER_PROCESS] = self.mark
            try:
                yielded = self.coro.send(value) if error is None else self.coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                self.shared[THREADS_PER_PROCESS] = 0
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # noqa: BLE001 - thrown in (a cancellation): passed on to the coroutine
                value, error = None, exc


async def _call(marks: _Marks, eid: int, executor, fn, arg, timeout_s: float, threads: dict | None = None):
    """fn(arg) under the timeout: awaited when it is a coroutine function, else run in a thread (a thread that
    overruns is left to finish on its own: Python cannot stop it; `threads[eid]` is its future until it ends). A
    thread's timeout counts from the call's start there, not from its wait for a free thread."""
    deadline = time.monotonic() + timeout_s
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(marks.on_loop(eid, fn(arg)), timeout_s)
        loop, began, started = asyncio.get_running_loop(), asyncio.Event(), []

        def run():
            started.append(time.monotonic())
            loop.call_soon_threadsafe(began.set)
            return marks.in_thread(eid, fn, arg)

        future = executor.submit(run)
        if threads is not None:
            threads[eid] = future
            future.add_done_callback(lambda done: threads.pop(eid) if threads.get(eid) is done else None)
        waiting = asyncio.wrap_future(future)
        # the timeout counts from when the call starts in its thread: a call queued behind busy threads is the
        # process's wait, not the environment's (and is never cancelled there: a close must run once queued)
        await began.wait()
        deadline = started[0] + timeout_s
        await asyncio.wait({waiting}, timeout=max(0.0, deadline - time.monotonic()))
        if not waiting.done():  # its thread runs on; what it ends with is read then, so it is never reported unread
            waiting.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise asyncio.TimeoutError
        result = waiting.result()
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(marks.on_loop(eid, result), max(0.0, deadline - time.monotonic()))
        return result
    except asyncio.TimeoutError:
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", "call"))
        raise EnvStepTimeout(f"{name} timed out after {timeout_s:g} s (env.step_timeout_s)") from None


def serve(conn, marks, path: str, name: str, kwargs: dict, timeout_s: float, max_chars: int) -> None:
    """A pool process's main: load the class, say ("ready", has_finish), serve until told to stop."""
    from rlhf_core.usercode import load_env_class

    try:
        cls = load_env_class(path, name, "env")
    except BaseException as exc:  # noqa: BLE001 - the user's module may raise anything at import
        text = (
            str(exc) if isinstance(exc, ValueError) else f"env: importing {name} from {path} failed: {error_text(exc)}"
        )
        conn.send(("load_error", text))
        return
    conn.send(("ready", callable(getattr(cls, "finish", None))))
    try:
        asyncio.run(_main(conn, _Marks(marks), cls, kwargs, timeout_s, max_chars))
    except KeyboardInterrupt:
        pass
    # threads of calls that overran their timeout may still run: do not wait for them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _main(conn, marks: _Marks, cls, kwargs: dict, timeout_s: float, max_chars: int) -> None:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(THREADS_PER_PROCESS, thread_name_prefix="env", initializer=marks.init_thread)
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
    closing: set = set()
    making: set = set()  # trajectories whose instance is being made
    doomed: set = set()  # of those, the ones closed meanwhile: closed once made

    def send(message) -> None:
        try:
            conn.send(message)
        except (OSError, ValueError):
            pass
        except Exception as exc:  # noqa: BLE001 - an unpicklable observation or info
            text = f"its result cannot be sent between processes: {exc}"
            conn.send(("error", message[1], message[2], "bad_result", text))

    threads: dict = {}  # eid -> the future of its call running in a thread (one that overran included)

    def call(eid: int, fn, arg):
        return _call(marks, eid, executor, fn, arg, timeout_s, threads)

    async def handle(op: str, eid: int, payload) -> None:
        try:
            if op == "reset":
                making.add(eid)
                try:
                    envs[eid] = env = await call(eid, lambda kw: cls(**kw), kwargs)
                finally:
                    making.discard(eid)
                if eid in doomed:  # closed while it was being made
                    doomed.discard(eid)
                    await close(eid)
                    return
                value = check_opening(await call(eid, env.reset, payload), max_chars)
            else:
                env = envs.get(eid)
                if env is None:
                    raise RuntimeError(f"no environment for trajectory {eid} (it was closed)")
                if op == "step":
                    value = check_step_result(await call(eid, env.step, payload), max_chars)
                else:
                    value = check_finish_result(await call(eid, env.finish, payload))
            send(("ok", eid, op, value))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the environment may raise anything (SystemExit too)
            send(("error", eid, op, error_kind(exc), error_text(exc)))

    async def close(eid: int) -> None:
        if eid in making:
            doomed.add(eid)
        env = envs.pop(eid, None)
        running = threads.get(eid)
        if running is not None:  # a call that overran its timeout still holds the instance: close after it ends
            await asyncio.wait([asyncio.wrap_future(running)])
        if env is not None and callable(getattr(env, "close", None)):
            try:
                await call(eid, lambda _: env.close(), None)
            except BaseException:  # noqa: BLE001, S110 - closing is best effort (bounded by the timeout)
                pass

    def start(coro, where: set) -> None:
        task = asyncio.create_task(coro)
        where.add(task)
        task.add_done_callback(where.discard)

    while True:
        message = await inbox.get()
        if message is None:
            break
        op, eid, payload = message
        if op == "close":
            start(close(eid), closing)
        else:
            start(handle(op, eid, payload), tasks)
    # told to stop (or the owner is gone): every instance is closed, one still being made once made (doomed);
    # calls in flight get their own timeout to end, and an instance a call that overran still holds is closed once
    # that call ends, within STOP_GRACE_S: past it the process exits without closing it, and says so
    doomed.update(making)
    for eid in list(envs):
        start(close(eid), closing)
    if tasks or closing:
        await asyncio.wait(tasks | closing, timeout=stop_wait_s(timeout_s))
    held = sorted(eid for eid, future in threads.items() if not future.done())
    if held:
        print(
            f"env: stopping with {len(held)} call(s) still running {stop_wait_s(timeout_s):g} s after the stop "
            f"(trajectories {held[:8]}): their instances are not closed",
            file=sys.stderr,
        )
    for task in tasks | closing:
        task.cancel()
    executor.shutdown(wait=False, cancel_futures=True)
