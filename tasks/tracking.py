"""Prefect tasks of a run's MLflow tracking: open the run, log the final policy, log the plots.

The MLflow client code they call is `tasks.mlflow_client` (runs, artifacts, plots); the flow puts the MLflow
run id on the Prefect flow run (tag and artifact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig
from tasks.mlflow_client import artifacts, plots
from tasks.mlflow_client.runs import MlflowTracker


@task(name="start-mlflow-run", cache_policy=NO_CACHE, persist_result=False)
def start_tracking(
    cfg: TrainConfig,
    flow_run_id: Optional[str],
    resume_run_id: Optional[str] = None,
    tags: Optional[dict[str, str]] = None,
    run_name: Optional[str] = None,
    resume_step: Optional[int] = None,
    parent_run_id: Optional[str] = None,
    hold: Optional[Callable[[MlflowTracker], object]] = None,
) -> MlflowTracker:
    """Open the MLflow run of this flow run and log the config as params. A resumed run is a new MLflow run
    that names the run it resumed (`resume_run_id`) and the step (`resume_step`). With `parent_run_id` it is
    a child of that run (a sweep's parent). `hold`: see MlflowTracker.start.

    It is named cfg.tracking.run_name, else `run_name`, else this flow run's name."""
    if not run_name:
        from prefect.runtime import flow_run

        run_name = flow_run.name or None
    return MlflowTracker.start(
        cfg,
        flow_run_id=flow_run_id,
        resume_run_id=resume_run_id,
        tags=tags,
        run_name=run_name,
        resume_step=resume_step,
        parent_run_id=parent_run_id,
        hold=hold,
    )


@task(name="log-model", cache_policy=NO_CACHE, persist_result=False)
def log_model(tracker: MlflowTracker, export_dir: str, step: Optional[int] = None) -> str:
    """Log the exported policy as the run's LoggedModel; load_logged_policy(run_id) loads it back."""
    return artifacts.log_model(tracker, export_dir, step=step)


@task(name="log-plots", cache_policy=NO_CACHE, persist_result=False)
def log_plots(tracker: MlflowTracker, history: list[dict], staleness_hist: dict, evals: list[dict]) -> list[str]:
    """Reward curve and staleness histogram as PNG artifacts of the MLflow run."""
    return plots.log_plots(tracker, history, staleness_hist, evals)
