"""A run's control objects, in plain Python: the experience buffer with admission control (the one owner of
the staleness bound), weight-store bookkeeping, and the conservation of prompt groups (`reconcile`, written in
accounting.py). The prompt queue, plain Python too, sits beside the prompt source: `rlhf_core.data.queue`.

Nothing here imports Ray: the in-process host (`rlhf_core.run.local`) uses these objects as they are, and the
Ray runtime makes each one an actor as it is (`ray.remote(WeightStore)`), so every rule about admission,
staleness and published versions is the same on both hosts and unit-tested without Ray. Importing this
module imports no torch either: the weight store holds no tensors, so its actor process never loads it (the
experience buffer imports what it needs when it is made).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Optional

from rlhf_core.run.accounting import group_length, token_ledger

if TYPE_CHECKING:
    from rlhf_core.config import TrainConfig


# --------------------------------------------------------------------------------------------- buffer
class ExperienceBuffer:
    """A VersionedReplayBuffer of prompt groups, plus admission control: the one owner of staleness.

    The bound in force is `max_staleness` here and nowhere else: eviction, admission and every take use it,
    and `take` returns the bound it enforced, which the trainer checks its batch against. It moves only by
    `set_max_staleness` (the staleness autopilot, the one policy over it, within [0, ceiling]).

    Admission (the capacity rule AReaL uses): a rollout worker may start a batch of n groups only while
    admitted + n <= (max_staleness + version + 1) x prompts_per_step + wasted, so at steady state nothing
    is generated that could not be consumed within max_staleness (wasted = evicted + dropped + filtered
    groups, which are re-admitted so that eviction can never starve the trainer). At max_staleness 0 this is
    lockstep: one step's groups are generated with the newest weights, trained on, and the next are admitted.

    filter_groups (DAPO's dynamic sampling, algorithm.filter_groups): a pushed group whose rewards are all
    equal is not stored; it counts as consumed for admission (in `wasted`, so its capacity is re-admitted and
    the trainer's step is filled from further groups) and in `filtered_groups` for the accounting. Once
    filter_max_rounds x prompts_per_step groups have arrived since the last take and a step is still short,
    the take hands out the groups there are (the last filtered ones when none passed), so a saturated task
    trains on what it has instead of stalling.
    """

    def __init__(
        self,
        max_size: int,
        max_staleness: int,
        prompts_per_step: int,
        filter_groups: bool = False,
        ceiling: Optional[int] = None,
        filter_max_rounds: int = 10,
    ):
        from rlhf_core.buffer import VersionedReplayBuffer  # torch: only this actor holds tensors

        self.buf = VersionedReplayBuffer(max_size, max_staleness, measure=group_length)
        self.max_staleness = max_staleness
        self.prompts_per_step = prompts_per_step
        self.admitted = 0
        self.paused = False
        self.lock = threading.Lock()
        self.version = 0
        self.weights_version = 0
        # the token ledger's buffer side (rlhf_core.run.accounting.token_ledger), as [response tokens, rows]
        self.measured = {k: [0, 0] for k in ("pushed", "filtered", "taken", "refused")}
        self.given_back = 0
        self.filter_groups = filter_groups
        self.filter_max_rounds = max(1, int(filter_max_rounds))
        self.filtered_groups = 0
        self.groups_pushed = 0
        self.arrived_since_take = 0  # groups pushed (kept or filtered) since the last take: the filter rounds
        self.last_filtered: list = []  # the newest filtered groups (a step's worth): trained when none passed
        self.short_takes = 0  # takes that handed out fewer than a step's groups (filter rounds spent)
        self.filtered_trained = 0  # filtered groups handed out that way (counted as consumed, not filtered)
        self.ceiling = max_staleness if ceiling is None else max(int(ceiling), max_staleness)
        # by holder (a rollout worker's incarnation): [last batch number accepted, groups accepted, groups admitted
        # and not pushed or released yet]
        self.holders: dict[str, list[int]] = {}
        # by holder: (W, leases above W settled): every lease number <= W was pushed or released as failed; a
        # streaming worker settles its leases out of order, and requeue after its loss must be exact
        self.settled: dict[str, tuple[int, set]] = {}
        self.revoked: set[str] = set()
        self.revoked_groups = 0  # groups accepted from holders since revoked (reconcile counts them as generated)
        self.refused_groups = 0  # groups pushed by a revoked holder after it was revoked: not stored

    def capacity(self) -> int:
        # Counted against the newest PUBLISHED weights (what new samples will be generated with), not the
        # trainer's version: with sync_every > 1 the two differ and the trainer's would admit stale work.
        s = self.buf.stats()
        wasted = s["evicted_stale"] + s["dropped_overflow"] + self.filtered_groups + self.filtered_trained
        return (self.max_staleness + self.weights_version + 1) * self.prompts_per_step + wasted

    def set_max_staleness(self, bound: int) -> int:
        """Move the staleness bound (the autopilot), clamped to [0, ceiling]: the buffer evicts by the new bound
        from now on (a lower bound evicts at once) and admission counts with it. Returns the bound."""
        bound = max(0, min(int(bound), self.ceiling))
        with self.lock:
            self.max_staleness = bound
            self.buf.set_max_staleness(bound)
        return bound

    def set_weights_version(self, version: int) -> None:
        self.weights_version = max(self.weights_version, int(version))

    def advance(self, version: int, published_version: Optional[int] = None) -> int:
        """After a trainer step, in one round trip: the consumer's version (evicting what became stale)
        and, when the step published weights, their version for admission. Returns the number evicted."""
        if published_version is not None:
            self.set_weights_version(published_version)
        return self.set_version(version)

    def try_admit(self, n_groups: int, at_least: int = 1, holder: Optional[str] = None) -> int:
        """How many of n_groups a worker may start now: all of them, or as many as the capacity has room for
        when that is at least `at_least` (a smaller batch: at max_staleness 0 a filtered or failed group frees one
        group's room, and a batch that waited for a whole batch's room would wait forever), else 0 (paused, or
        no room). holder: the worker's incarnation, whose outstanding grant `revoke` returns if it is lost."""
        with self.lock:
            if self.paused or holder in self.revoked:
                return 0
            free = self.capacity() - self.admitted  # beyond it, groups would be consumed too stale
            granted = int(n_groups) if n_groups <= free else (free if free >= max(1, int(at_least)) else 0)
            self.admitted += granted
            if holder is not None:
                self._holder(holder)[2] += granted
            return granted

    def release(self, n_groups: int, holder: Optional[str] = None, batch: Optional[int] = None) -> None:
        """Return an admission that will not be used (a worker loop stopping with one granted ahead, or groups
        an environment failed). batch: the lease number of a batch that ends here with nothing pushed (its
        groups all failed): settled, its prompts are not requeued."""
        with self.lock:
            if holder is not None and holder in self.revoked:
                return  # revoking it already freed what it held
            if holder is not None and batch is not None:
                self._settle(holder, int(batch))
            self.admitted = max(0, self.admitted - int(n_groups))
            if holder is not None:
                record = self._holder(holder)
                record[2] = max(0, record[2] - int(n_groups))

    def _holder(self, holder: str) -> list[int]:
        return self.holders.setdefault(holder, [-1, 0, 0])

    def set_paused(self, paused: bool) -> None:
        self.paused = bool(paused)

    def push(self, groups: list, holder: Optional[str] = None, batch: int = 0) -> int:
        """Groups as pack_groups made them (or Experience objects). They are stored as they come: the
        buffer reads only policy_version, so a group crosses rollout -> buffer -> trainer without being
        unpacked and packed again in between.

        holder, batch: who pushes (a rollout worker's incarnation) and its batch number; the buffer is where a
        batch counts as delivered. A holder that was revoked (its worker was lost) is refused: its prompts
        went back to the queue."""
        if holder is not None:
            with self.lock:
                if holder in self.revoked:
                    self.refused_groups += len(groups)
                    self._add("refused", groups)
                    return 0
                record = self._holder(holder)
                record[0], record[1] = max(record[0], int(batch)), record[1] + len(groups)
                record[2] = max(0, record[2] - len(groups))
                self._settle(holder, int(batch))
        accepted = 0
        for g in groups:
            r = group_rewards(g) if self.filter_groups else None
            constant = r is not None and bool((r == r[:1]).all())
            with self.lock:
                self._add("pushed", [g])
                if constant:
                    self._add("filtered", [g])
                self.groups_pushed += 1
                self.filtered_groups += constant
                self.arrived_since_take += 1
                if constant:
                    self.last_filtered = [*self.last_filtered, g][-self.prompts_per_step :]
            if not constant:
                accepted += bool(self.buf.push(g))
        return accepted

    def _add(self, account: str, groups: list, sign: int = 1) -> None:
        """The groups' response tokens and rows to one account of the token ledger."""
        measured = [group_length(g) for g in groups]
        self.measured[account] = [a + sign * sum(m[i] for m in measured) for i, a in enumerate(self.measured[account])]

    def _settle(self, holder: str, batch: int) -> None:
        """Lease `batch` of `holder` is done (pushed, or failed whole); leases count from 1."""
        low, above = self.settled.get(holder, (0, set()))
        if batch > low:
            above.add(batch)
            while low + 1 in above:
                low += 1
                above.discard(low)
        self.settled[holder] = (low, above)

    def settled_leases(self, holder: str) -> tuple[int, list[int]]:
        """(W, the leases above W settled) of `holder`, revoked or not: `PromptQueue.requeue` puts back exactly
        the leases after W not settled (in flight when it was lost)."""
        with self.lock:
            low, above = self.settled.get(holder, (0, set()))
            return low, sorted(above)

    def holder_names(self, prefix: str = "") -> list[str]:
        """The holders (worker incarnations) with pushes or admissions recorded, not revoked."""
        with self.lock:
            return [h for h in self.holders if h.startswith(prefix)]

    def delivered(self, holder: str) -> int:
        """The last batch number accepted from `holder` (-1: none)."""
        with self.lock:
            return self.holders.get(holder, [-1, 0, 0])[0]

    def revoke(self, holder: str) -> int:
        """The holder (a lost or retired worker's incarnation) pushes no more: later pushes are refused and the
        admission it held for groups it never pushed is free again. Returns the last batch number accepted from
        it (-1: none), which `PromptQueue.requeue` takes as `after`."""
        with self.lock:
            self.revoked.add(holder)
            last, groups, outstanding = self.holders.pop(holder, [-1, 0, 0])
            self.revoked_groups += groups
            self.admitted = max(0, self.admitted - outstanding)
            return last

    def take(self, n: int, timeout_s: float, for_version: Optional[int] = None) -> tuple[list, int]:
        """(groups, bound): exactly n groups, oldest first (packed: unpack_groups), or [] if they did not arrive
        within timeout_s; and the max_staleness the take enforced, which the consumer checks against.

        for_version: the trainer version that will consume them (default: the buffer's version). The
        trainer prefetches the batch for V + 1 while step V trains; groups too stale for V + 1 are
        evicted on the way, so every group taken satisfies the staleness bound at the version that
        trains on it, while the buffer's own version stays V (pushes of V stay welcome, and a skipped
        step can still take for V). With filter_groups, fewer than n once the filter rounds are spent."""
        groups, bound = self._take(n, timeout_s, for_version)
        with self.lock:
            self._add("taken", groups)
        return groups, bound

    def _take(self, n: int, timeout_s: float, for_version: Optional[int] = None) -> tuple[list, int]:
        version = self.version if for_version is None else int(for_version)
        if not self.filter_groups:
            return self.buf.take_for_bound(n, version, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:  # in slices: between them, whether the filter rounds are spent
            groups, bound = self.buf.take_for_bound(n, version, min(0.05, max(0.0, deadline - time.monotonic())))
            if not groups:
                groups, bound = self._short_take(n, version)
            if groups or time.monotonic() >= deadline:
                if groups:
                    with self.lock:
                        self.arrived_since_take, self.last_filtered = 0, []
                return groups, bound

    def _short_take(self, n: int, version: int) -> tuple[list, int]:
        """The filter rounds are spent (filter_max_rounds x prompts_per_step groups arrived since the last take)
        and fewer than n groups passed: the ones that did, or, when none did, the newest filtered ones."""
        from rlhf_core.buffer._base import read_version

        with self.lock:
            bound = self.max_staleness
            if self.arrived_since_take < self.filter_max_rounds * self.prompts_per_step:
                return [], bound
        have = min(n, self.buf.fresh_count(version))
        if have:
            groups, bound = self.buf.take_for_bound(have, version, 0)
        else:
            with self.lock:
                groups = [g for g in self.last_filtered if read_version(g) >= version - bound][:n]
                self.filtered_groups -= len(groups)  # trained after all: consumed, not filtered
                self._add("filtered", groups, -1)
                self.filtered_trained += len(groups)
        if groups:
            self.short_takes += 1
        return groups, bound

    def give_back(self, groups: list) -> int:
        """Groups a take handed out that will not be trained on (the trainer stopped with a batch
        prefetched): back to the front of the buffer, uncounted from consumed. Returns how many went back."""
        back = self.buf.requeue(groups)
        self.given_back += len(groups)
        with self.lock:
            self._add("taken", groups, -1)  # back in the buffer (or evicted or dropped there, measured by it)
        return back

    def start_at(self, version: int) -> None:
        """The run starts at trainer version `version` (a resume): admission counts from there, as if the groups
        of every version before had been admitted, so rollout runs at most max_staleness versions ahead from
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
        s = self.buf.stats(contents=True)  # with what it holds: the token ledger's buffered account
        s["sampled"] += self.filtered_trained  # filtered groups trained on a short step count as consumed
        s.update(
            {
                "admitted": self.admitted,
                "capacity": self.capacity(),
                "paused": self.paused,
                "samples_pushed": self.measured["pushed"][1],  # rows: the token ledger's pushed account
                **{f"{k}_{unit}": v[i] for k, v in self.measured.items() for i, unit in enumerate(("tokens", "rows"))},
                "given_back": self.given_back,
                "filtered_groups": self.filtered_groups,
                "filtered_groups_frac": self.filtered_groups / self.groups_pushed if self.groups_pushed else 0.0,
                "short_takes": self.short_takes,
                "revoked_groups": self.revoked_groups,
                "revoked_holders": sorted(self.revoked),
                "refused_groups": self.refused_groups,
                "max_staleness": self.max_staleness,
                # buffer/evicted_length_mean: mean response length of the evicted groups' rows (0 before any)
                "evicted_length_mean": s["evicted_tokens"] / s["evicted_rows"] if s["evicted_rows"] else 0.0,
            }
        )
        return s


def buffer_options(cfg: TrainConfig) -> dict:
    """The run's ExperienceBuffer arguments, the same on every host (`ExperienceBuffer(**buffer_options(cfg))`, or
    the Ray actor's `.remote(**buffer_options(cfg))`): with the autopilot, its ceiling bounds the staleness."""
    pilot = cfg.runtime.autopilot
    return dict(
        max_size=cfg.buffer.max_size,
        max_staleness=cfg.runtime.max_staleness,
        prompts_per_step=cfg.trainer.prompts_per_step,
        filter_groups=cfg.algorithm.filter_groups,
        ceiling=pilot.max_staleness if pilot.enabled else None,
        filter_max_rounds=cfg.algorithm.filter_max_rounds,
    )


def group_rewards(group):
    """A group's rewards [G] (packed or not), without copying a packed array; None if unscored."""
    if not isinstance(group, dict):
        return group.batch.rewards
    if "rewards" not in group["batch"]:
        return None
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only received array: only read here
        return torch.from_numpy(group["batch"]["rewards"][1])


# --------------------------------------------------------------------------------------------- weights
class WeightStore:
    """The latest published weights and their version: on Ray an object reference (one ray.put of a packed CPU
    state dict, `rlhf_core.distributed.peers.RemoteWeights`), in one process the state dict itself (or None
    when the rollout engine generates with the trainer's own model: publishing is then only the version)."""

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
        if self.version < 0 or self.version <= version:
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


def poll_metrics(buffer_stats: dict, trainer_stats: dict, alive_workers: list[dict]) -> dict:
    """What every host adds to each step's metrics at a poll: the buffer's counters, each role's busy fraction
    (util/rollout_busy: the mean over the live rollout workers), the env/* and agent/* counts of the run so far
    (all workers), the latest sync probe's sync/probe_kl and sync/probe_diff (the worst worker's), ledger/*."""
    b = buffer_stats
    shared = {
        "buffer/size": b["size"],
        "buffer/evicted_stale": b["evicted_stale"],
        "buffer/evicted_length_mean": b.get("evicted_length_mean", 0.0),
        "buffer/dropped_overflow": b["dropped_overflow"],
        "buffer/filtered_groups_frac": b.get("filtered_groups_frac", 0.0),
        "util/rollout_busy": sum(s.get("busy_frac", 0.0) for s in alive_workers) / max(1, len(alive_workers)),
        "util/trainer_busy": trainer_stats["busy_frac"],
    }
    shared.update({f"ledger/{k}": float(v) for k, v in token_ledger(b, trainer_stats).items()})
    for key in sorted({k for s in alive_workers for k in s if k.startswith(("env/", "agent/"))}):
        shared[key] = float(sum(s.get(key, 0.0) for s in alive_workers))
    probed = [s for s in alive_workers if s.get("sync_probe_kl") is not None]  # each one's latest sync probe
    if probed:
        shared["sync/probe_kl"] = max(float(s["sync_probe_kl"]) for s in probed)
        shared["sync/probe_diff"] = max(float(s["sync_probe_diff"]) for s in probed)
    return shared


def assemble_poll(run, metrics: list[dict], trainer: dict, buffer: dict, queue: dict, rollout: list[dict],
                  extra_metrics: Optional[dict] = None, cluster: Optional[dict] = None) -> dict:  # fmt: skip
    """Every host's poll result, from what it gathered: the trainer metrics drained since the last poll (each given
    `poll_metrics` over the live workers, plus the host's `extra_metrics`), the step and version (set on `run`), the
    events since the last poll (`run._new_events`, drained) and the dict the supervision reads. `cluster`: the Ray
    host's fleet (only it has one; the key is absent on the others)."""
    shared = {**poll_metrics(buffer, trainer, [s for s in rollout if s["alive"]]), **(extra_metrics or {})}
    if "solved_frac" in queue:  # data.sampler prioritized: the share of prompts whose latest group was solved
        shared["data/solved_frac"] = queue["solved_frac"]
    for m in metrics:
        m.update(shared)
        if "mismatch/engine_kl" not in m and "sync/probe_kl" in shared:  # no fresh token: the latest sync probe's
            m["mismatch/engine_kl"] = shared["sync/probe_kl"]  # k3 of engine-sampled tokens (rollout/probe.py)
    run.last_step, run.last_version = trainer["step"], trainer["version"]
    events, run._new_events = run._new_events, []
    poll = {"step": run.last_step, "version": run.last_version, "done": run.done, "metrics": metrics}
    poll.update(buffer=buffer, queue=queue, rollout=rollout, trainer=trainer)
    if cluster is not None:
        poll["cluster"] = cluster
    return {**poll, "events": events, "failed": run.failed}


# --------------------------------------------------------------------------------------------- failures
class RunFailed(RuntimeError):
    """The run cannot go on (trainer failure, worker restart limit, stall); the message names the cause."""


class WorkerDied(RuntimeError):
    """A rollout worker's process died (Ray restarts it, up to cluster.max_restarts): this loop ended with it."""
