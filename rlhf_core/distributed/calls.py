"""What every actor module shares: a bounded wait on a Ray reference whose error names what it waited for, and
the fault-injection death."""

from __future__ import annotations

import os

import ray


class WaitTimeout(TimeoutError):
    """A blocking wait ran past runtime.wait_timeout_s."""


def get_or_fail(ref, timeout_s: float, what: str):
    """ray.get with a timeout whose error names what was waited for."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what} (runtime.wait_timeout_s)") from None


def die() -> None:
    """Fault-injection hook of every actor: exit the way a segfault or an OOM kill would."""
    os._exit(1)


def task_error(exc: ray.exceptions.RayTaskError) -> str:
    """'Type: message' of the exception an actor method raised (without Ray's remote traceback)."""
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
