"""run_distributed: one training run on Ray without Prefect, supervised by the one supervision loop the flow
runs (`rlhf_core.run.supervise`), with sinks that keep everything in the returned dict: for tests, benchmarks
and debugging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional

from rlhf_core.config import TrainConfig
from rlhf_core.hosts import make_runtime
from rlhf_core.hosts.ray_cluster import DistributedRun
from rlhf_core.run.supervise import Sinks, supervise

log = logging.getLogger("rlhf_core.distributed")


def run_distributed(
    cfg: TrainConfig,
    resume_from: Optional[str] = None,
    on_poll: Optional[Callable[[dict], None]] = None,
    poll_interval_s: Optional[float] = None,
    on_launch: Optional[Callable[[DistributedRun], None]] = None,
    cancelled: Optional[Callable[[], bool]] = None,
) -> dict:
    """Run to cfg.trainer.total_steps on Ray without Prefect, supervised by the one supervision loop the flow
    runs (`rlhf_core.run.supervise`: health checks, their actions, the stall detector); returns final metrics
    and run facts.

    `on_launch(run)` is called once the actors are up (benchmarks and fault tests use it); `cancelled()` returning
    True ends the run before cfg.trainer.total_steps, as a cancelled flow run ends (the loops stop; what they
    pushed meanwhile is in the last poll, so reconcile stays exact; result["cancelled"]). With cluster.host
    'threads' the run is a `rlhf_core.hosts.threads.ThreadedRun` (no Ray) under the same supervision."""
    if poll_interval_s is not None:
        cfg = cfg.model_copy(deep=True)
        cfg.supervision.supervise_interval_s = poll_interval_s
    result: dict = {"metrics": [], "events": []}
    with make_runtime(cfg) as run:
        info = run.launch(resume_from)
        result.update(info)
        if on_launch:
            on_launch(run)
        result.update(run.begin(resumed=bool(resume_from)))
        polls: list[dict] = []

        def record(poll: dict) -> None:
            result["metrics"].extend(poll["metrics"])
            result["events"].extend(poll["events"])
            polls.append(poll)
            if on_poll:
                on_poll(poll)

        sinks = Sinks(
            on_event=lambda ev: log.info("health: %s at step %d -> %s: %s", ev.kind, ev.step, ev.action, ev.detail),
            on_poll=record,
        )
        if cancelled is not None:
            sinks.cancelled, sinks.cancel_check_s = cancelled, 0.0
        start = time.perf_counter()
        result["cancelled"] = not supervise(cfg, run, run.last_step, sinks)
        result["wall_s"] = time.perf_counter() - start
        final = polls[-1]
        result["final_poll"] = final
        result["reconcile"] = run.reconcile(final)
        result["health_events"] = [e.row() for e in sinks.events]
        result.update(run.evaluate())
        result["steps"] = final["step"]
        result["restarts"] = list(run.restarts)
    return result
