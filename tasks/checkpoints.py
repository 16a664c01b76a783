"""Prefect tasks for checkpoints, the exported policy, and resolving `resume_from`.

`resume_from` is a checkpoint directory, a run directory (its newest checkpoint) or an MLflow run id
(tracking/resume.py tells which, without Prefect). For a run id, the newest checkpoint
artifact (checkpoints/step_NNNNNN, complete uploads only) is downloaded; a checkpoint directory written by a
tracked run names its MLflow run too. That run becomes the parent of the resumed run's new MLflow run.
Either way the checkpoint is validated before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import ConfigError, TrainConfig
from rlhf_core.run.checkpoint import CheckpointError, checkpoint_dir, prune_checkpoints, read_checkpoint
from tasks import mlflow_client as tracking
from tracking.resume import local_checkpoint, nothing_to_train


@dataclass
class ResumeTarget:
    checkpoint: Optional[str] = None  # local checkpoint directory to restore, or None for a fresh run
    mlflow_run_id: Optional[str] = None  # the MLflow run this one resumes (its parent), if known
    eval_start: Optional[float] = None  # held-out accuracy recorded at the start of the original run
    step: int = 0  # the trainer step the checkpoint holds
    finished: Optional[str] = None  # the checkpoint already reaches trainer.total_steps: what to tell the user


def export_dir(cfg: TrainConfig) -> Path:
    return cfg.run.run_dir / "policy"


@task(name="resolve-resume", cache_policy=NO_CACHE, persist_result=False)
def resolve_resume(cfg: TrainConfig, resume_from: Optional[str]) -> ResumeTarget:
    """Turn `resume_from` (a checkpoint directory, a run directory: its newest checkpoint, or an MLflow run id) into
    a validated local checkpoint; a checkpoint that already reaches trainer.total_steps is neither downloaded nor
    loaded (`finished` says so)."""
    if not resume_from:
        return ResumeTarget()
    logger = get_run_logger()
    finished = nothing_to_train(cfg, resume_from)
    if finished:
        logger.info(finished)
        return ResumeTarget(finished=finished)
    uri = tracking.resolve_tracking_uri(cfg)
    try:
        ckpt = local_checkpoint(cfg, resume_from, "resume_from")  # a run directory: its newest checkpoint
    except ConfigError as exc:  # names the checkpoints that do exist near the path
        raise CheckpointError(str(exc)) from None
    run_id: Optional[str] = None
    if ckpt is None:  # an MLflow run id
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
    _keep_bounded(path, step, artifact, cfg.checkpoint.keep, tracker)
    return str(path)


@task(name="record-checkpoint", cache_policy=NO_CACHE, persist_result=False)
def record_checkpoint(tracker, path: str, step: int) -> str:
    """A checkpoint the trainer wrote at an exact step, logged to MLflow as artifacts."""
    artifact = tracking.log_checkpoint(tracker, path) if tracker is not None else None
    _keep_bounded(path, step, artifact, tracker.keep_checkpoints if tracker is not None else 0, tracker)
    return str(path)


def _keep_bounded(path: str, step: int, artifact: Optional[str], keep: int, tracker) -> None:
    """checkpoint.keep: the run's checkpoints up to this one beyond the newest `keep` are deleted on
    disk and in MLflow (newer ones the trainer wrote are recorded first). One short line per checkpoint (the
    run directory is named at the start); where exactly it went and what went from where, at DEBUG."""
    removed = [p.name for p in prune_checkpoints(Path(path).parent, keep, newest_step=step)]
    deleted = [Path(d).name for d in tracking.prune_checkpoint_artifacts(tracker, keep)] if tracker is not None else []
    logger = get_run_logger()
    gone = sorted(set(removed) | set(deleted))
    logger.info(
        "checkpoint at step %d: %s%s%s",
        step,
        Path(path).name,
        " (also in MLflow)" if artifact else "",
        f"; older ones deleted (checkpoint.keep={keep}): {', '.join(gone)}" if gone else "",
    )
    logger.debug(
        "checkpoint %s: MLflow artifact %s; deleted %s on disk, %s in MLflow",
        path,
        artifact,
        ", ".join(removed) or "none",
        ", ".join(deleted) or "none",
    )


@task(name="export-policy", cache_policy=NO_CACHE, persist_result=False)
def export_policy(runtime, cfg: TrainConfig) -> str:
    """The trained policy as a Hugging Face model directory (loadable by rlhf_core.model.policy.load_policy)."""
    path = runtime.export(str(export_dir(cfg)))
    get_run_logger().info("exported the policy to %s", path)
    return str(path)
