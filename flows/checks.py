"""The command line's checks before anything starts: every path and every name a command's config uses, each
failing with one line that names the field or the option (`ConfigError`; the CLI exits 2). Nothing is created
and nothing is started: no run directory, no Prefect API, no Ray, no MLflow run (an MLflow run id given to
--resume-from or --checkpoint is looked up in the tracking store, that is all).

    train     rlhf_core.run.preflight.check_paths (model.path, critic.path, reward.model.path, data files, reward
              functions, environment and tools imported, a run.name in use), check_lora_targets (on the meta
              device), --resume-from (tracking.resume: a checkpoint, a run directory's newest, or an MLflow run
              holding one; a missing one lists the checkpoints that exist near it)
    sweep     --grid keys and values validated as --set would validate them, then every point, with the same
              path checks for each point's config
    evaluate  --checkpoint exists (or names an MLflow run) and holds a policy; with --config, its paths
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from rlhf_core.config import ConfigError, TrainConfig, parse_grid_item
from rlhf_core.run.checkpoint_paths import describe_near, holds_policy, policy_in
from rlhf_core.run.preflight import check_lora_targets, check_paths
from rlhf_core.sweep_grid import check_grid, check_points, expand_grid, seed_list, shared_points


def check_train(cfg: TrainConfig, resume_from: Optional[str]) -> Optional[str]:
    """Everything `atrlhf train` will use; returns `resume_from` resolved (a run directory: its newest
    checkpoint, resolved past `latest`) or None."""
    check_paths(cfg)
    check_lora_targets(cfg)
    if not resume_from:
        return None
    from tracking.resume import check_resume

    return check_resume(cfg, resume_from)


def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """--grid arguments -> {dotted key: [values]}; a key given twice is an error."""
    grid: dict[str, list] = {}
    for item in items:
        key, values = parse_grid_item(item)
        if key in grid:
            raise ConfigError(f"--grid {key} is given twice; list all its values in one --grid")
        grid[key] = values
    return check_grid(grid)  # a repeated value, say, is refused before anything starts


def check_sweep(cfg: TrainConfig, grid: dict[str, list], seeds: int, shared_fleet: bool = False) -> None:
    """Every value of the grid and every point (each checked like `atrlhf train` checks its config); with
    `shared_fleet`, that the points can share one (`check_shareable`: the key that differs named)."""
    lora_checked = set()
    for point_cfg in check_points(cfg, grid, seed_list(cfg, seeds)):
        check_paths(point_cfg)
        model = point_cfg.model
        key = (model.path, model.preset, tuple(model.lora.target_modules) if model.lora else None)
        if key not in lora_checked:
            lora_checked.add(key)
            check_lora_targets(point_cfg)
    if shared_fleet:
        shared_points(cfg, expand_grid(grid, seed_list(cfg, seeds)), "sweep")


def check_evaluate(cfg: TrainConfig, target: str, config_given: bool) -> None:
    """--checkpoint names a local policy (an exported policy, a checkpoint, a run directory) or an MLflow run;
    with --config, that config's paths too (without it the policy's own config is used)."""
    path = Path(target).expanduser()
    if not path.exists():
        from tracking import looks_like_run_id, resolve_tracking_uri
        from tracking.resume import check_run

        if not looks_like_run_id(target):
            raise ConfigError(f"--checkpoint {target}: it does not exist; {describe_near(path)}")
        check_run(target, resolve_tracking_uri(cfg), "--checkpoint")
    elif not holds_policy(policy_in(path)):
        raise ConfigError(
            f"--checkpoint {target}: not a checkpoint, an exported policy, a run directory or an MLflow run id; "
            f"{describe_near(path)}"
        )
    if config_given:
        check_paths(cfg)
