"""Accounting of prompt groups across a run's roles (`reconcile`): every group a rollout worker generated is
trained, evicted, dropped, filtered, buffered or in flight, counted at each end independently."""

from __future__ import annotations


def _pushed_unrevoked(stats: dict, revoked: set) -> int:
    """A live worker's own count of groups pushed, but under lease names since revoked (a loop declared lost
    in a process that lived on: the buffer counted what it accepted from them in revoked_groups)."""
    by_holder = stats.get("pushed_by_holder")
    if not by_holder:
        return int(stats.get("groups_pushed", 0))
    return sum(int(n) for holder, n in by_holder.items() if holder not in revoked)


def reconcile(poll: dict) -> dict:
    """Conservation of prompt groups, from counts kept independently at each end, in groups:

        generated (rollout workers' own count of pushes the buffer accepted)
          = trained (the trainer's own count) + evicted + dropped + filtered + buffered + in_flight

    where in_flight = taken from the buffer but not trained yet (0 once the loops have stopped: a
    prefetched batch goes back). `unaccounted` is generated minus the right-hand side: a group lost between
    a worker and the buffer makes it non-zero; a group trained twice (or taken and never trained) makes
    in_flight non-zero once the loops have stopped. A rollout worker lost or retired is counted by what the
    buffer accepted from it (`revoked_groups`: its own count died with it); a live worker's pushes under a
    lease name since revoked (a loop declared lost whose process lived on) are counted there, not twice.
    filtered: groups algorithm.filter_groups kept out (all rewards equal), counted as consumed."""
    b = poll["buffer"]
    # the workers' own counts, and for workers lost or retired (revoked) the buffer's count of what it accepted
    revoked = set(b.get("revoked_holders", ()))
    generated = b.get("revoked_groups", 0) + sum(
        _pushed_unrevoked(s, revoked) for s in poll["rollout"] if s.get("alive")
    )
    trained = int(poll["trainer"].get("groups_trained", 0))
    in_flight = b["sampled"] - trained
    filtered = int(b.get("filtered_groups", 0))
    accounted = trained + b["evicted_stale"] + b["dropped_overflow"] + filtered + b["size"] + in_flight
    return {
        "generated": generated,
        "pushed": b["pushed"],
        "trained": trained,
        "consumed": b["sampled"],
        "evicted": b["evicted_stale"],
        "dropped": b["dropped_overflow"],
        "filtered": filtered,
        "buffered": b["size"],
        "in_flight": in_flight,
        "unaccounted": generated - accounted,
    }
