"""MLflow writes that a signal cannot cut in half.

Ctrl-C or SIGTERM raises in the main thread at whatever bytecode it is running (Prefect's SIGTERM handler raises
TerminationSignal, Python's SIGINT handler KeyboardInterrupt). Raised inside a SQLite commit of the MLflow store,
it leaves that connection's write transaction open, and the run's last write, its KILLED status, then fails with
"database is locked": the MLflow run stays RUNNING although the run ended. `Uninterrupted(client)` runs every
method of the client with SIGINT and SIGTERM held (recorded, not handled) and delivers a held signal to the
handler that was in place as soon as the call returns, so the interrupt lands between writes. Only on the main
thread (where Python runs signal handlers); elsewhere calls go straight through.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from typing import Any

HELD = (signal.SIGINT, signal.SIGTERM)


class Uninterrupted:
    """A proxy of `obj` whose method calls are never interrupted by SIGINT / SIGTERM halfway."""

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return attr(*args, **kwargs)
            held: list[int] = []
            try:
                with _bridge_lock():  # no moment in which Prefect's cancellation handshake sees another handler
                    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in HELD}
                    try:
                        return attr(*args, **kwargs)
                    finally:
                        for sig, handler in previous.items():
                            signal.signal(sig, handler)
            finally:
                for signum in held[:1]:  # the first one, now, to the handler that was in place
                    signal.raise_signal(signum)

        return call


def _bridge_lock():
    """The lock Prefect takes to install or check its SIGTERM bridge. Under a worker, a cancellation is a
    handshake: the flow process acknowledges it only while Prefect's own SIGTERM handler is in place (otherwise the
    runner kills it as a crash). Holding that lock while the handler is swapped makes the handshake wait for the
    write (milliseconds) instead of seeing the swap. A Prefect without it: no lock."""
    return _BRIDGE_LOCK if _BRIDGE_LOCK is not None else contextlib.nullcontext()


try:  # imported here, once: never between a signal and the swap
    from prefect.utilities.engine import _prefect_sigterm_bridge_lock as _BRIDGE_LOCK
except ImportError:  # pragma: no cover - another Prefect release
    _BRIDGE_LOCK = None
