"""The MLflow client of a training run and of a sweep (no Prefect tasks here: tasks/tracking.py and
tasks/sweep.py wrap these in tasks).

    runs.py              the store (tracking URI, UI command and URL), the experiment, MlflowTracker: one run's
                         lifecycle, params, tags and metrics, and the lineage of runs it resumed
    artifacts.py         checkpoints in MLflow (log, prune, find the newest complete, download) and the final policy
                         (the LoggedModel; load_logged_policy)
    plots.py             the reward curve and staleness histogram of a run
    resume.py            what `resume_from` names (a local checkpoint or run directory, or an MLflow run), told
                         without Prefect and without downloading (the CLI's check; tasks/checkpoints.py resolves it)
    sweep_record.py      a sweep's parent run and its children (SweepRecord)
    sweep_comparison.py  the children's histories read back, the comparison table and plot

Load the policy a run logged:

    from tracking import load_logged_policy
    model, tokenizer = load_logged_policy("<run id>", "sqlite:///mlflow.db")
"""

from tracking.artifacts import (
    CHECKPOINT_ARTIFACT_PATH,
    CHECKPOINT_COMPLETE,
    LOGGED_MODEL_NAME,
    MODEL_ARTIFACT_PATH,
    download_artifact,
    download_logged_policy,
    latest_checkpoint_artifact,
    load_logged_policy,
    log_checkpoint,
    logged_model_id,
    prune_checkpoint_artifacts,
)
from tracking.runs import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MLFLOW_PARENT_RUN,
    RESUMED_FROM_RUN,
    RESUMED_FROM_STEP,
    MlflowTracker,
    client,
    looks_like_run_id,
    mlflow_metric_name,
    resolve_tracking_uri,
    run_exists,
    run_url,
    ui_command,
)

__all__ = [
    "CHECKPOINT_ARTIFACT_PATH",
    "CHECKPOINT_COMPLETE",
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "LOGGED_MODEL_NAME",
    "MLFLOW_PARENT_RUN",
    "MODEL_ARTIFACT_PATH",
    "RESUMED_FROM_RUN",
    "RESUMED_FROM_STEP",
    "MlflowTracker",
    "client",
    "download_artifact",
    "download_logged_policy",
    "latest_checkpoint_artifact",
    "load_logged_policy",
    "log_checkpoint",
    "logged_model_id",
    "prune_checkpoint_artifacts",
    "looks_like_run_id",
    "mlflow_metric_name",
    "resolve_tracking_uri",
    "run_exists",
    "run_url",
    "ui_command",
]
