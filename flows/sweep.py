"""The sweep flow: a grid of training runs as child flow runs of `atrlhf-train`, compared in Prefect and MLflow.

    validate the base config, the grid and every point (values, paths) -> name the sweep (hash of base, grid,
    seeds, or given)
    -> open (or, on a rerun, reopen) the MLflow parent run -> skip the points a child already FINISHED
    -> run the rest, at most `max_parallel` at once, each as a child flow run of atrlhf-train whose MLflow
       run is a child of the parent (a failing point fails only its child) -> comparison table and plot
       as Prefect artifacts and as the parent's MLflow artifacts.

With `shared_fleet`, every point runs at once in this process on one shared fleet (rlhf_core.hosts.shared_fleet:
one base model, one rollout engine batching every point's generation, one trainer process holding every point's
adapter and optimizer); each point is still its own child flow run and MLflow child run. Otherwise points run
in this process, on one Ray instance the sweep starts (unless cluster.address names one) with
room for `max_parallel` runs, so that parallel children neither fight over Ray's CPUs nor shut Ray down
under each other. Each child writes under `<run.output_dir>/<sweep id>/<point>`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from flows.lifecycle import shared_ray
from flows.terminal import quiet_terminal
from flows.train import train
from rlhf_core.config import ConfigError, TrainConfig, validate_config
from rlhf_core.run.preflight import check_paths
from rlhf_core.sweep_grid import (
    SweepPoint,
    check_grid,
    check_points,
    expand_grid,
    point_config,
    seed_list,
    shared_points,
)
from rlhf_core.sweep_grid import sweep_id as make_sweep_id
from tasks.sweep import compare_points, open_sweep_record, publish_comparison
from tasks.tracking import link_mlflow_run
from tracking.sweep_record import point_tags


@flow(name="atrlhf-sweep", validate_parameters=False, log_prints=True)
def sweep(
    base_config: TrainConfig = TrainConfig(),
    grid: Optional[dict[str, list]] = None,
    seeds: Union[int, list[int]] = 1,
    max_parallel: int = 1,
    metric: str = "eval/accuracy",
    target: float = 0.9,
    sweep_id: Optional[str] = None,
    shared_fleet: bool = False,
) -> dict | State:
    """Run every point of `grid` (dotted config keys to lists of values) times `seeds` (a count from the base
    trainer.seed, or a list) as a child flow run of atrlhf-train, at most `max_parallel` at once.

    MLflow: one parent run per sweep (tag atrlhf.sweep_id; the grid as params) with one child run per point
    (the varied keys as params and tags). A rerun with the same base config, grid and seeds (or the same
    `sweep_id`) reuses the parent and skips the points already finished. The comparison (final and best
    eval/accuracy, seconds to `target` accuracy, mean staleness, samples/s, status; a plot of `metric`
    against steps, mean and spread over seeds) is a Prefect table and markdown artifact and the parent's
    MLflow artifacts under comparison/.

    `shared_fleet`: the points run at once on one base model, one rollout engine and one trainer process
    (rlhf_core.hosts.shared_fleet): each its own LoRA adapter, optimizer, buffer and child flow run; refused before
    anything starts (the key named) where the points differ in more than an adapter run may.

    Returns the sweep id, the MLflow parent run id, the table rows and the counts (ran, skipped, failed).
    When a point failed (the others still run), the flow run ends Failed with that dict as its result and a
    message naming the failed points.
    """
    quiet_terminal()  # as `atrlhf sweep` does; here for a worker's (deployment's) process
    logger = get_run_logger()
    cfg = validate_config(base_config, " (sweep parameter 'base_config')")
    grid = check_grid(dict(grid or {}))
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise ConfigError(f"sweep max_parallel: expected an integer >= 1, got {max_parallel!r}")
    seeds_used = seed_list(cfg, seeds)
    points = expand_grid(grid, seeds_used)
    for point_cfg in check_points(cfg, grid, seeds_used):  # every value and point, before anything starts
        check_paths(point_cfg)
    sid = sweep_id or make_sweep_id(cfg, grid, seeds_used)
    run_cfg = cfg
    if shared_fleet:
        from rlhf_core.hosts.shared_fleet import (  # torch and the model: for a shared fleet only
            SharedFleet,
            fleet_config,
        )

        run_cfg = fleet_config(cfg)
        fleet_points = shared_points(run_cfg, points, sid)  # refused here (the key named), before any run is opened
    flow_run_id = str(current_flow_run.id) if current_flow_run.id else ""

    params: dict[str, Any] = {f"grid.{k}": v for k, v in grid.items()}
    params.update(
        {"sweep_id": sid, "seeds": seeds_used, "max_parallel": max_parallel, "metric": metric, "target": target}
    )
    params["points"] = len(points)
    record = open_sweep_record(cfg, sid, params, flow_run_id)
    parent = record.run_id
    link_mlflow_run(flow_run_id, record.uri, record.experiment_id, parent, what="MLflow parent run")
    done = record.finished_points()
    todo = [p for p in points if p.name not in done]
    logger.info(
        "sweep %s: %d point(s) (%s x %d seed(s)), %d already finished, %d to run, %s; MLflow parent %s",
        sid,
        len(points),
        " x ".join(f"{k}[{len(v)}]" for k, v in grid.items()) or "base",
        len(seeds_used),
        len(points) - len(todo),
        len(todo),
        "all at once on one shared fleet" if shared_fleet else f"at most {max_parallel} at once",
        parent,
    )

    outcomes: dict[str, dict] = {}
    status = "FAILED"
    try:
        if todo:
            if shared_fleet:
                hosts = SharedFleet({p.name: fleet_points[p.name] for p in todo})
            else:
                hosts = shared_ray(cfg, max_parallel)
            parallel = len(todo) if shared_fleet else max_parallel
            with hosts, ThreadPoolTaskRunner(max_workers=parallel) as runner:
                futures = [
                    (
                        p,
                        runner.submit(
                            run_point,
                            parameters={"point": p, "config": run_cfg, "sweep": sid, "parent_run_id": parent},
                        ),
                    )
                    for p in todo
                ]
                for point, future in futures:
                    outcomes[point.name] = outcome = future.result()
                    logger.info("point %s: %s %s", point.name, outcome["state"], outcome["message"] or "")
            if shared_fleet:
                fleet = hosts.stats()
                logger.info(
                    "shared fleet: %d generation batches for %d point(s), %.1f rows a batch (%s)",
                    fleet["batches"],
                    len(todo),
                    fleet["rows_per_batch"],
                    "mixed-adapter" if hosts.mixed else "the calls of a batch in turn",
                )
        rows, children = compare_points(record, points, outcomes, metric, target)
        failed = sum(1 for c in children if c.status != "FINISHED")
        publish_comparison(record, rows, children, metric, target)
        status = "FINISHED"
    finally:
        if status != "FINISHED":
            record.fail()
    record.end(failed=failed, skipped=len(points) - len(todo), total=len(points))
    logger.info(
        "sweep %s done: %d ran, %d skipped (finished before), %d failed; MLflow parent %s",
        sid,
        len(todo),
        len(points) - len(todo),
        failed,
        parent,
    )
    result = {
        "sweep_id": sid,
        "mlflow_parent_run_id": parent,
        "mlflow_experiment_id": record.experiment_id,
        "mlflow_tracking_uri": record.uri,
        "rows": rows,
        "points": len(points),
        "ran": len(todo),
        "skipped": len(points) - len(todo),
        "failed": failed,
    }
    if failed:
        # every other point finished; the sweep's flow run ends Failed (red in the UI, a non-zero exit for the
        # CLI) and still carries the table
        names = [c.point.name for c in children if c.status != "FINISHED"]
        return Failed(
            message=f"{failed} of {len(points)} sweep point(s) failed ({', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}); the others finished: see the comparison table",
            data=result,
        )
    return result


@task(name="sweep-point", cache_policy=NO_CACHE, persist_result=False, task_run_name="{point.name}")
def run_point(point: SweepPoint, config: TrainConfig, sweep: str, parent_run_id: str) -> dict:
    """One point as a child flow run of atrlhf-train. Never raises: a point that fails (a bad value, a failed
    run) is an outcome {state, message, flow_run_id} that the sweep reports."""
    try:
        child_config = point_config(config, point, sweep)
    except ConfigError as exc:  # a grid key that is not a path into the config
        return {"state": "FAILED", "message": f"ConfigError: {exc}", "flow_run_id": ""}
    state = train.with_options(flow_run_name=point.run_name(sweep))(
        config=child_config,
        mlflow_parent_run_id=parent_run_id,
        mlflow_tags=point_tags(point, sweep),
        return_state=True,
    )
    flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else ""
    message = (state.message or "").removeprefix("Flow run encountered an exception: ")
    return {"state": state.type.value, "message": message, "flow_run_id": flow_run_id}
