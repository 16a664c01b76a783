"""The Ray calls of the Ray host (rlhf_core.hosts.ray_cluster, which imports no Ray itself) and of every actor module:
an actor class made remote, a bounded wait on Ray references whose error names what it waited for, the error of
an actor that died, user modules shipped by value, and the fault-injection death."""

from __future__ import annotations

import os
import sys

import ray

ActorDied = ray.exceptions.RayActorError  # an actor's process or its node died (a call on its handle raises this)


class WaitTimeout(TimeoutError):
    """A blocking wait ran past runtime.wait_timeout_s."""


def remote(cls, **options):
    """`cls` as a Ray actor class with these actor options (num_cpus, name, scheduling_strategy, ...)."""
    return ray.remote(cls).options(**options)


def get_or_fail(ref, timeout_s: float, what: str):
    """ray.get with a timeout whose error names what was waited for."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what} (runtime.wait_timeout_s)") from None


def ready(refs: list, timeout_s: float, every: bool = False) -> list:
    """The references of `refs` that are done within `timeout_s`: as soon as one is (or, with `every`, once all
    are). Nothing is fetched or raised: a failed call counts as done."""
    if not refs:
        return []
    done, _ = ray.wait(list(refs), num_returns=len(refs) if every else 1, timeout=timeout_s)
    return done


def ship_user_modules(prefix: str) -> None:
    """User code loaded from .py files (rlhf_core.usercode: algorithm.loss '<file.py>:<name>' and the like, modules
    named `prefix`...) is not importable by name in an actor's process: objects of its classes (a user loss's
    options in the config) travel by value. Each actor imports the file itself when it needs the code."""
    import ray.cloudpickle

    for name, module in list(sys.modules.items()):
        if name.startswith(prefix):
            ray.cloudpickle.register_pickle_by_value(module)


def die() -> None:
    """Fault-injection hook of every actor: exit the way a segfault or an OOM kill would."""
    os._exit(1)


def task_error(exc: ray.exceptions.RayTaskError) -> str:
    """'Type: message' of the exception an actor method raised (without Ray's remote traceback)."""
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
