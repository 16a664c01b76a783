"""FIFO replay buffers of single items: BoundedReplayBuffer and VersionedReplayBuffer.

Items are arbitrary objects (an `Experience`, a dict, ...); one pushed object counts as one item.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from rlhf_core.buffer._base import LockedBuffer, VersionWindow, read_version


class BoundedReplayBuffer(LockedBuffer):
    """Thread-safe FIFO of at most `max_size` items; a push into a full buffer drops the oldest item
    (counted in dropped_overflow). `push` never blocks; `sample` may wait, never past its timeout."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        super().__init__()
        self._max_size = int(max_size)
        self._queue: deque = deque(maxlen=self._max_size)

    @property
    def max_size(self) -> int:
        return self._max_size

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, item: Any) -> bool:
        """Append `item`. False only when the buffer is closed."""
        with self._lock:
            if self._closed:
                self._rejected_closed += 1
                return False
            queue = self._queue
            if len(queue) == self._max_size:
                self._dropped_overflow += 1  # deque(maxlen) discards the oldest on append
                self._measure_dropped([queue[0]])
            queue.append(item)
            self._pushed += 1
            if self._waiters:
                self._not_empty.notify_all()
        return True

    def push_many(self, items: Iterable[Any]) -> int:
        """Append `items` in order under one lock acquisition; returns how many were accepted (all of
        them, or 0 when closed). More than max_size items at once keeps only the last max_size."""
        items = items if isinstance(items, (list, tuple)) else list(items)
        with self._lock:
            if self._closed:
                self._rejected_closed += len(items)
                return 0
            self._extend(items)
        return len(items)

    def requeue(self, items: Iterable[Any]) -> int:
        """Give back items that were sampled and will not be used (a prefetching consumer that stops):
        they return to the front, in their order, as if never sampled (`sampled` goes down by their
        number). Returns how many went back; the others are counted where they would have gone had
        they stayed: dropped_overflow when there is no room (the oldest go first) and, in a versioned
        buffer, evicted_stale when the version moved past them."""
        items = items if isinstance(items, (list, tuple)) else list(items)
        with self._lock:
            if len(items) > self._sampled:
                raise ValueError(f"requeue of {len(items)} items, but only {self._sampled} were ever sampled")
            self._sampled -= len(items)
            keep = self._requeue_filter(list(items))
            room = self._max_size - len(self._queue)
            if len(keep) > room:
                self._dropped_overflow += len(keep) - room
                self._measure_dropped(keep[: len(keep) - max(room, 0)])
                keep = keep[len(keep) - room :] if room > 0 else []
            self._queue.extendleft(reversed(keep))
            if keep and self._waiters:
                self._not_empty.notify_all()
        return len(keep)

    def _requeue_filter(self, items: list) -> list:
        """With the lock held: the given-back items that may re-enter (all of them here)."""
        return items

    def _measure_dropped(self, items: list) -> None:
        """With the lock held: items dropped on overflow (measured by a buffer given a measure)."""

    def _extend(self, items: list | tuple) -> None:
        """With the lock held: append already-accepted items, counting the overflow."""
        if not items:
            return
        queue = self._queue
        overflow = len(queue) + len(items) - self._max_size
        if overflow > 0:
            self._dropped_overflow += overflow
            self._measure_dropped((list(queue) + list(items))[:overflow])  # the oldest go
        queue.extend(items)
        self._pushed += len(items)
        if self._waiters:
            self._not_empty.notify_all()

    def sample(self, batch_size: int, timeout: float | None = None, min_items: int = 1) -> list:
        """Remove and return up to `batch_size` items, oldest first.

        timeout None or 0: return at once with what is there (possibly []).
        timeout > 0: first wait until at least min(min_items, batch_size, max_size) items are there,
                     the buffer is closed, or `timeout` seconds pass; then return what is there.
        timeout math.inf: wait without a deadline (close() still wakes it).
        """
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        with self._lock:
            out = self._wait_and_take(self._queue, batch_size, timeout, min_items, self._max_size)
            self._sampled += len(out)
        return out

    def clear(self) -> None:
        """Empty the buffer and start its counters afresh (a new accounting period); the closed flag
        and any version setting stay."""
        with self._lock:
            self._queue.clear()
            self._reset_counters()

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        out = self._counters()
        out.update(size=len(self._queue), pending=0, max_size=self._max_size)
        return out


class VersionedReplayBuffer(BoundedReplayBuffer, VersionWindow):
    """A BoundedReplayBuffer whose items carry `policy_version` and go stale.

    With consumer version V (set by `set_version`), an item of version v is fresh while
    v >= V - max_staleness. A stale push is refused (returns False, counted in pushed and in
    evicted_stale); items that turn stale when the version moves are evicted by `set_version` itself,
    so `sample` can never hand out a stale item. max_staleness None disables the check.
    """

    def __init__(
        self, max_size: int, max_staleness: int | None, version: int = 0, measure: Callable | None = None
    ) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        super().__init__(max_size)
        # measure(item) -> (response tokens, rows): what the evicted, dropped and buffered items hold (stats
        # evicted_tokens/rows, dropped_tokens/rows, buffered_tokens/rows: the token ledger's buffer side)
        self._measure = measure
        self._evicted_tokens = self._evicted_rows = 0
        self._dropped_tokens = self._dropped_rows = 0
        self._max_staleness = max_staleness
        self._version = int(version)
        self._min_fresh = self._fresh_bound()
        self._min_version = float("inf")  # lower bound of the queued versions; spares needless scans

    def push(self, item: Any) -> bool:
        """Append `item` if fresh. False when stale (counted) or closed."""
        version = read_version(item)
        with self._lock:
            if self._closed:
                self._rejected_closed += 1
                return False
            self._pushed += 1
            if version < self._min_fresh:
                self._evicted_stale += 1
                self._measure_evicted([item])
                return False
            queue = self._queue
            if len(queue) == self._max_size:
                self._dropped_overflow += 1
                self._measure_dropped([queue[0]])
            queue.append(item)
            if version < self._min_version:
                self._min_version = version
            if self._waiters:
                self._not_empty.notify_all()
        return True

    def push_many(self, items: Iterable[Any]) -> int:
        """Append the fresh ones of `items` under one lock acquisition; returns how many were accepted."""
        items = items if isinstance(items, (list, tuple)) else list(items)
        versions = [read_version(item) for item in items]
        with self._lock:
            if self._closed:
                self._rejected_closed += len(items)
                return 0
            bound = self._min_fresh
            fresh = [item for item, v in zip(items, versions) if v >= bound]
            stale = len(items) - len(fresh)
            self._pushed += stale
            self._evicted_stale += stale
            if stale:
                self._measure_evicted([item for item, v in zip(items, versions) if v < bound])
            self._extend(fresh)
            if fresh:
                self._min_version = min(self._min_version, min(v for v in versions if v >= bound))
        return len(fresh)

    def _requeue_filter(self, items: list) -> list:
        versions = [read_version(item) for item in items]
        bound = self._min_fresh
        fresh = [item for item, v in zip(items, versions) if v >= bound]
        self._evicted_stale += len(items) - len(fresh)
        self._measure_evicted([item for item, v in zip(items, versions) if v < bound])
        if fresh:
            self._min_version = min(self._min_version, min(v for v in versions if v >= bound))
        return fresh

    def set_version(self, version: int) -> int:
        """Set the consumer's policy version and evict the items it makes stale; returns how many."""
        with self._lock:
            self._version = int(version)
            self._min_fresh = self._fresh_bound()
            return self._evict_below(self._min_fresh)

    def set_max_staleness(self, max_staleness: int) -> int:
        """Change the staleness bound at runtime and evict what the new bound makes stale; returns how many."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        with self._lock:
            self._max_staleness = int(max_staleness)
            self._min_fresh = self._fresh_bound()
            return self._evict_below(self._min_fresh)

    def take_for(self, n: int, version: int, timeout: float | None) -> list:
        """Exactly `n` items fresh for consumer version `version` (v >= version - max_staleness), oldest
        first, or [] if they are not there within `timeout` seconds (None or 0: do not wait; math.inf:
        no deadline) or the buffer is closed.

        Items too stale for `version` are evicted on the way (counted in evicted_stale), but the buffer's
        own version is left as it is: a consumer that asks ahead, for the version its running step will
        produce, changes nothing for pushes, and can still ask for its current version if that step
        does not count (a skipped, non-finite step)."""
        return self.take_for_bound(n, version, timeout)[0]

    def take_for_bound(self, n: int, version: int, timeout: float | None) -> tuple[list, int | None]:
        """`take_for`, plus the max_staleness it enforced (the bound in force when the take began): the one a
        consumer checks what it took against, even if the bound moves while it waits."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        with self._lock:
            enforced = self._max_staleness
            bound = self._fresh_bound(int(version))

        def fresh() -> int:  # evicting as it counts, so stale arrivals never count towards n
            self._evict_below(bound)
            return len(self._queue)

        with self._lock:
            self._wait_until(fresh, n, timeout)
            if fresh() < n:
                return [], enforced
            queue = self._queue
            out = [queue.popleft() for _ in range(n)]
            self._sampled += n
        return out, enforced

    def fresh_count(self, version: int) -> int:
        """How many queued items are fresh for consumer version `version` (evicting the others, counted)."""
        with self._lock:
            self._evict_below(self._fresh_bound(int(version)))
            return len(self._queue)

    def _evict_below(self, bound: float) -> int:
        """With the lock held: evict the queued items of version < bound; returns how many."""
        queue = self._queue
        if not queue:
            self._min_version = float("inf")
            return 0
        if self._min_version >= bound:
            return 0
        versions = [read_version(item) for item in queue]
        keep = [item for item, v in zip(queue, versions) if v >= bound]
        evicted = len(queue) - len(keep)
        if evicted:
            self._measure_evicted([item for item, v in zip(queue, versions) if v < bound])
        queue.clear()
        queue.extend(keep)  # same deque object: waiters hold no reference to a stale one
        self._evicted_stale += evicted
        self._min_version = min((v for v in versions if v >= bound), default=float("inf"))
        return evicted

    def _measured(self, items) -> tuple[int, int]:
        """(response tokens, rows) of `items` by the measure (0, 0 without one)."""
        tokens = rows = 0
        if self._measure is not None:
            for item in items:
                t, r = self._measure(item)
                tokens, rows = tokens + int(t), rows + int(r)
        return tokens, rows

    def _measure_evicted(self, items: list) -> None:
        """With the lock held: add the evicted items' response tokens and rows (when a measure was given)."""
        tokens, rows = self._measured(items)
        self._evicted_tokens += tokens
        self._evicted_rows += rows

    def _measure_dropped(self, items: list) -> None:
        tokens, rows = self._measured(items)
        self._dropped_tokens += tokens
        self._dropped_rows += rows

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self._min_version = float("inf")
            self._reset_counters()
            self._evicted_tokens = self._evicted_rows = 0
            self._dropped_tokens = self._dropped_rows = 0

    def _stats(self) -> dict:
        out = super()._stats()
        out.update(version=self._version, max_staleness=self._max_staleness)
        out.update(evicted_tokens=self._evicted_tokens, evicted_rows=self._evicted_rows)
        if self._measure is not None:
            out.update(dropped_tokens=self._dropped_tokens, dropped_rows=self._dropped_rows)
        return out

    def stats(self, contents: bool = False) -> dict:
        """The counters; with `contents` (and a measure) also what the queued items hold, buffered_tokens and
        buffered_rows, in the same snapshot: O(size), for a poll (the admission's hot path reads without)."""
        with self._lock:
            out = self._stats()
            if contents and self._measure is not None:
                out["buffered_tokens"], out["buffered_rows"] = self._measured(self._queue)
        return out
