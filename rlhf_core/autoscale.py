"""The number of rollout workers of a running run: the one policy over it. Plain Python: no Ray, no Prefect.

Two sources may ask for a fleet size, never both in one run:

- `atrlhf scale <run> --rollout-workers N` (a request in the run directory, `rlhf_core.run.requests`): applied
  as asked, while cluster.autoscale is off; refused with an event while it is on (the autoscaler owns the knob).
- cluster.autoscale.enabled: from the trainer's steps since the last decision (after cooldown_steps),
  - the trainer waited for data more than GROW_WAIT_FRAC of its time (`time/wait_s` over wait + train) while the
    rollout workers were busy (`util/rollout_busy` at least GROW_BUSY: they generate as fast as they can, it is
    not admission holding them back) and the cluster has room for one more worker -> one more, up to
    max_workers;
  - the trainer waited less than SHRINK_WAIT_FRAC of its time and the workers were idle more than half of theirs
    (admission held them: the trainer is the bottleneck) -> one fewer, down to min_workers.

The supervisor (rlhf_core.supervision) applies a decision through the runtime (`set_rollout_workers`) and reports
it as a health event; the fleet size is the metric `cluster/rollout_workers` at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GROW_WAIT_FRAC = 0.2
GROW_BUSY = 0.7
SHRINK_WAIT_FRAC = 0.05
SHRINK_BUSY = 0.5


@dataclass
class FleetChange:
    """A decision: the new number of rollout workers (None: refused), what kind of event it is and why."""

    workers: Optional[int]
    kind: str
    reason: str


class FleetPolicy:
    """Decides the fleet size from scale requests and the trainer's metrics (`decide`). cfg: the TrainConfig."""

    def __init__(self, cfg, start_step: int = 0):
        self.auto = cfg.cluster.autoscale
        self.workers = cfg.rollout.num_workers
        self.last_change_step = start_step
        self._pending: list[dict] = []

    def decide(self, poll: dict, step: int, request: Optional[int] = None) -> Optional[FleetChange]:
        """One poll's decision. `request`: a fleet size `atrlhf scale` asked for since the last poll."""
        cluster = poll.get("cluster") or {}
        self.workers = int(cluster.get("rollout_workers", self.workers))
        if request is not None:
            return self._requested(int(request))
        if not self.auto.enabled:
            return None
        self._pending.extend(m for m in poll.get("metrics") or [] if "time/wait_s" in m)
        if step - self.last_change_step < self.auto.cooldown_steps or not self._pending:
            return None
        window, self._pending = self._pending, []
        wait = sum(float(m.get("time/wait_s", 0.0)) for m in window)
        train = sum(float(m.get("time/train_s", 0.0)) for m in window)
        wait_frac = wait / (wait + train) if wait + train > 0 else 0.0
        busy = sum(float(m.get("util/rollout_busy", 0.0)) for m in window) / len(window)
        over = f"over {len(window)} step(s)"
        change = None
        if wait_frac > GROW_WAIT_FRAC and busy >= GROW_BUSY and self.workers < self.auto.max_workers:
            if cluster.get("room_for_worker", True):
                change = FleetChange(
                    self.workers + 1,
                    "autoscale_grow",
                    f"the trainer waited {wait_frac:.0%} of its time for data with the rollout workers {busy:.0%} busy "
                    f"{over}",
                )
        elif wait_frac < SHRINK_WAIT_FRAC and busy < SHRINK_BUSY and self.workers > self.auto.min_workers:
            change = FleetChange(
                self.workers - 1,
                "autoscale_shrink",
                f"the trainer waited {wait_frac:.0%} of its time and the rollout workers were {busy:.0%} busy "
                f"(admission held them: the trainer is the bottleneck) {over}",
            )
        if change is not None:
            self.last_change_step = step
            self.workers = change.workers
        return change

    def _requested(self, n: int) -> FleetChange:
        if self.auto.enabled:
            return FleetChange(
                None,
                "scale_refused",
                f"a request for {n} rollout worker(s) was refused: cluster.autoscale is enabled and owns the number "
                f"of workers (within [{self.auto.min_workers}, {self.auto.max_workers}])",
            )
        if n < 1:
            return FleetChange(None, "scale_refused", f"a request for {n} rollout worker(s): at least 1 is needed")
        return FleetChange(n, "scale_requested", f"atrlhf scale asked for {n} rollout worker(s)")
