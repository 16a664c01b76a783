"""`atrlhf evaluate`'s steps, without the command line: find the policy a target names (a local path as it is,
an MLflow run id's logged model downloaded), score it with the config it was trained with (its
train_config.yaml, unless the user names a config), and say what was scored in the user's words (the path, or
the run id: never a temporary directory that is gone by the time the line is read).

The scoring itself is `rlhf_core.policy_eval`; the MLflow download is `tasks.mlflow_client`'s.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_core.checkpoint import inspect_path
from rlhf_core.config import ConfigError, TrainConfig, load_config
from rlhf_core.policy_eval import evaluate_policy, policy_to_evaluate
from tracking import download_logged_policy, looks_like_run_id, resolve_tracking_uri


@dataclass
class Evaluation:
    cfg: TrainConfig  # the config the policy was scored with
    result: dict  # evaluate_policy's metrics
    policy: str  # what was scored, as the user named it: a path, or the MLflow run id
    run_config: Optional[str]  # the run's own config used (where it came from); None: the given config
    mlflow_run_id: Optional[str] = None


@contextmanager
def located(cfg: TrainConfig, target: str) -> Iterator[tuple[Path, Optional[str]]]:
    """(local directory, MLflow run id or None) of `target`: a path as it is; an MLflow run id's logged model,
    downloaded into a temporary directory that is removed when the block ends."""
    path = Path(target).expanduser()
    if path.exists() or not looks_like_run_id(target):
        yield path, None
        return
    uri = resolve_tracking_uri(cfg)
    with tempfile.TemporaryDirectory(prefix="atrlhf-model-") as scratch:
        try:
            local = download_logged_policy(target, uri, Path(scratch))
        except Exception as exc:  # MlflowException and friends: name the run and the store
            raise FileNotFoundError(
                f"--checkpoint {target!r}: no logged model for that MLflow run in {uri} "
                f"({type(exc).__name__}: {str(exc)[:300]})"
            ) from None
        yield local, target


def evaluate(cfg: TrainConfig, target: str, overrides: Sequence[str] = (), use_run_config: bool = True) -> Evaluation:
    """Score the policy `target` names (checkpoint directory, exported policy directory or MLflow run id).

    With `use_run_config` (no --config given) the policy's own train_config.yaml, with `overrides`, replaces
    `cfg` (which then only says where the MLflow store is); a run config that does not load raises ConfigError
    naming it. FileNotFoundError, CheckpointError or ModelLoadError: not a policy, or not this config's."""
    with located(cfg, target) as (path, run_id):
        run_config = inspect_path(path).run_config if use_run_config else None
        source = None
        if run_config is not None:  # the config the policy was trained with, unless the user names one
            source = f"the train_config.yaml of MLflow run {run_id}'s logged model" if run_id else str(run_config)
            try:
                cfg = load_config(run_config, list(overrides))
            except ConfigError as exc:
                raise ConfigError(f"the run's own config ({source}) does not load ({exc}); pass --config") from None
        policy_dir, checkpoint = policy_to_evaluate(cfg, path)
        result = evaluate_policy(cfg, policy_dir, checkpoint)
    return Evaluation(cfg, result, run_id or str(checkpoint or policy_dir), source, run_id)
