"""What `resume_from` names, told without Prefect and without downloading anything (the command line asks before
anything starts; the flow's `tasks.checkpoints.resolve_resume` asks again and downloads).

`resume_from` is a checkpoint directory, a run directory or its checkpoints/ directory (their newest checkpoint:
`runs/tiny/latest` resumes the newest run where it stopped), or an MLflow run id (its newest complete checkpoint
artifact). A local path that holds no checkpoint fails naming the checkpoints that do exist near it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from rlhf_core.config import RUN_CONFIG_FILE, ConfigError, TrainConfig, load_config
from rlhf_core.run.checkpoint_paths import META_FILE, checkpoint_step, checkpoint_target
from tracking.artifacts import CHECKPOINT_ARTIFACT_PATH, download_artifact, latest_checkpoint_artifact
from tracking.runs import looks_like_run_id, resolve_tracking_uri, run_exists, sqlite_path

__all__ = ["check_resume", "check_run", "local_checkpoint", "nothing_to_train", "resume_config", "resume_point"]


def local_checkpoint(cfg: TrainConfig, resume_from: str, option: str = "--resume-from") -> Optional[Path]:
    """The checkpoint a local path names (a run directory's newest); None for an MLflow run id that is no local
    path. ConfigError (one line, listing the checkpoints near it) for a path that holds none."""
    path = Path(resume_from).expanduser()
    if not path.exists() and looks_like_run_id(resume_from):
        return None
    return checkpoint_target(path, option, cfg.checkpoint.keep)


def check_resume(cfg: TrainConfig, resume_from: str) -> str:
    """The command line's check: a local checkpoint (returned resolved: a run directory's newest checkpoint), or
    an MLflow run that exists and holds a complete checkpoint (its id returned). ConfigError, one line, else."""
    local = local_checkpoint(cfg, resume_from)
    if local is not None:
        return str(local)
    uri = resolve_tracking_uri(cfg)
    check_run(resume_from, uri, "--resume-from")
    if latest_checkpoint_artifact(resume_from, uri) is None:
        raise ConfigError(
            f"--resume-from {resume_from}: MLflow run {resume_from} holds no complete checkpoint artifact under "
            f"{CHECKPOINT_ARTIFACT_PATH}/ in {uri}"
        )
    return resume_from


def check_run(run_id: str, uri: str, option: str) -> None:
    """ConfigError (one line) unless MLflow run `run_id` is in the store at `uri`; a SQLite store that does not
    exist is not created by asking."""
    db = sqlite_path(uri)
    if (db is not None and not db.is_file()) or not run_exists(run_id, uri):
        where = f"{uri} (no such file)" if db is not None and not db.is_file() else uri
        raise ConfigError(f"{option} {run_id}: no such directory, and no MLflow run with that id in {where}")


def resume_point(cfg: TrainConfig, resume_from: str) -> Optional[tuple[int, str]]:
    """(step, what it is) of the checkpoint `resume_from` names, told without downloading or loading it: the
    meta.json of a checkpoint directory (a run directory's newest), the artifact name of an MLflow run's newest
    complete checkpoint. None when that cannot be told (`resolve_resume` then says what is wrong)."""
    try:
        local = local_checkpoint(cfg, resume_from)
        if local is not None:
            return int(json.loads((local / META_FILE).read_text())["step"]), f"checkpoint {local}"
        artifact = latest_checkpoint_artifact(resume_from, resolve_tracking_uri(cfg))
        if artifact is not None:
            return checkpoint_step(artifact) or 0, f"MLflow run {resume_from} ({artifact})"
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


def resume_config(cfg: TrainConfig, resume_from: str, overrides: Sequence[str] = ()) -> tuple[TrainConfig, str]:
    """The config of the run `resume_from` names, its checkpoint's train_config.yaml (an MLflow run's newest
    complete checkpoint: that one file downloaded), with `overrides` on top, and the words naming it; (`cfg`, "")
    where the checkpoint holds none. What `atrlhf train --resume-from` continues with when no --config is given, so
    that a run (a sweep's point among them) is resumable by its id or directory alone."""
    local = local_checkpoint(cfg, resume_from)
    if local is not None:
        path, source = local / RUN_CONFIG_FILE, str(local / RUN_CONFIG_FILE)
        if not path.is_file():
            return cfg, ""
    else:
        uri = resolve_tracking_uri(cfg)
        artifact = latest_checkpoint_artifact(resume_from, uri)
        if artifact is None:
            return cfg, ""
        try:
            path = download_artifact(resume_from, f"{artifact}/{RUN_CONFIG_FILE}", uri, tempfile.mkdtemp())
        except Exception:  # a checkpoint written without its config (an older run): the command line's config
            return cfg, ""
        source = f"the {RUN_CONFIG_FILE} of MLflow run {resume_from}'s {artifact}"
    try:
        return load_config(path, list(overrides)), source
    except ConfigError as exc:
        raise ConfigError(f"the run's own config ({source}) does not load ({exc}); pass --config") from None
