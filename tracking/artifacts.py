"""What a run stores in MLflow besides metrics: its checkpoints (to resume from) and its final policy.

Checkpoints go under the run's artifact path `checkpoints/<dir name>`, each marked complete last (a file
COMPLETE). The final policy is logged as a plain Hugging Face directory as an MLflow 3 LoggedModel (named
`policy`, output of the run: it shows under the run's "Logged models", `models:/<model_id>`); runs of earlier
versions also hold it under the artifact path `model/`. `load_logged_policy(run_id)` downloads it (from
`model/`, else from the run's logged model) and loads it with `rlhf_core.model.policy.load_policy`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from tracking.runs import MlflowTracker, client, quiet_mlflow_env

MODEL_ARTIFACT_PATH = "model"  # where runs of earlier versions also copied the policy; still read
LOGGED_MODEL_NAME = "policy"
LOGGED_MODEL_TYPE = "hf-causal-lm"
CHECKPOINT_ARTIFACT_PATH = "checkpoints"
CHECKPOINT_COMPLETE = "COMPLETE"  # written last into an uploaded checkpoint


# ------------------------------------------------------------------------------------------ checkpoints
def log_checkpoint(tracker: MlflowTracker, local_dir: str | Path) -> str:
    """A checkpoint directory as artifacts under checkpoints/<dir name>, marked complete LAST (a file
    COMPLETE), so that a driver killed mid-upload leaves a checkpoint that resume skips, never a half
    one that it downloads; returns the artifact path."""
    name = Path(local_dir).name
    path = f"{CHECKPOINT_ARTIFACT_PATH}/{name}"
    tracker.client.log_artifacts(tracker.run_id, str(local_dir), path)
    tracker.client.log_text(tracker.run_id, name, f"{path}/{CHECKPOINT_COMPLETE}")
    return path


def prune_checkpoint_artifacts(tracker: MlflowTracker, keep: int) -> list[str]:
    """Of the run's checkpoints in MLflow, keep the `keep` newest COMPLETE ones and delete every checkpoint older
    than the oldest of them (complete or not); a newer one without its marker (an upload under way) is left.
    keep=0 keeps everything. Returns the deleted artifact paths; a store that cannot delete artifacts keeps
    them (one warning)."""
    if keep <= 0:
        return []
    mlflow_client = tracker.client
    entries = sorted(
        (e.path for e in mlflow_client.list_artifacts(tracker.run_id, CHECKPOINT_ARTIFACT_PATH) if e.is_dir),
        key=lambda p: Path(p).name,
    )
    complete = [
        p
        for p in entries
        if any(Path(f.path).name == CHECKPOINT_COMPLETE for f in mlflow_client.list_artifacts(tracker.run_id, p))
    ]
    if len(complete) <= keep:
        return []
    oldest_kept = Path(complete[-keep]).name
    doomed = [p for p in entries if Path(p).name < oldest_kept]
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        repo = get_artifact_repository(
            mlflow_client.get_run(tracker.run_id).info.artifact_uri, tracking_uri=tracker.uri
        )
        for path in doomed:
            repo.delete_artifacts(path)
    except Exception as exc:  # NotImplementedError, a read-only store: the run keeps them, it goes on
        logging.getLogger("tracking").warning(
            "older checkpoints stay in MLflow (checkpoint.keep=%d): deleting artifacts failed: %s", keep, exc
        )
        return []
    return doomed


def latest_checkpoint_artifact(run_id: str, uri: str) -> Optional[str]:
    """The artifact path of the newest COMPLETE checkpoint of an MLflow run (checkpoints/step_NNNNNN), or
    None. A checkpoint whose upload never finished (no COMPLETE marker) is skipped."""
    mlflow_client = client(uri)
    entries = sorted(
        (e.path for e in mlflow_client.list_artifacts(run_id, CHECKPOINT_ARTIFACT_PATH) if e.is_dir),
        key=lambda p: Path(p).name,
        reverse=True,
    )
    for path in entries:
        if any(Path(f.path).name == CHECKPOINT_COMPLETE for f in mlflow_client.list_artifacts(run_id, path)):
            return path
    return None


def download_artifact(run_id: str, artifact_path: str, uri: str, dst: str | Path) -> Path:
    quiet_mlflow_env()
    import mlflow.artifacts

    Path(dst).mkdir(parents=True, exist_ok=True)
    return Path(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=artifact_path, dst_path=str(dst), tracking_uri=uri
        )
    )


# ------------------------------------------------------------------------------------------ the policy
def log_model(tracker: MlflowTracker, export_dir: str | Path, step: Optional[int] = None) -> str:
    """The exported Hugging Face directory as an MLflow 3 LoggedModel output by this run: it shows under the
    run's "Logged models", stored once (runs logged by earlier versions also hold a model/ copy among the
    run's artifacts). Load it with load_logged_policy(run_id).

    Returns the model's URI, models:/<id>; the id is also the run tag `model.id`."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    load = f"tracking.load_logged_policy('{tracker.run_id}')"
    model = tracker.client.create_logged_model(
        experiment_id=tracker.experiment_id,
        name=LOGGED_MODEL_NAME,
        source_run_id=tracker.run_id,
        tags={"format": "huggingface", "load": load},
        model_type=LOGGED_MODEL_TYPE,
    )
    try:
        tracker.client.log_model_artifacts(model.model_id, str(export_dir))
    except BaseException:
        tracker.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    tracker.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    tracker.client.log_outputs(tracker.run_id, [LoggedModelOutput(model.model_id, step=int(step or 0))])
    uri = f"models:/{model.model_id}"
    tracker.set_tags({"model.id": model.model_id, "model.uri": uri, "model.load": load})
    return uri


def logged_model_id(run_id: str, uri: str) -> Optional[str]:
    """The id of the policy LoggedModel a run output (run tag `model.id`, else a search by source run), or None."""
    mlflow_client = client(uri)
    run = mlflow_client.get_run(run_id)
    if run.data.tags.get("model.id"):
        return run.data.tags["model.id"]
    found = mlflow_client.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND name = '{LOGGED_MODEL_NAME}'",
        max_results=1,
    )
    return found[0].model_id if found else None


def download_logged_policy(run_id: str, tracking_uri: Optional[str] = None, dst: Optional[str | Path] = None) -> Path:
    """Download the policy a run logged (its `model/` artifact, else its LoggedModel) into `dst` (default: a new
    temporary directory that the caller removes); returns the local Hugging Face directory."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
    dst = Path(dst) if dst else Path(tempfile.mkdtemp(prefix=f"atrlhf-model-{run_id[:8]}-"))
    if client(uri).list_artifacts(run_id, MODEL_ARTIFACT_PATH):
        return download_artifact(run_id, MODEL_ARTIFACT_PATH, uri, dst)
    model_id = logged_model_id(run_id, uri)
    if model_id is None:
        raise FileNotFoundError(f"MLflow run {run_id} in {uri} logged no model (no model/ artifact, no LoggedModel)")
    import mlflow.artifacts

    location = client(uri).get_logged_model(model_id).artifact_location
    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(dst), tracking_uri=uri))


def load_logged_policy(run_id: str, tracking_uri: Optional[str] = None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) of the policy a run logged (its LoggedModel).

    >>> model, tokenizer = load_logged_policy("0123456789abcdef0123456789abcdef",
    ...                                       tracking_uri="sqlite:///mlflow.db")   # doctest: +SKIP
    """
    from rlhf_core.model.policy import load_policy

    with tempfile.TemporaryDirectory(prefix=f"atrlhf-model-{run_id[:8]}-") as scratch:  # removed once loaded
        return load_policy(download_logged_policy(run_id, tracking_uri, scratch), dtype=dtype, device=device)
