"""Prefect tasks for checkpoints, the exported policy, and resolving `resume_from`.

`resume_from` is either a checkpoint directory or an MLflow run id. For a run id, the newest checkpoint
artifact (checkpoints/step_NNNNNN, complete uploads only) is downloaded; a checkpoint directory written by a
tracked run names its MLflow run too. That run becomes the parent of the resumed run's new MLflow run.
Either way the checkpoint is validated before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlhf_core.checkpoint import CheckpointError, checkpoint_dir, prune_checkpoints, read_checkpoint
from rlhf_core.config import TrainConfig
from tasks import mlflow_client as tracking


@dataclass
class ResumeTarget:
    checkpoint: Optional[str] = None  # local checkpoint directory to restore, or None for a fresh run
    mlflow_run_id: Optional[str] = None  # the MLflow run this one resumes (its parent), if known
    eval_start: Optional[float] = None  # held-out accuracy recorded at the start of the original run
    step: int = 0  # the trainer step the checkpoint holds
    finished: Optional[str] = None  # the checkpoint already reaches trainer.total_steps: what to tell the user


def export_dir(cfg: TrainConfig) -> Path:
    return cfg.run.run_dir / "policy"


def resume_point(cfg: TrainConfig, resume_from: str) -> Optional[tuple[int, str]]:
    """(step, what it is) of the checkpoint `resume_from` names, told without downloading or loading it: the
    meta.json of a checkpoint directory, the artifact name of an MLflow run's newest complete checkpoint. None
    when that cannot be told (`resolve_resume` then says what is wrong)."""
    path = Path(resume_from).expanduser()
    try:
        if path.is_dir():
            return int(json.loads((path / "meta.json").read_text())["step"]), f"checkpoint {path}"
        if tracking.looks_like_run_id(resume_from):
            artifact = tracking.latest_checkpoint_artifact(resume_from, tracking.resolve_tracking_uri(cfg))
            if artifact is not None:
                return int(Path(artifact).name.rsplit("_", 1)[1]), f"MLflow run {resume_from} ({artifact})"
    except Exception:  # unreadable, no such run, a name of another form: resolve_resume reports it
        return None
    return None


def nothing_to_train(cfg: TrainConfig, resume_from: Optional[str]) -> Optional[str]:
    """What to tell the user when `resume_from` already reached trainer.total_steps (None otherwise, or when
    that cannot be told without downloading)."""
    point = resume_point(cfg, resume_from) if resume_from else None
    if point is None or point[0] < cfg.trainer.total_steps:
        return None
    step, what = point
    return (
        f"nothing to train: {what} is at step {step}, which already reaches trainer.total_steps="
        f"{cfg.trainer.total_steps}; to train on, raise it (e.g. --set trainer.total_steps={step + max(step // 5, 1)})"
    )


@task(name="resolve-resume", cache_policy=NO_CACHE, persist_result=False)
def resolve_resume(cfg: TrainConfig, resume_from: Optional[str]) -> ResumeTarget:
    """Turn `resume_from` (checkpoint directory or MLflow run id) into a validated local checkpoint; a checkpoint
    that already reaches trainer.total_steps is neither downloaded nor loaded (`finished` says so)."""
    if not resume_from:
        return ResumeTarget()
    logger = get_run_logger()
    finished = nothing_to_train(cfg, resume_from)
    if finished:
        logger.info(finished)
        return ResumeTarget(finished=finished)
    uri = tracking.resolve_tracking_uri(cfg)
    path = Path(resume_from).expanduser()
    run_id: Optional[str] = None
    if path.exists():
        ckpt = path
    elif tracking.looks_like_run_id(resume_from):
        if not tracking.run_exists(resume_from, uri):
            raise CheckpointError(f"resume_from={resume_from!r}: no MLflow run with that id in {uri}")
        run_id = resume_from
        artifact = tracking.latest_checkpoint_artifact(run_id, uri)
        if artifact is None:
            raise CheckpointError(
                f"resume_from={resume_from!r}: MLflow run {run_id} has no checkpoint artifacts "
                f"under {tracking.CHECKPOINT_ARTIFACT_PATH}/"
            )
        dst = cfg.run.run_dir / "resume" / run_id
        ckpt = tracking.download_artifact(run_id, artifact, uri, dst)
        logger.info("downloaded checkpoint %s of MLflow run %s to %s", artifact, run_id, ckpt)
    else:
        raise CheckpointError(
            f"resume_from={resume_from!r} is neither an existing checkpoint directory nor an "
            "MLflow run id (32 hex characters)"
        )
    state, _ = read_checkpoint(ckpt)  # structure and files; the runtime checks shapes against the model
    logged_run = state.run.get("mlflow_run_id")
    if run_id is None and logged_run and tracking.run_exists(logged_run, uri):
        run_id = logged_run
    logger.info(
        "resuming from %s (step %d, version %d): a new MLflow run, %s",
        ckpt,
        state.step,
        state.version,
        f"resumed from {run_id} at step {state.step}" if run_id else "(the checkpoint names no MLflow run)",
    )
    if state.step >= cfg.trainer.total_steps:
        raise CheckpointError(
            f"resume_from={resume_from!r} holds step {state.step}, which already reaches trainer.total_steps="
            f"{cfg.trainer.total_steps}: nothing to train; raise trainer.total_steps to continue"
        )
    return ResumeTarget(
        checkpoint=str(ckpt), mlflow_run_id=run_id, eval_start=state.run.get("eval_start"), step=state.step
    )


@task(name="checkpoint", cache_policy=NO_CACHE, persist_result=False)
def save_checkpoint(runtime, cfg: TrainConfig, step: int, tracker=None, run: Optional[dict] = None) -> str:
    """A full resumable checkpoint under the run directory's checkpoints/, logged to MLflow as artifacts.
    `run`: facts of the run kept in the checkpoint (its MLflow run id, held-out accuracy at the start)."""
    path = runtime.checkpoint(str(checkpoint_dir(cfg.run.run_dir, step)), run=run)
    artifact = tracking.log_checkpoint(tracker, path) if tracker is not None else None
    get_run_logger().info(
        "checkpoint at step %d: %s%s", step, path, f" (MLflow artifact {artifact})" if artifact else ""
    )
    _keep_bounded(path, step, cfg.checkpoint.keep, tracker)
    return str(path)


@task(name="record-checkpoint", cache_policy=NO_CACHE, persist_result=False)
def record_checkpoint(tracker, path: str, step: int) -> str:
    """A checkpoint the trainer wrote at an exact step, logged to MLflow as artifacts."""
    artifact = tracking.log_checkpoint(tracker, path) if tracker is not None else None
    get_run_logger().info(
        "checkpoint at step %d: %s%s", step, path, f" (MLflow artifact {artifact})" if artifact else ""
    )
    _keep_bounded(path, step, tracker.keep_checkpoints if tracker is not None else 0, tracker)
    return str(path)


def _keep_bounded(path: str, step: int, keep: int, tracker) -> None:
    """checkpoint.keep: the run's checkpoints up to this one beyond the newest `keep` are deleted on
    disk and in MLflow (newer ones the trainer wrote are recorded first)."""
    removed = [p.name for p in prune_checkpoints(Path(path).parent, keep, newest_step=step)]
    deleted = tracking.prune_checkpoint_artifacts(tracker, keep) if tracker is not None else []
    if removed or deleted:
        get_run_logger().info(
            "checkpoint.keep=%d: deleted %s on disk, %s in MLflow",
            keep,
            ", ".join(removed) or "none",
            ", ".join(Path(d).name for d in deleted) or "none",
        )


@task(name="export-policy", cache_policy=NO_CACHE, persist_result=False)
def export_policy(runtime, cfg: TrainConfig) -> str:
    """The trained policy as a Hugging Face model directory (loadable by rlhf_core.models.load_policy)."""
    path = runtime.export(str(export_dir(cfg)))
    get_run_logger().info("exported the policy to %s", path)
    return str(path)
