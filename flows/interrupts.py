"""The CLI's interrupts, kept even where Python drops them.

A signal handler's KeyboardInterrupt that is raised while a finalizer runs (a weakref callback or `__del__`:
sqlalchemy's, inside MLflow's client, during a checkpoint) is printed as "Exception ignored in ..." and dropped:
the run would go on as if Ctrl-C had never been pressed (seen in tests/test_signals.py under load). So the
CLI's handler records the signal as well as raising it, and the supervising loop raises it again at its next
tick (`raise_if_pending`). Under a Prefect worker nothing is recorded: Prefect handles its SIGTERM itself.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

_pending: list[int] = []


def handler(signum, frame) -> None:
    """SIGINT / SIGTERM handler of `atrlhf train` / `sweep`: record the signal, raise KeyboardInterrupt."""
    _pending.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def raise_if_pending() -> None:
    """Raise KeyboardInterrupt if the CLI received a signal whose own KeyboardInterrupt was dropped."""
    if _pending:
        raise KeyboardInterrupt(f"signal {_pending[0]} (its first KeyboardInterrupt was lost in a finalizer)")


def clear() -> None:
    """Forget recorded signals (a new command in the same process)."""
    _pending.clear()


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """`handler` for SIGINT and SIGTERM for the block (a CLI command), nothing pending before or after it (a flow
    run later in this process, a test or a notebook, starts with none); the previous handlers are back on exit."""
    clear()
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        clear()
