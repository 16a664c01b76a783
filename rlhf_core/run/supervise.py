"""The one supervision loop of a run: start the loops, then poll, act and record until the trainer reaches
trainer.total_steps (or the run is cancelled), then stop the loops and record what came after the last poll.

The Prefect flow (`flows/train.py`) and the driver without Prefect (`rlhf_core.distributed.run_distributed`)
both run it; each passes its sinks (`Sinks`): the flow's log to MLflow and Prefect, the driver's to a list and
the log. The decisions (health checks and their actions) are `rlhf_core.supervision.Supervisor`'s; this loop
only paces them. Plain Python: no Ray, no Prefect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from rlhf_core.run.accounting import reconcile
from rlhf_core.run.checkpoint import CheckpointError, read_checkpoint
from rlhf_core.run.requests import ScaleRequests
from rlhf_core.supervision import HealthEvent, Supervisor

log = logging.getLogger("rlhf_core.run")

FAILED_GRACE_S = 3.0  # how long a failed run's loops get to return before the teardown ends them


def stop_grace(wait_timeout_s: float, grace_s: Optional[float] = None) -> float:
    """How long a host's stop waits for its loops: `grace_s` when given, else runtime.wait_timeout_s capped at
    30 s (a normal stop: the loops finish their batch, give a prefetched batch back, and the counts close)."""
    return min(wait_timeout_s, 30.0) if grace_s is None else grace_s


class Every:
    """Fires at the first step at or after each multiple of `every`; never when every is 0."""

    def __init__(self, every: int, step: int):
        self.every = every
        self.next = (step // every + 1) * every if every else None

    def due(self, step: int) -> bool:
        if self.next is None or step < self.next:
            return False
        self.next = (step // self.every + 1) * self.every
        return True


def _nothing(*args) -> None:
    return None


@dataclass
class Sinks:
    """What the host of the loop does with what the loop observes. Every hook is optional.

    on_event(HealthEvent): a health finding, reported before the decision is applied (a failure before it raises)
    on_poll(poll): each poll (its per-step metrics, stats, events)
    on_checkpoint({step, path, rollout_rng_missing}): a checkpoint the trainer wrote
    evaluate(step): a held-out evaluation is due (every eval.every steps, before the last)
    on_tick(poll): after each poll's records (progress lines, artifacts)
    cancelled() -> bool: checked every `cancel_check_s`; True stops the loops and ends the loop early
    wait(seconds): between polls (default: the runtime's `wait`, else sleep)
    after_stop(): once the loops are told to stop (e.g. wait for the task runs that watch them)
    on_audit(report): the run audit (rlhf_core.supervision.audit), at every poll and once final at the end (also
        when the run fails or is cancelled); the loop itself keeps <run dir>/audit.json current"""

    on_event: Callable[[HealthEvent], None] = _nothing
    on_poll: Callable[[dict], None] = _nothing
    on_checkpoint: Callable[[dict], None] = _nothing
    evaluate: Optional[Callable[[int], None]] = None
    on_tick: Callable[[dict], None] = _nothing
    cancelled: Callable[[], bool] = lambda: False
    cancel_check_s: float = 1.0
    wait: Optional[Callable[[float], None]] = None
    after_stop: Callable[[], None] = _nothing
    on_audit: Callable[[dict], None] = _nothing
    events: list[HealthEvent] = field(default_factory=list)  # filled with the supervisor's findings


def supervise(cfg, runtime, start_step: int, sinks: Sinks) -> bool:
    """Supervise `runtime` (a DistributedRun, or anything with its control methods) from `start_step` to
    cfg.trainer.total_steps. Returns False when `sinks.cancelled()` said so; raises SupervisionError when a health
    limit is exceeded (the runtime is left to its owner's teardown). The run audit is made final on every way out."""
    total = cfg.trainer.total_steps
    requests = ScaleRequests(cfg.run.run_dir)  # `atrlhf scale` asking this run for a fleet size
    supervisor = Supervisor(cfg, runtime, start_step=start_step, report=sinks.on_event, requests=requests)
    sinks.events = supervisor.events
    evaluations = Every(cfg.eval.every, start_step)
    interval = cfg.supervision.supervise_interval_s
    wait = sinks.wait or getattr(runtime, "wait", None) or time.sleep
    last_cancel_check = time.monotonic()
    audit = Audit(cfg, supervisor, sinks)

    def record(poll: dict) -> None:
        sinks.on_poll(poll)
        for written in runtime.new_checkpoints():  # written by the trainer at multiples of checkpoint_every
            audit.checkpoint = written
            sinks.on_checkpoint(written)
        audit.publish()

    ended = False  # the loops stopped and their last poll recorded (finished or cancelled)
    cancelled = False
    try:
        runtime.start()
        while True:
            poll = supervisor.tick()
            record(poll)
            if sinks.evaluate is not None and evaluations.due(poll["step"]) and poll["step"] < total:
                sinks.evaluate(poll["step"])
            sinks.on_tick(poll)
            if poll["done"]:
                break
            now = time.monotonic()
            if now - last_cancel_check > sinks.cancel_check_s:
                last_cancel_check = now
                if sinks.cancelled():
                    cancelled = True
                    break
            wait(interval)
        runtime.stop()
        sinks.after_stop()
        last = runtime.poll()
        supervisor.audit_poll(last)
        record(last)  # what came after the last poll: the last steps' metrics and checkpoints
        audit.final_poll, ended = last, True
        return not cancelled
    finally:  # a failed run's loops are still its teardown's: the ledger is left open
        audit.finish(failed=not ended)


class Audit:
    """The supervision loop's side of the run audit: <run dir>/audit.json kept current, `sinks.on_audit` told, and
    at the end the ledger and the last checkpoint read back (a read, not a restart)."""

    def __init__(self, cfg, supervisor: Supervisor, sinks: Sinks):
        self.cfg, self.audit, self.sinks = cfg, supervisor.audit, sinks
        self.supervisor = supervisor
        self.checkpoint: Optional[dict] = None
        self.final_poll: Optional[dict] = None

    def publish(self) -> None:
        if self.audit is None:
            return
        report = self.audit.report()
        try:
            self.audit.write(self.cfg.run.run_dir, report)  # the one report of this poll: judged once
        except OSError as exc:  # the audit never ends a run by failing to write itself
            log.warning("could not write the run audit: %s", exc)
        self.sinks.on_audit(report)

    def finish(self, failed: bool = False) -> None:
        """Final: the ledger of the last poll after the loops stopped (none for a run that `failed`: its loops are
        still the teardown's), and the last checkpoint read back."""
        if self.audit is None:
            return
        poll, ledger = self.final_poll, None
        if poll is not None and "buffer" in poll:
            try:
                ledger = reconcile(poll)
            except (KeyError, TypeError):  # a host whose poll keeps no buffer counts
                ledger = None
        if failed:
            self.audit.ledger_note = "the run failed before its loops stopped: its counts were not closed"
        self.audit.finish(ledger=ledger, checkpoint=self.read_checkpoint())
        self.supervisor.audit_findings(self.audit.steps)
        self.publish()

    def read_checkpoint(self) -> Optional[dict]:
        if self.checkpoint is None:
            return {"path": None} if self.cfg.checkpoint.every > 0 else None
        path = self.checkpoint.get("path")
        try:
            state, _ = read_checkpoint(path)
        except CheckpointError as exc:
            return {"path": str(path), "error": str(exc)}
        return {"path": str(path), "step": state.step, "version": state.version}
