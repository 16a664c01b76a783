"""`atrlhf evaluate`'s steps, without the command line: find the policy a target names (a local path as it is, a
run directory's exported policy or else its newest checkpoint, an MLflow run id's logged model or else its newest
checkpoint artifact, downloaded), score it with the config it was trained with (its
train_config.yaml, unless the user names a config), and say what was scored in the user's words (the path, or
the run id: never a temporary directory that is gone by the time the line is read).

The scoring itself is `rlhf_core.policy_eval`; the MLflow download is `tracking`'s.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_core.config import ConfigError, TrainConfig, load_config
from rlhf_core.policy_eval import evaluate_policy, policy_to_evaluate
from rlhf_core.run.checkpoint import inspect_path
from rlhf_core.run.checkpoint_paths import is_checkpoint, policy_in
from tracking import (
    download_artifact,
    download_logged_policy,
    latest_checkpoint_artifact,
    looks_like_run_id,
    resolve_tracking_uri,
)


@dataclass
class Evaluation:
    cfg: TrainConfig  # the config the policy was scored with
    result: dict  # evaluate_policy's metrics
    policy: str  # what was scored, as the user named it: a path, or the MLflow run id
    run_config: Optional[str]  # the run's own config used (where it came from); None: the given config
    mlflow_run_id: Optional[str] = None
    note: Optional[str] = None  # what stood in for what the user named (a run's newest checkpoint), if anything


@dataclass
class Located:
    path: Path  # the local directory to score
    run_id: Optional[str] = None  # the MLflow run it came from
    note: Optional[str] = None  # what stood in for what the target named


@contextmanager
def located(cfg: TrainConfig, target: str) -> Iterator[Located]:
    """The local directory `target` names: a path as it is (a run directory: its exported policy, else its newest
    checkpoint); an MLflow run id's logged model, else its newest complete checkpoint artifact (a sweep's child,
    or a run stopped before its export), downloaded into a temporary directory removed when the block ends."""
    path = Path(target).expanduser()
    if path.exists() or not looks_like_run_id(target):
        chosen = policy_in(path)
        stood_in = is_checkpoint(chosen) and not is_checkpoint(path)
        yield Located(
            chosen, None, f"{chosen}, the newest checkpoint of {target} (no exported policy)" if stood_in else None
        )
        return
    uri = resolve_tracking_uri(cfg)
    with tempfile.TemporaryDirectory(prefix="atrlhf-model-") as scratch:
        local, note = _download(target, uri, Path(scratch))
        yield Located(local, target, note)


def _download(run_id: str, uri: str, scratch: Path) -> tuple[Path, Optional[str]]:
    """(local directory, what stood in) of a run's logged model, else of its newest complete checkpoint."""
    try:
        return download_logged_policy(run_id, uri, scratch / "model"), None
    except FileNotFoundError:  # the run logged no model: its newest checkpoint, if it holds one
        pass
    except Exception as exc:  # MlflowException and friends (no such run): name the run and the store
        raise FileNotFoundError(
            f"--checkpoint {run_id!r}: no logged model for that MLflow run in {uri} "
            f"({type(exc).__name__}: {str(exc)[:300]})"
        ) from None
    artifact = latest_checkpoint_artifact(run_id, uri)
    if artifact is None:
        raise FileNotFoundError(
            f"--checkpoint {run_id!r}: MLflow run {run_id} in {uri} logged no model and holds no complete checkpoint"
        )
    local = download_artifact(run_id, artifact, uri, scratch / "checkpoint")
    return local, f"its newest checkpoint artifact {artifact} (the run logged no model)"


def evaluate(cfg: TrainConfig, target: str, overrides: Sequence[str] = (), use_run_config: bool = True) -> Evaluation:
    """Score the policy `target` names (checkpoint directory, exported policy directory, run directory or MLflow
    run id).

    With `use_run_config` (no --config given) the policy's own train_config.yaml, with `overrides`, replaces
    `cfg` (which then only says where the MLflow store is); a run config that does not load raises ConfigError
    naming it. FileNotFoundError, CheckpointError or ModelLoadError: not a policy, or not this config's."""
    with located(cfg, target) as found:
        path, run_id = found.path, found.run_id
        run_config = inspect_path(path).run_config if use_run_config else None
        source = None
        if run_config is not None:  # the config the policy was trained with, unless the user names one
            source = f"the train_config.yaml of MLflow run {run_id}'s logged model" if run_id else str(run_config)
            if run_id and found.note:
                source = f"the train_config.yaml of MLflow run {run_id}'s newest checkpoint"
            try:
                cfg = load_config(run_config, list(overrides))
            except ConfigError as exc:
                raise ConfigError(f"the run's own config ({source}) does not load ({exc}); pass --config") from None
        policy_dir, checkpoint = policy_to_evaluate(cfg, path)
        result = evaluate_policy(cfg, policy_dir, checkpoint)
    policy = run_id or (target if found.note else str(checkpoint or policy_dir))
    return Evaluation(cfg, result, policy, source, run_id, found.note)
