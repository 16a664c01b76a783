"""What every replay buffer shares: one lock, one condition, the counters, waiting, closing.

Accounting is in items (one pushed object = one item, whatever its own length). Every counter changes
under the lock together with the state it describes, so any `stats()` snapshot satisfies

    pushed == sampled + evicted_stale + dropped_overflow + size + pending.

Pushes refused because the buffer is closed never enter it: they are counted apart, in rejected_closed.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

_MISSING = object()


def read_field(item: Any, name: str, default: Any = _MISSING) -> Any:
    """`item[name]` for dicts, `item.name` otherwise (then `item[name]` for other mappings)."""
    if isinstance(item, dict):
        value = item.get(name, default)
    else:
        value = getattr(item, name, _MISSING)
        if value is _MISSING:
            try:
                value = item[name]
            except (TypeError, KeyError, IndexError):
                value = default
    if value is _MISSING:
        raise AttributeError(f"buffer item of type {type(item).__name__} has no {name!r} (attribute or key)")
    return value


def read_version(item: Any, required: bool = True) -> int | None:
    """The item's policy_version as an int (ints, numpy ints and integer 0-d tensors); None if absent
    and not required."""
    version = read_field(item, "policy_version", _MISSING if required else None)
    return None if version is None else operator.index(version)


class LockedBuffer:
    """Lock, condition variable and counters. Subclasses keep their state under `self._lock` and call
    `self._not_empty.notify_all()` (only when `self._waiters`) after adding sampleable items."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._waiters = 0
        self._closed = False
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._pushed = self._sampled = self._evicted_stale = self._dropped_overflow = 0
        self._rejected_closed = 0

    def _wait_until(self, available: Callable[[], int], need: int, timeout: float | None) -> None:
        """With the lock held: block until available() >= need, close(), or `timeout` seconds pass.
        timeout None or <= 0 returns at once; math.inf waits without a deadline."""
        if not timeout or timeout <= 0 or self._closed or available() >= need:
            return
        deadline = None if timeout == math.inf else time.monotonic() + timeout
        self._waiters += 1
        try:
            while not self._closed and available() < need:
                if deadline is None:
                    self._not_empty.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._not_empty.wait(remaining)
        finally:
            self._waiters -= 1

    def _wait_and_take(self, queue: deque, n: int, timeout: float | None, min_n: int, capacity: int) -> list:
        """With the lock held: a sample's wait and take. When `timeout` is given and `queue` holds fewer than
        `min_n` entries, wait (`_wait_until`) until it holds min(min_n, n, capacity) of them (at least one); then
        remove and return up to `n` entries, oldest (left) first."""
        if timeout and len(queue) < min_n:
            self._wait_until(lambda: len(queue), max(1, min(min_n, n, capacity)), timeout)
        n = min(n, len(queue))
        if n == len(queue):
            out = list(queue)
            queue.clear()
            return out
        popleft = queue.popleft
        return [popleft() for _ in range(n)]

    def close(self) -> None:
        """Wake every waiting sampler (they return what is there, possibly nothing); later pushes are
        refused (return False, counted in rejected_closed) and samples no longer wait."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def _counters(self) -> dict:
        """With the lock held."""
        return {
            "pushed": self._pushed,
            "sampled": self._sampled,
            "evicted_stale": self._evicted_stale,
            "dropped_overflow": self._dropped_overflow,
            "rejected_closed": self._rejected_closed,
            "closed": self._closed,
        }

    def stats(self) -> dict:  # pragma: no cover - every subclass defines it
        raise NotImplementedError


class VersionWindow:
    """The consumer's policy version and the staleness bound, shared by the versioned and group buffers.

    An item is fresh while its version >= version - max_staleness (`_fresh_bound`); max_staleness None
    accepts everything.
    """

    _version: int
    _max_staleness: int | None

    def _fresh_bound(self, version: int | None = None) -> float:
        """The oldest fresh version for consumer `version` (default: the buffer's own)."""
        version = self._version if version is None else version
        return float("-inf") if self._max_staleness is None else version - self._max_staleness

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_staleness(self) -> int | None:
        return self._max_staleness
