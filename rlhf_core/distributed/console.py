"""What Ray's driver prints of its workers, handed to the console code of flows/terminal.py (which imports no Ray):
the autoscaler's events among its status lines, and the hook through which the driver prints worker output.
Both reach into Ray internals that other Ray releases may lack; then they do nothing. Importing this module does
not import Ray."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional


def autoscaler_events(lines: list[str]) -> list[str]:
    """The events Ray's driver would show of the autoscaler's lines (its status reports dropped)."""
    try:
        from ray._private.worker import filter_autoscaler_events

        return list(filter_autoscaler_events(lines))
    except Exception:  # another Ray release: its status reports stay in the log
        return []


def route_worker_output(handler: Callable) -> Optional[Callable[[], None]]:
    """Make Ray's driver print its workers' output through `handler(data, ignore_prefix=False)`; returns the undo
    (None: not possible with this Ray release)."""
    try:
        import ray._private.worker as ray_worker
    except ImportError:
        return None
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:  # another Ray release: its own printing stays
        return None
    ray_worker.print_to_stdstream = handler
    return lambda: setattr(ray_worker, "print_to_stdstream", original)
