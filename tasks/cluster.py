"""Prefect tasks around the Ray runtime: launch, evaluate, teardown.

The runtime (`rlhf_core.distributed.DistributedRun`) owns the mechanisms; these tasks make each discrete
step an observable task run in the flow. Nothing here does math.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from typing import Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig
from tasks import held


@contextlib.contextmanager
def _keep_sigterm_handler():
    """`ray.init` replaces the SIGTERM handler with `sys.exit`; put back the one the flow had (Prefect's,
    which turns a worker's cancellation SIGTERM into TerminationSignal so the flow can clean up)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def make_runtime(cfg: TrainConfig):
    """The runtime for this config (the Ray runtime; imported here so that importing tasks stays light)."""
    from rlhf_core.distributed import DistributedRun

    return DistributedRun(cfg)


@task(name="launch-ray-runtime", cache_policy=NO_CACHE, persist_result=False)
def launch_runtime(cfg: TrainConfig, resume_from: Optional[str] = None):
    """Join or start Ray, check resources, create the rollout workers and the trainer, restore a checkpoint.

    Returns (runtime, launch info). On any failure the runtime tears down what it created before raising.
    """
    from prefect.runtime import flow_run

    logger = get_run_logger()
    runtime = make_runtime(cfg)
    flow_run_id = str(flow_run.id or "")
    if flow_run_id:  # the flow's cleanup tears it down even if a signal lands before the flow holds it
        held.hold(flow_run_id, "runtime", runtime)
    with _keep_sigterm_handler():
        try:
            info = runtime.launch(resume_from=resume_from)
        except BaseException:
            runtime.teardown()
            if flow_run_id:
                held.release(flow_run_id, "runtime", runtime)
            raise
    logger.info(
        "Ray runtime up: address=%s (started here: %s), %d rollout worker(s), policy %s, step %d, version %d",
        info["ray_address"],
        info["started_ray"],
        cfg.rollout.num_workers,
        info["policy_dir"],
        info["step"],
        info["version"],
    )
    return runtime, info


@task(name="evaluate-heldout", cache_policy=NO_CACHE, persist_result=False)
def evaluate_heldout(runtime, step: int) -> dict:
    """Greedy accuracy and mean reward on the held-out prompts, with the trainer's current weights."""
    result = dict(runtime.evaluate())
    get_run_logger().info(
        "held-out evaluation at step %d: accuracy %.3f, reward %.3f",
        step,
        result["eval/accuracy"],
        result["eval/reward_mean"],
    )
    return result


@task(name="warm-start", cache_policy=NO_CACHE, persist_result=False)
def warm_start_policy(runtime, steps: int) -> dict:
    """Supervised steps that teach the answer format (not the task) before RL; the weights are then published."""
    result = dict(runtime.warm_start(steps))
    get_run_logger().info(
        "warm start: %d supervised format steps, held-out accuracy %.3f after it (loss %.3f)",
        steps,
        result["eval/accuracy_warm_start"],
        result["warm_start/loss"],
    )
    return result


@task(name="teardown-ray-runtime", cache_policy=NO_CACHE, persist_result=False)
def teardown_runtime(runtime) -> None:
    """Stop the loops, kill exactly the actors this run created, shut Ray down if this run started it."""
    runtime.teardown()


@contextlib.contextmanager
def shared_ray(cfg: TrainConfig, slots: int):
    """For a sweep: join Ray once for all the runs of the block (a run that finds Ray joined reuses it and
    leaves it up; parallel runs never race to start or shut it down). Without cluster.address, a local
    instance with room for `slots` runs of `cfg` at once, shut down when the block leaves."""
    from rlhf_core.distributed.cluster import connect, required_resources, teardown

    cluster = cfg.cluster
    if not cluster.address:
        per_run = max(cluster.num_cpus or 0, required_resources(cfg)["CPU"], 1)
        cluster = cluster.model_copy(update={"num_cpus": math.ceil(per_run * slots)})
    with _keep_sigterm_handler():
        handle = connect(cluster)
    try:
        yield handle
    finally:
        teardown(handle)
