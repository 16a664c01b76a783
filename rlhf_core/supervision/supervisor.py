"""One supervision tick (rlhf_core.supervision): poll the runtime, check its health, report, act."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from rlhf_core.config import TrainConfig
from rlhf_core.supervision.audit import RunAudit
from rlhf_core.supervision.monitor import Decision, HealthEvent, HealthMonitor, SupervisionError


class Supervisor:
    """One supervision tick: poll, check health, report the events, act on the decision.

    `runtime` is a DistributedRun (or anything with its control methods); `report(event)` is called for
    every HealthEvent before the decision is applied, so a failure is reported before it is raised.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        runtime,
        start_step: int = 0,
        report: Optional[Callable[[HealthEvent], None]] = None,
        requests=None,
    ):
        self.cfg = cfg
        self.runtime = runtime
        self.requests = requests  # rlhf_core.run.requests.ScaleRequests: `atrlhf scale` asking for a fleet size
        self.fleet_size = cfg.rollout.num_workers
        # a resumed autopilot goes on from the bound it had reached (the runtime restored it into the buffer)
        start_bound = getattr(runtime, "restored_max_staleness", None)
        self.monitor = HealthMonitor(cfg, start_step=start_step, start_bound=start_bound)
        self.report = report or (lambda event: None)
        self.audit = RunAudit(cfg, start_step) if cfg.supervision.audit != "off" else None

    @property
    def events(self) -> list[HealthEvent]:
        return self.monitor.events

    def tick(self) -> dict:
        """Returns the poll. Raises SupervisionError when a health limit is exceeded."""
        poll = self.runtime.poll()
        request = poll["scale_request"] = self.requests.poll() if self.requests is not None else None
        decision = self.monitor.check(poll)
        self.audit_poll(poll, decision)
        for event in decision.events:
            self.report(event)
        self.apply(decision)
        if request is not None:  # `atrlhf scale` waits for this answer
            said = [e.detail for e in decision.events if e.kind.startswith("scale")]
            self.requests.answer(self.fleet_size if decision.rollout_workers is not None else None, "; ".join(said))
        return poll

    def audit_poll(self, poll: dict, d: Optional[Decision] = None) -> list[HealthEvent]:
        """The poll's evidence to the run audit, then its new findings (`audit_findings`)."""
        if self.audit is None:
            return []
        self.audit.observe(poll)
        return self.audit_findings(int(poll.get("step", self.monitor.last_step)), d)

    def audit_findings(self, step: int, d: Optional[Decision] = None) -> list[HealthEvent]:
        """Each audit verdict newly inactive or failed becomes a health event: added to `d` (reported with the
        decision; with supervision.audit 'fail' the decision ends the run), or reported here when there is none."""
        if self.audit is None:
            return []
        ends = self.cfg.supervision.audit == "fail"
        events = [
            HealthEvent(
                step,
                f"audit_{c.name}",
                "error" if c.verdict == "failed" or ends else "warning",
                "fail" if ends else "none",
                f"audit: {c.name} {c.verdict}: {c.evidence}",
            )
            for c in self.audit.findings()
        ]
        self.monitor.events.extend(events)
        if d is not None:
            d.events.extend(events)
            if events and ends and not d.fail:
                d.fail = f"supervision.audit is fail and the run audit found: {events[0].detail}"
        else:
            for event in events:
                self.report(event)
        return events

    def apply(self, d: Decision) -> None:
        if d.fail:
            raise SupervisionError(d.fail)
        if d.request_sync:
            self.runtime.request_sync()
        if d.throttle is not None:
            self.runtime.throttle(d.throttle)
        if d.max_staleness is not None:
            self.runtime.set_max_staleness(d.max_staleness)
        if d.rollout_workers is not None:
            if hasattr(self.runtime, "set_rollout_workers"):
                self.fleet_size = self.runtime.set_rollout_workers(d.rollout_workers, d.rollout_workers_reason)
            else:
                d.rollout_workers = None
                self.monitor._event(
                    d,
                    self.monitor.last_step,
                    "scale_unsupported",
                    "warning",
                    "none",
                    "this host runs its rollout in one process (cluster.host: threads): its fleet cannot change",
                )
                self.report(d.events[-1])
        if not self.monitor.throttled:
            self.runtime.top_up_prompts(d.top_up)
