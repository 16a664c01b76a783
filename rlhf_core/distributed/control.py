"""The runtime's control objects, in plain Python: experience buffer with admission control, weight-store
bookkeeping (the prompt queue, plain Python too, sits beside the prompt source: `rlhf_core.data.queue`).

Nothing here imports Ray. The runtime makes each one a Ray actor as it is (`ray.remote(WeightStore)`), so
that every rule about admission, staleness and published versions is unit-tested without Ray. Importing this
module imports no torch either: the weight store holds no tensors, so its actor process never loads it (the
experience buffer imports what it needs when it is made).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from rlhf_core.types import Experience


# --------------------------------------------------------------------------------------------- buffer
class ExperienceBuffer:
    """A VersionedReplayBuffer of prompt groups, plus admission control.

    Admission (the capacity rule AReaL uses): a rollout worker may start a batch of n groups only while
    admitted + n <= (max_staleness + version + 1) x prompts_per_step + wasted, so at steady state nothing
    is generated that could not be consumed within max_staleness (wasted = evicted + dropped + filtered
    groups, which are re-admitted so that eviction can never starve the trainer).

    filter_groups (DAPO's dynamic sampling, algorithm.filter_groups): a pushed group whose rewards are all
    equal is not stored; it counts as consumed for admission (in `wasted`, so its capacity is re-admitted and
    the trainer's step is filled from further groups) and in `filtered_groups` for the accounting.

    max_staleness can move at runtime (`set_max_staleness`, the staleness autopilot), up to `ceiling`.
    """

    def __init__(
        self,
        max_size: int,
        max_staleness: int,
        prompts_per_step: int,
        admission: bool = True,
        filter_groups: bool = False,
        ceiling: Optional[int] = None,
    ):
        from rlhf_core.buffer import VersionedReplayBuffer  # torch: only this actor holds tensors

        self.buf = VersionedReplayBuffer(max_size, max_staleness)
        self.max_staleness = max_staleness
        self.admission_window = max_staleness
        self.prompts_per_step = prompts_per_step
        self.admission = admission
        self.admitted = 0
        self.paused = False
        self.lock = threading.Lock()
        self.version = 0
        self.weights_version = 0
        self.samples_pushed = 0
        self.given_back = 0
        self.filter_groups = filter_groups
        self.filtered_groups = 0
        self.groups_pushed = 0
        self.ceiling = max_staleness if ceiling is None else max(int(ceiling), max_staleness)

    def capacity(self) -> int:
        # Counted against the newest PUBLISHED weights (what new samples will be generated with), not the
        # trainer's version: with sync_every > 1 the two differ and the trainer's would admit stale work.
        s = self.buf.stats()
        wasted = s["evicted_stale"] + s["dropped_overflow"] + self.filtered_groups
        return (self.admission_window + self.weights_version + 1) * self.prompts_per_step + wasted

    def set_max_staleness(self, bound: int) -> int:
        """Move the staleness bound at runtime (the autopilot), clamped to [0, ceiling]: the buffer evicts by
        the new bound from now on (a lower bound evicts at once) and admission counts with it. An admission
        window narrowed below the old bound stays narrowed (never above the new bound). Returns the bound."""
        bound = max(0, min(int(bound), self.ceiling))
        with self.lock:
            old = self.max_staleness
            window_was_full = self.admission_window >= old
            self.max_staleness = bound
            self.admission_window = bound if window_was_full else min(self.admission_window, bound)
            self.buf.set_max_staleness(bound)
        return bound

    def set_admission_window(self, versions: int) -> None:
        """How many versions ahead of the published weights rollout may run (<= max_staleness, the hard bound)."""
        self.admission_window = max(0, min(int(versions), self.max_staleness))

    def set_weights_version(self, version: int) -> None:
        self.weights_version = max(self.weights_version, int(version))

    def advance(self, version: int, published_version: Optional[int] = None) -> int:
        """After a trainer step, in one round trip: the consumer's version (evicting what became stale)
        and, when the step published weights, their version for admission. Returns the number evicted."""
        if published_version is not None:
            self.set_weights_version(published_version)
        return self.set_version(version)

    def try_admit(self, n_groups: int) -> bool:
        with self.lock:
            if self.paused:
                return False
            if self.admission and self.admitted + n_groups > self.capacity():  # would be consumed too stale
                return False
            self.admitted += n_groups
            return True

    def release(self, n_groups: int) -> None:
        """Return an admission that will not be used (a worker loop stopping with one granted ahead)."""
        with self.lock:
            self.admitted = max(0, self.admitted - int(n_groups))

    def set_paused(self, paused: bool) -> None:
        self.paused = bool(paused)

    def push(self, groups: list) -> int:
        """Groups as pack_groups made them (or Experience objects). They are stored as they come: the
        buffer reads only policy_version, so a group crosses rollout -> buffer -> trainer without being
        unpacked and packed again in between."""
        from rlhf_core.distributed.transport import group_rewards, group_rows

        accepted = 0
        for g in groups:
            r = group_rewards(g) if self.filter_groups else None
            constant = r is not None and bool((r == r[:1]).all())
            with self.lock:
                self.samples_pushed += group_rows(g)
                self.groups_pushed += 1
                self.filtered_groups += constant
            if not constant:
                accepted += bool(self.buf.push(g))
        return accepted

    def take(self, n: int, timeout_s: float, for_version: Optional[int] = None) -> list[Experience]:
        """Exactly n groups, oldest first (packed: unpack_groups), or [] if they did not arrive within timeout_s.

        for_version: the trainer version that will consume them (default: the buffer's version). The
        trainer prefetches the batch for V + 1 while step V trains; groups too stale for V + 1 are
        evicted on the way, so every group taken satisfies the staleness bound at the version that
        trains on it, while the buffer's own version stays V (pushes of V stay welcome, and a skipped
        step can still take for V)."""
        return self.buf.take_for(n, self.version if for_version is None else for_version, timeout_s)

    def give_back(self, groups: list) -> int:
        """Groups a take handed out that will not be trained on (the trainer stopped with a batch
        prefetched): back to the front of the buffer, uncounted from consumed. Returns how many went back."""
        back = self.buf.requeue(groups)
        self.given_back += len(groups)
        return back

    def start_at(self, version: int) -> None:
        """The run starts at trainer version `version` (a resume): admission counts from there, as if the groups
        of every version before had been admitted, so rollout runs at most admission_window versions ahead from
        the first batch (counted from 0, a resume at version 300 left 300 versions of room: admission did nothing
        for the rest of the run and staleness sat at the hard bound)."""
        with self.lock:
            self.admitted = max(self.admitted, int(version) * self.prompts_per_step)
            self.weights_version = max(self.weights_version, int(version))
        self.set_version(version)

    def set_version(self, version: int) -> int:
        """The consumer's version. Never moves back: the trainer's publish thread and a publish the flow
        asked for may report versions out of order."""
        with self.lock:
            self.version = max(self.version, int(version))
            return self.buf.set_version(self.version)

    def stats(self) -> dict:
        s = self.buf.stats()
        s.update(
            {
                "admitted": self.admitted,
                "capacity": self.capacity(),
                "paused": self.paused,
                "admission_window": self.admission_window,
                "samples_pushed": self.samples_pushed,
                "given_back": self.given_back,
                "filtered_groups": self.filtered_groups,
                "filtered_groups_frac": self.filtered_groups / self.groups_pushed if self.groups_pushed else 0.0,
                "max_staleness": self.max_staleness,
            }
        )
        return s


# --------------------------------------------------------------------------------------------- weights
class WeightStore:
    """The latest published weights: an object reference (one ray.put of a CPU state dict) and its version."""

    def __init__(self):
        self.version = -1
        self.ref = None
        self.published = 0
        self.publish_s_total = 0.0

    def publish(self, version: int, ref_box: list, publish_s: float) -> None:
        # the ref arrives inside a list so that Ray passes the reference instead of resolving it
        if version > self.version:
            self.version, self.ref = int(version), ref_box[0]
        self.published += 1
        self.publish_s_total += publish_s

    def get_if_newer(self, version: int):
        if self.ref is None or self.version <= version:
            return None
        return self.version, [self.ref]

    def stats(self) -> dict:
        return {
            "version": self.version,
            "published": self.published,
            "publish_s_mean": self.publish_s_total / self.published if self.published else 0.0,
        }


def busy_fraction(busy_s: float, since: Optional[float]) -> float:
    """Busy seconds over wall-clock seconds since the role's first piece of work: every wait, round trip,
    weight load and transfer counts as not busy, so the figure cannot flatter the pipeline."""
    if since is None:
        return 0.0
    return min(1.0, busy_s / max(1e-9, time.perf_counter() - since))


# --------------------------------------------------------------------------------------------- accounting
def reconcile(poll: dict) -> dict:
    """Conservation of prompt groups, from counts kept independently at each end, in groups:

        generated (rollout workers' own count of pushes the buffer accepted)
          = trained (the trainer's own count) + evicted + dropped + filtered + buffered + in_flight

    where in_flight = taken from the buffer but not trained yet (0 once the loops have stopped: a
    prefetched batch goes back). `unaccounted` is generated minus the right-hand side: a group lost between
    a worker and the buffer makes it non-zero; a group trained twice (or taken and never trained) makes
    in_flight non-zero once the loops have stopped. Rollout workers that died lose their count (a restart
    starts from 0). filtered: groups algorithm.filter_groups kept out (all rewards equal), counted as
    consumed."""
    b = poll["buffer"]
    generated = sum(s.get("groups_pushed", 0) for s in poll["rollout"] if s.get("alive"))
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
