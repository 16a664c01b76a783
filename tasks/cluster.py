"""Prefect tasks around the Ray runtime: launch, evaluate, teardown.

The runtime (`rlhf_core.distributed.DistributedRun`) owns the mechanisms; these tasks make each discrete
step an observable task run in the flow. Nothing here does math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig


def make_runtime(cfg: TrainConfig):
    """The runtime for this config (the Ray runtime; imported here so that importing tasks stays light)."""
    from rlhf_core.distributed import DistributedRun

    return DistributedRun(cfg)


@task(name="launch-ray-runtime", cache_policy=NO_CACHE, persist_result=False)
def launch_runtime(cfg: TrainConfig, resume_from: Optional[str] = None, hold: Optional[Callable] = None):
    """Join or start Ray, check resources, create the rollout workers and the trainer, restore a checkpoint.

    Returns (runtime, launch info). `hold(runtime)` is called before anything starts (the flow's cleanup then
    tears it down whatever happens next); on any failure the runtime tears down what it created before raising.
    """
    logger = get_run_logger()
    runtime = make_runtime(cfg)
    if hold is not None:
        hold(runtime)
    try:
        info = runtime.launch(resume_from=resume_from)
    except BaseException:
        runtime.teardown()
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
