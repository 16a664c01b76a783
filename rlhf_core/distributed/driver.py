"""run_distributed: one training run on Ray without Prefect, supervised by the Supervisor the flow uses.

The Prefect flow (flows/train.py) drives a DistributedRun through tasks; this is the same supervision in a
plain loop, for tests, benchmarks and debugging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional

import ray

from rlhf_core.config import TrainConfig
from rlhf_core.distributed.runtime import DistributedRun
from rlhf_core.supervision import Supervisor

log = logging.getLogger("rlhf_core.distributed")


def run_distributed(
    cfg: TrainConfig,
    resume_from: Optional[str] = None,
    on_poll: Optional[Callable[[dict], None]] = None,
    poll_interval_s: Optional[float] = None,
    on_launch: Optional[Callable[[DistributedRun], None]] = None,
) -> dict:
    """Run to cfg.trainer.total_steps on Ray without Prefect, supervised by the same Supervisor the flow
    uses (health checks, their actions, the stall detector); returns final metrics and run facts.

    `on_launch(run)` is called once the actors are up (benchmarks and fault tests use it)."""
    interval = poll_interval_s if poll_interval_s is not None else cfg.supervision.supervise_interval_s
    result: dict = {"metrics": [], "events": []}
    with DistributedRun(cfg) as run:
        info = run.launch(resume_from)
        result.update(info)
        if on_launch:
            on_launch(run)
        result["eval/accuracy_start"] = run.eval_start if resume_from else run.evaluate()["eval/accuracy"]
        run.eval_start = result["eval/accuracy_start"]
        if cfg.trainer.warm_start_steps and not resume_from:
            result.update(run.warm_start(cfg.trainer.warm_start_steps))
        supervisor = Supervisor(
            cfg,
            run,
            start_step=run.last_step,
            report=lambda ev: log.info("health: %s at step %d -> %s: %s", ev.kind, ev.step, ev.action, ev.detail),
        )
        start = time.perf_counter()
        run.start()
        while True:
            poll = supervisor.tick()
            result["metrics"].extend(poll["metrics"])
            result["events"].extend(poll["events"])
            if on_poll:
                on_poll(poll)
            if poll["done"]:
                break
            ray.wait([run.trainer_loop], timeout=interval)  # wake as soon as the trainer loop ends
        result["wall_s"] = time.perf_counter() - start
        run.stop()
        final = run.poll()
        result["metrics"].extend(final["metrics"])
        result["final_poll"] = final
        result["reconcile"] = run.reconcile(final)
        result["health_events"] = [e.row() for e in supervisor.events]
        result.update(run.evaluate())
        result["steps"] = final["step"]
        result["restarts"] = list(run.restarts)
    return result
