"""Moved to `tracking.resume` (tasks/ holds only Prefect tasks; what `resume_from` names is told without Prefect,
from the local checkpoints and the MLflow store); its names stay importable from here."""

from tracking.resume import check_resume, check_run, local_checkpoint, nothing_to_train, resume_point

__all__ = ["check_resume", "check_run", "local_checkpoint", "nothing_to_train", "resume_point"]
