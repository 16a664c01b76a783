"""The health checks of a running run (rlhf_core.supervision's policies): `HealthMonitor.check(poll)` reads one
poll and returns a `Decision`; every finding is a `HealthEvent`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from rlhf_core.autopilot import StalenessAutopilot
from rlhf_core.autoscale import FleetPolicy
from rlhf_core.config import TrainConfig


@dataclass
class HealthEvent:
    step: int
    kind: str
    severity: str  # info | warning | error
    action: str
    detail: str
    time: float = field(default_factory=time.time)

    def row(self) -> dict:
        d = asdict(self)
        d["time"] = time.strftime("%H:%M:%S", time.localtime(self.time))
        return d


@dataclass
class Decision:
    request_sync: bool = False
    throttle: Optional[bool] = None  # True: pause admission, False: resume, None: leave as is
    top_up: Optional[int] = None  # prompts to schedule; None: the runtime's backpressure default
    max_staleness: Optional[int] = None  # the autopilot's new staleness bound
    rollout_workers: Optional[int] = None  # a new fleet size (atrlhf scale, or the autoscaler)
    rollout_workers_reason: str = ""
    fail: Optional[str] = None
    events: list[HealthEvent] = field(default_factory=list)


class SupervisionError(RuntimeError):
    """Supervision stopped the run: a health limit from cfg.supervision was exceeded (the message says which)."""


class HealthMonitor:
    """Stateful checks over successive polls, one method per check. Decides; acts on nothing itself."""

    def __init__(
        self,
        cfg: TrainConfig,
        start_step: int = 0,
        now: Optional[float] = None,
        start_bound: Optional[int] = None,
    ):
        self.cfg = cfg
        self.sup = cfg.supervision
        now = time.monotonic() if now is None else now
        self.last_step = start_step
        self.last_progress = now
        self.nonfinite_run = 0
        self.restarts_seen = 0
        self.down_since: dict[int, float] = {}
        self.staleness_high = False
        self.staleness_warned = False  # a staleness_high warning is out (a mean above max_staleness)
        self.last_sync_version = -1
        self.throttled = False
        self.throttle_reason: Optional[str] = None
        self.starving = False
        self.dropped_seen = 0
        self.mismatch_polls = 0  # consecutive polls with mismatch/engine_kl above supervision.engine_mismatch.kl
        self.mismatch_warned = False
        self.events: list[HealthEvent] = []
        pilot = cfg.runtime.autopilot
        # start_bound: the bound a resumed autopilot had reached (from the checkpoint)
        bound = cfg.runtime.max_staleness if start_bound is None else start_bound
        self.autopilot = StalenessAutopilot(pilot, bound, start_step) if pilot.enabled else None
        self.fleet = FleetPolicy(cfg, start_step)

    @property
    def max_staleness(self) -> int:
        """The staleness bound in force: the autopilot's, or runtime.max_staleness."""
        return self.autopilot.bound if self.autopilot is not None else self.cfg.runtime.max_staleness

    # ------------------------------------------------------------------ the check
    def check(self, poll: dict, now: Optional[float] = None) -> Decision:
        """All checks on one poll, in order; the first that fails the run ends the check."""
        now = time.monotonic() if now is None else now
        d = Decision()
        step = int(poll.get("step", self.last_step))
        for ev in poll.get("events") or []:  # the runtime's own findings (worker died / restarted, ...)
            self._event(d, step, str(ev.get("kind", "runtime")), "warning", "observed", str(ev.get("detail", "")))
        checks = [
            self._runtime_failure,
            self._nonfinite_losses,
            self._worker_restarts,
            self._worker_outages,
            self._autopilot,
            self._fleet,
            self._staleness,
            self._overflow,
            self._starvation,
            self._engine_mismatch,
            self._stall,
        ]
        for check in checks:
            check(d, poll, step, now)
            if d.fail:
                break
        return d

    def _runtime_failure(self, d: Decision, poll: dict, step: int, now: float) -> None:
        if poll.get("failed"):
            self._fail(d, step, "runtime_failed", f"the runtime reported a failure: {poll['failed']}")

    def _nonfinite_losses(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """Non-finite (skipped) trainer steps in a row, in step order; nonfinite_limit of them fails the run."""
        was = self.nonfinite_run
        for m in poll.get("metrics") or []:
            self.nonfinite_run = self.nonfinite_run + 1 if float(m.get("trainer/step_finite", 1.0)) == 0.0 else 0
        self.nonfinite_run = max(self.nonfinite_run, int((poll.get("trainer") or {}).get("consecutive_skips", 0) or 0))
        if self.nonfinite_run > was:
            self._event(
                d,
                step,
                "nonfinite_loss",
                "warning",
                "step skipped, counted",
                f"{self.nonfinite_run} consecutive non-finite trainer step(s) "
                f"(limit supervision.nonfinite_limit={self.sup.nonfinite_limit})",
            )
        if self.nonfinite_run >= self.sup.nonfinite_limit:
            self._fail(
                d,
                step,
                "nonfinite_limit",
                f"{self.nonfinite_run} consecutive non-finite trainer steps reached "
                f"supervision.nonfinite_limit={self.sup.nonfinite_limit}",
            )

    def _worker_restarts(self, d: Decision, poll: dict, step: int, now: float) -> None:
        restarts = (poll.get("cluster") or {}).get("restarts_total")  # every worker's, retired ones too
        if restarts is None:
            restarts = sum(int(w.get("restarts", 0)) for w in poll.get("rollout") or [])
        if restarts > self.restarts_seen:
            self._event(
                d,
                step,
                "worker_restart",
                "warning",
                "waiting for Ray to restart it",
                f"rollout worker restarts: {restarts} in this run (budget cluster.max_restarts="
                f"{self.cfg.cluster.max_restarts})",
            )
            self.restarts_seen = restarts
        if restarts > self.cfg.cluster.max_restarts:
            self._fail(
                d,
                step,
                "restart_limit",
                f"rollout workers restarted {restarts} times, above cluster.max_restarts="
                f"{self.cfg.cluster.max_restarts}",
            )

    def _worker_outages(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """A worker that does not answer is waited for; down for stall_timeout_s fails the run."""
        workers = poll.get("rollout") or []
        for pos, w in enumerate(workers):
            i = int(w.get("index", pos))
            if w.get("error") == "starting":  # a worker the fleet just added: not up yet, not down
                continue
            if w.get("alive", True):
                if self.down_since.pop(i, None) is not None:
                    self._event(d, step, "worker_back", "info", "none", f"rollout worker {i} answers again")
            elif i not in self.down_since:
                self.down_since[i] = now
                self._event(
                    d,
                    step,
                    "worker_down",
                    "warning",
                    "waiting for Ray to restart it",
                    f"rollout worker {i} does not answer ({w.get('error', 'unknown')})",
                )
            elif now - self.down_since[i] > self.sup.stall_timeout_s:
                self._fail(
                    d,
                    step,
                    "worker_lost",
                    f"rollout worker {i} has been down for {now - self.down_since[i]:.0f} s "
                    f"(supervision.stall_timeout_s={self.sup.stall_timeout_s:g})",
                )
                return

    def _autopilot(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """The staleness autopilot: a new runtime.max_staleness when its policy says so, with the reason."""
        if self.autopilot is None:
            return
        change = self.autopilot.observe(poll.get("metrics") or [], step)
        if change is not None:
            d.max_staleness = change.bound
            self._event(
                d,
                step,
                change.kind,
                "info",
                f"runtime.max_staleness {change.previous} -> {change.bound}",
                change.reason,
            )

    def _fleet(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """The number of rollout workers (rlhf_core.autoscale: a scale request or the autoscaler)."""
        change = self.fleet.decide(poll, step, poll.get("scale_request"))
        if change is None:
            return
        before = (poll.get("cluster") or {}).get("rollout_workers", "?")
        if change.workers is None:
            self._event(d, step, change.kind, "warning", "refused", change.reason)
            return
        d.rollout_workers, d.rollout_workers_reason = change.workers, change.reason
        self._event(d, step, change.kind, "info", f"rollout workers {before} -> {change.workers}", change.reason)

    def _staleness(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """High mean staleness: publish early (when that helps); a warning for a mean above the bound."""
        metrics = poll.get("metrics") or []
        max_tau = self.max_staleness
        limit = self.sup.staleness_warn * max_tau
        if not metrics or max_tau == 0:
            return
        stale = float(metrics[-1].get("async/staleness_mean", 0.0))
        if stale <= limit:
            if self.staleness_warned:
                self._event(
                    d, step, "staleness_ok", "info", "none", f"mean staleness {stale:.2f} back under {limit:.2f}"
                )
            self.staleness_high, self.staleness_warned = False, False
            return
        # publishing early only helps when the trainer publishes less often than every version and some
        # worker still generates with older weights than the trainer's
        version = int(poll.get("version", step))
        loaded = [int(w["version"]) for w in poll.get("rollout") or [] if w.get("alive", True) and "version" in w]
        behind = bool(loaded) and min(loaded) < version
        can_sync = self.cfg.runtime.sync_every > 1
        if stale > max_tau and not self.staleness_warned:
            # Staleness up to runtime.max_staleness is the design working (async rollout runs ahead by up to
            # that many versions): no event. Only a mean above the hard bound is a real problem.
            self._event(
                d,
                step,
                "staleness_high",
                "warning",
                "publish weights now" if can_sync else "watch (weights are published every version)",
                f"mean staleness {stale:.2f} > runtime.max_staleness = {max_tau}",
            )
            self.staleness_warned = True
        self.staleness_high = True
        if can_sync and behind and version > self.last_sync_version:
            d.request_sync = True
            self.last_sync_version = version

    def _overflow(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """Groups dropped on overflow: pause admission until the buffer is back under half its capacity."""
        buffer = poll.get("buffer") or {}
        dropped = int(buffer.get("dropped_overflow", 0))
        if dropped > self.dropped_seen:
            self._event(
                d,
                step,
                "buffer_overflow",
                "warning",
                "pause admission",
                f"{dropped - self.dropped_seen} group(s) dropped on overflow (buffer.max_size="
                f"{self.cfg.buffer.max_size})",
            )
            self.dropped_seen = dropped
            self._set_throttle(d, step, True, "buffer overflow")
        elif self.throttle_reason == "buffer overflow" and int(buffer.get("size", 0)) <= self.cfg.buffer.max_size // 2:
            self._set_throttle(d, step, False, "buffer back under half its capacity")

    def _starvation(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """A trainer without a step's worth of data for longer than a few polls (not just warming up)."""
        per_step = self.cfg.trainer.prompts_per_step
        buffer_size = int((poll.get("buffer") or {}).get("size", 0))
        starving = (
            buffer_size < per_step
            and step <= self.last_step
            and now - self.last_progress > 3 * self.sup.supervise_interval_s
        )
        if starving and not self.starving:
            self._event(
                d,
                step,
                "buffer_starving",
                "warning",
                "resume admission, schedule more prompts",
                f"buffer holds {buffer_size} group(s), the trainer needs {per_step} per step",
            )
        self.starving = starving
        if starving:
            self._set_throttle(d, step, False, "the trainer is starving")
            d.top_up = 2 * per_step
        elif self.throttled and buffer_size < per_step:
            self._set_throttle(d, step, False, "the buffer fell below one trainer step")

    def _engine_mismatch(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """mismatch/engine_kl (the KL of tokens generated by the very weights the trainer held: numerics, not
        staleness; rlhf_core.trainer.ledger) above engine_mismatch.kl for engine_mismatch.polls polls: a warning
        naming the likely causes. A poll without the metric leaves the count as it is."""
        values = [float(m["mismatch/engine_kl"]) for m in poll.get("metrics") or [] if "mismatch/engine_kl" in m]
        if not values:
            return
        limit, kl = self.sup.engine_mismatch.kl, values[-1]
        if kl <= limit:
            if self.mismatch_warned:
                self._event(d, step, "engine_mismatch_ok", "info", "none", f"mismatch/engine_kl {kl:.3g} <= {limit:g}")
            self.mismatch_polls, self.mismatch_warned = 0, False
            return
        self.mismatch_polls += 1
        if self.mismatch_polls >= self.sup.engine_mismatch.polls and not self.mismatch_warned:
            self.mismatch_warned = True
            self._event(
                d,
                step,
                "engine_mismatch",
                "warning",
                "check the rollout engine; consider algorithm.rollout_correction",
                f"mismatch/engine_kl {kl:.3g} > supervision.engine_mismatch.kl={limit:g} for {self.mismatch_polls} "
                "polls on tokens generated with the trainer's own version: the rollout engine does not compute "
                "what the trainer does. Likely causes: published weights not loaded by the engine (a sync that "
                "fails silently), a dtype or sampling difference (rollout.engine_kwargs.dtype, top_p/top_k/min_p, "
                "temperature), "
                "a stale LoRA adapter (adapters not synced or another model.lora)",
            )

    def _stall(self, d: Decision, poll: dict, step: int, now: float) -> None:
        """No trainer step for stall_timeout_s fails the run, naming the role that is stuck."""
        if step > self.last_step:
            self.last_step, self.last_progress = step, now
        elif now - self.last_progress > self.sup.stall_timeout_s and not poll.get("done"):
            self._fail(
                d,
                step,
                "stall",
                f"no trainer step for {now - self.last_progress:.0f} s "
                f"(supervision.stall_timeout_s={self.sup.stall_timeout_s:g}); stuck: {self.stuck_role(poll)}",
            )

    def stuck_role(self, poll: dict) -> str:
        workers = poll.get("rollout") or []
        buffer = poll.get("buffer") or {}
        buffer_size = int(buffer.get("size", 0))
        if workers and not any(w.get("alive", True) for w in workers):
            return "rollout (every rollout worker is down)"
        if buffer_size >= self.cfg.trainer.prompts_per_step:
            return (
                f"trainer (the buffer holds {buffer_size} group(s), enough for a step, but the trainer does not "
                f"step; trainer stats: {poll.get('trainer')})"
            )
        if self.throttled:
            return f"rollout (admission paused by the flow: {self.throttle_reason})"
        filtered = float(buffer.get("filtered_groups_frac", 0.0))
        if self.cfg.algorithm.filter_groups and filtered >= 0.5:
            return (
                f"rollout: algorithm.filter_groups dropped {filtered:.0%} of the groups generated (every reward of "
                f"a group equal), so too few reach the buffer ({buffer_size} of {self.cfg.trainer.prompts_per_step} "
                "needed); the task is saturated or too hard for the policy: raise algorithm.filter_max_rounds, or "
                "turn filter_groups off"
            )
        return (
            f"rollout (only {buffer_size} group(s) reached the buffer; queue: {poll.get('queue')}; "
            f"workers busy: {[round(float(w.get('busy_frac', 0.0)), 2) for w in workers]})"
        )

    # ------------------------------------------------------------------ helpers
    def _event(self, d: Decision, step: int, kind: str, severity: str, action: str, detail: str) -> None:
        ev = HealthEvent(step, kind, severity, action, detail)
        d.events.append(ev)
        self.events.append(ev)

    def _fail(self, d: Decision, step: int, kind: str, message: str) -> None:
        d.fail = message
        self._event(d, step, kind, "error", "fail", message)

    def _set_throttle(self, d: Decision, step: int, paused: bool, reason: str) -> None:
        if paused == self.throttled:
            return
        self.throttled, self.throttle_reason = paused, (reason if paused else None)
        d.throttle = paused
        self._event(
            d,
            step,
            "throttle" if paused else "unthrottle",
            "info",
            "paused rollout admission" if paused else "resumed rollout admission",
            reason,
        )
