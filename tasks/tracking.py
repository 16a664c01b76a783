"""Prefect tasks of a run's MLflow tracking: open the run, link it to the flow run, log the final policy and plots.

The MLflow client code they call is `tracking` (runs, artifacts, plots); the flow puts the MLflow
run id on the Prefect flow run (tag and artifact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig
from tracking import artifacts, plots
from tracking.runs import MlflowTracker, run_url, ui_command


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
def log_plots(
    tracker: MlflowTracker, history: list[dict], staleness_hist: dict, evals: list[dict]
) -> plots.LoggedPlots:
    """Reward curve and staleness histogram as PNG artifacts of the MLflow run; `.markdown` of the result is the
    reward curve as an inline image for the run's summary."""
    return plots.log_plots(tracker, history, staleness_hist, evals)


@task(name="link-mlflow-run", cache_policy=NO_CACHE, persist_result=False)
def link_mlflow_run(flow_run_id: str, uri: str, experiment_id: str, run_id: str, what: str = "MLflow run") -> str:
    """Put an MLflow run on the Prefect flow run: a tag `mlflow-run:<id>` (what the flow runs list filters by)
    and a link artifact `atrlhf-mlflow-run`. Returns the run's URL in the MLflow UI."""
    url = run_url(uri, experiment_id, run_id)
    if flow_run_id:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                fr = client.read_flow_run(flow_run_id)
                client.update_flow_run(flow_run_id, tags=sorted(set(fr.tags) | {f"mlflow-run:{run_id}"}))
        except Exception as exc:  # cosmetic; never fail a run over a tag
            get_run_logger().warning("could not tag the flow run with the MLflow run id: %s", exc)
    create_link_artifact(
        link=url,
        link_text=f"{what} {run_id}",
        key="atrlhf-mlflow-run",
        description=f"{what} of this flow run (store {uri}; open with `{ui_command(uri)}`)",
    )
    return url
