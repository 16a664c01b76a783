"""The staleness autopilot's decision policy: plain Python, no Ray, no Prefect, no torch.

Every framework makes the user pick the staleness bound by hand: too low starves the trainer (it waits for
data the rollout may not generate yet), too high lets the behaviour policy drift from the trained one. The
autopilot moves `runtime.max_staleness` within [min_staleness, max_staleness] (runtime.autopilot) from what
the trainer measures at every step:

- the mismatch, `async/mismatch_m2`: the mean squared log-ratio between the behaviour and the current policy
  on the tokens trained on (the importance weights' second moment in log space, M2PO's statistic);
- the trainer's waiting, `time/wait_s` over `time/wait_s + time/train_s`;
- the staleness of the data trained on, `async/staleness_max`: whether the bound is what holds the rollout back.

Rules, on the steps observed since the last decision: a mean mismatch above target_m2 lowers the bound by one
(however the trainer waits: stability first); the trainer waiting more than WAIT_FRAC of its time with the
mismatch at or under the target raises it by one, but only while the data trained on reaches the bound (its
staleness_max is at the bound): then admission control is what holds the rollout back and a wider bound lets
it run ahead. Data fresher than the bound means the rollout is the slower role and generates as fast as it can
whatever the bound: a wider one would add staleness and no data (measured: without this rule, a rollout-bound
run climbed to the ceiling and took 84 s to 0.9 against 24-57 s for the fixed bounds).
After a change nothing moves for cooldown_steps trainer steps, so that the next decision sees data generated
under the new bound. The supervisor (rlhf_core.supervision) applies a decision through the runtime and reports
it as a health event with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

WAIT_FRAC = 0.2
"""The trainer counts as waiting for data when time/wait_s is above this fraction of its step time (the
autoscaler's rlhf_core.autoscale.GROW_WAIT_FRAC is the same figure)."""


@dataclass
class BoundChange:
    """A decision: the new bound, the old one, and why."""

    bound: int
    previous: int
    reason: str

    @property
    def kind(self) -> str:
        return "autopilot_raise" if self.bound > self.previous else "autopilot_lower"


class StalenessAutopilot:
    """Decides the staleness bound from streams of trainer metrics (`observe`). cfg: runtime.autopilot."""

    def __init__(self, cfg, start_bound: int, start_step: int = 0):
        self.cfg = cfg
        self.bound = max(cfg.min_staleness, min(int(start_bound), cfg.max_staleness))
        self.last_change_step = start_step
        self.changes: list[BoundChange] = []
        self._pending: list[dict] = []

    def observe(self, metrics: list[dict], step: int) -> Optional[BoundChange]:
        """Take the trainer metrics of the steps since the last call (each a dict with async/mismatch_m2,
        time/wait_s, time/train_s, async/staleness_max) and the trainer's step; returns a BoundChange, or None to
        keep the bound."""
        self._pending.extend(m for m in metrics if "async/mismatch_m2" in m)
        if step - self.last_change_step < self.cfg.cooldown_steps or not self._pending:
            return None
        window, self._pending = self._pending, []
        m2 = sum(float(m["async/mismatch_m2"]) for m in window) / len(window)
        wait = sum(float(m.get("time/wait_s", 0.0)) for m in window)
        train = sum(float(m.get("time/train_s", 0.0)) for m in window)
        wait_frac = wait / (wait + train) if wait + train > 0 else 0.0
        # a window without the figure (older trainers, scripted streams) counts as at the bound
        oldest = max(int(m.get("async/staleness_max", self.bound)) for m in window)
        target = self.cfg.target_m2
        change = None
        if m2 > target and self.bound > self.cfg.min_staleness:
            change = BoundChange(
                self.bound - 1,
                self.bound,
                f"mismatch async/mismatch_m2 {m2:.4g} > target_m2 {target:g} over {len(window)} step(s)",
            )
        elif m2 <= target and wait_frac > WAIT_FRAC and oldest >= self.bound and self.bound < self.cfg.max_staleness:
            change = BoundChange(
                self.bound + 1,
                self.bound,
                f"the trainer waited {wait_frac:.0%} of its time (> {WAIT_FRAC:.0%}) and "
                f"async/mismatch_m2 {m2:.4g} <= target_m2 {target:g}, with data at the bound (staleness {oldest}), "
                f"over {len(window)} step(s)",
            )
        if change is not None:
            self.bound = change.bound
            self.last_change_step = step
            self.changes.append(change)
        return change
