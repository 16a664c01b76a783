"""Prefect tasks around the runtime: launch, evaluate, teardown.

The runtime (`rlhf_core.distributed.DistributedRun` on Ray, or `rlhf_core.hosts.threads.ThreadedRun` with
cluster.host threads) owns the mechanisms; these tasks make each discrete
step an observable task run in the flow. Nothing here does math.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig
from rlhf_core.hosts.base import LoopReport
from rlhf_core.run.evaluation import failed_episodes

WARM_START_REPORT_S = 10.0  # a line at least this often while the warm start runs


def make_runtime(cfg: TrainConfig):
    """The runtime for this config (cluster.host: Ray actors or threads; imported here so that importing tasks
    stays light)."""
    from rlhf_core.hosts import make_runtime as for_host

    return for_host(cfg)


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
        info = runtime.launch(resume_from=resume_from, progress=lambda line: logger.info("start-up: %s", line))
    except BaseException:
        runtime.teardown()
        raise
    logger.info(
        "runtime up (cluster.host %s): address=%s (Ray started here: %s), %d rollout worker(s), policy %s, step %d, "
        "version %d",
        cfg.cluster.host,
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
        "held-out evaluation at step %d: accuracy %.3f, reward %.3f%s",
        step,
        result["eval/accuracy"],
        result["eval/reward_mean"],
        failed_episodes(result),
    )
    return result


@task(name="evaluate-pinned", cache_policy=NO_CACHE, persist_result=False)
def evaluate_pinned(runtime, wanted: list, record: Callable[[dict], None], timeout_s: float = 3600.0) -> list[dict]:
    """Held-out evaluations pinned to versions (queued by `runtime.submit_evaluation()` when due; `wanted`: their
    versions, the flow appends those it queues while this runs) on their own worker (rlhf_core.run.pinned_eval): the
    trainer and the rollout fleet go on. This task run spans them, recording each one that finishes (at its
    version's step: `record`) until the newest wanted (or a newer one) is done."""
    logger = get_run_logger()
    logger.info("held-out evaluation of version %d queued on the evaluation worker", wanted[-1])
    done: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(r["eval/version"] >= wanted[-1] for r in done):
        for result in runtime.evaluations():
            record(result)
            done.append(result)
            if "error" in result:
                logger.warning("held-out evaluation of version %d failed: %s", result["eval/version"], result["error"])
                continue
            skipped = f"; versions {result['skipped']} skipped (it was busy)" if result.get("skipped") else ""
            logger.info(
                "held-out evaluation of version %d: accuracy %.3f, reward %.3f (%.1f s)%s%s",
                result["eval/version"],
                result["eval/accuracy"],
                result["eval/reward_mean"],
                result["eval/duration_s"],
                failed_episodes(result),
                skipped,
            )
        time.sleep(0.25)
    return done


@task(name="warm-start", cache_policy=NO_CACHE, persist_result=False)
def warm_start_policy(runtime, steps: int) -> dict:
    """Supervised steps that teach the answer format (not the task) before RL; the weights are then published."""
    logger = get_run_logger()
    logger.info("warm start: %d supervised format steps before RL", steps)
    began = time.monotonic()

    def progress(done: int, loss) -> None:
        at = f", loss {loss:.3f}" if loss is not None else ""
        logger.info("warm start: step %d/%d%s (%.0f s)", done, steps, at, time.monotonic() - began)

    result = dict(runtime.warm_start(steps, progress=progress, every_s=WARM_START_REPORT_S))
    logger.info(
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


# ------------------------------------------------------------------------------ the long-running loops
# Each loop runs in its Ray actor from the flow's `runtime.start()` to its `stop()`; these task runs span it
# (submitted by the flow, which supervises beside them): Running while the loop works, its progress in their
# own log lines, Failed with the loop's error. A rollout worker that Ray restarted runs a new loop: a new
# attempt of the same task run (retries = cluster.max_restarts).
LOOP_REPORT_S = 30.0
LOOP_TASKS = ("rollout-worker-loop", "trainer-loop")


def restarted_by_ray(task, task_run, state) -> bool:
    """Retry condition of a rollout worker's loop: only a worker whose process died (and Ray restarts) runs a new
    loop; a loop that raised failed for good."""
    from rlhf_core.run.control import WorkerDied

    return isinstance(state.result(raise_on_failure=False), WorkerDied)


@task(
    name="rollout-worker-loop",
    task_run_name="rollout-worker-{index}",
    retry_condition_fn=restarted_by_ray,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def rollout_loop(runtime, index: int) -> dict:
    """Rollout worker `index`'s loop: generate, score, push groups, load new weights, until the run stops it."""
    from prefect.runtime import task_run

    logger = get_run_logger()
    attempt = max(1, int(task_run.run_count or 1))
    logger.info("rollout worker %d: generating%s", index, f" (restarted by Ray, loop {attempt})" if attempt > 1 else "")

    def report(s: dict) -> None:
        logger.info(
            "rollout worker %d: %d batches, %d groups pushed, weights version %d, busy %.0f%%",
            index,
            s.get("batches", 0),
            s.get("groups_pushed", 0),
            s.get("version", 0),
            100 * s.get("busy_frac", 0.0),
        )

    final = runtime.wait_loop("rollout", index, attempt=attempt, report=LoopReport(report, LOOP_REPORT_S))
    if final:
        report(final)
    logger.info("rollout worker %d: stopped", index)
    return final


@task(name="trainer-loop", task_run_name="trainer-loop", cache_policy=NO_CACHE, persist_result=False)
def trainer_loop(runtime, total_steps: int) -> dict:
    """The trainer's loop: take batches from the replay buffer, step, publish weights, until total_steps."""
    logger = get_run_logger()
    logger.info("trainer: training to step %d", total_steps)

    def report(s: dict) -> None:
        logger.info(
            "trainer: step %d of %d, version %d, busy %.0f%%",
            s.get("step", 0),
            total_steps,
            s.get("version", 0),
            100 * s.get("busy_frac", 0.0),
        )

    final = runtime.wait_loop("trainer", report=LoopReport(report, LOOP_REPORT_S))
    if final:
        report(final)
    logger.info("trainer: stopped")
    return final
