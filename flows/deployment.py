"""A `prefect deploy` build step: read a deployment's parameter file, validate it, hand it to prefect.yaml.

prefect.yaml cannot include files, so each deployment there runs this step first:

    build:
      - flows.deployment.load_parameters:
          id: params
          file: deployments/tiny_async.yaml
    parameters:
      config: "{{ params.config }}"          # the whole validated TrainConfig, as a nested mapping
      resume_from: "{{ params.resume_from }}"

A parameter file names a base config and overrides (`config_file`, `overrides`, `resume_from`); the
step validates the result with rlhf_core.config, so a bad field fails `prefect deploy` naming the field.
Its `directory` output (this checkout) feeds the `set_working_directory` pull step.

A sweep's deployment (flows/sweep.py:sweep) uses `load_sweep_parameters` instead: the same base config
and overrides, plus `grid` (dotted key -> list of values), `seeds`, `max_parallel`, `metric`, `target` and
`sweep_id`. The base config is validated at deploy time; the grid's values are not (each point validates
its own, so one bad value fails only its child run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlhf_core.config import ConfigError, load_config, parse_grid_item
from rlhf_core.sweep_grid import check_grid, expand_grid, seed_list

REPO_ROOT = Path(__file__).resolve().parents[1]
_KNOWN_KEYS = {"config_file", "overrides", "resume_from"}
_SWEEP_KEYS = {"config_file", "overrides", "grid", "seeds", "max_parallel", "metric", "target", "sweep_id"}


def _read_spec(file: str, known: set[str]) -> tuple[Path, dict]:
    path = Path(file)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_file():
        raise ConfigError(f"deployment parameter file {path} does not exist")
    spec = yaml.safe_load(path.read_text()) or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: expected a mapping with {sorted(known)}")
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; expected {sorted(known)}")
    return path, spec


def load_parameters(file: str) -> dict[str, Any]:
    """Outputs: config (validated, as JSON-ready mapping), resume_from, directory (the checkout root)."""
    path, spec = _read_spec(file, _KNOWN_KEYS)
    cfg = _base_config(path, spec)
    return {"config": cfg.model_dump(mode="json"), "resume_from": spec.get("resume_from"), "directory": str(REPO_ROOT)}


def load_sweep_parameters(file: str) -> dict[str, Any]:
    """Outputs: base_config (validated), grid, seeds, max_parallel, metric, target, sweep_id, directory."""
    path, spec = _read_spec(file, _SWEEP_KEYS)
    cfg = _base_config(path, spec)
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or not grid:
        raise ConfigError(f"{path}: 'grid' must be a mapping of dotted config keys to lists of values")
    checked = {}
    for key, values in grid.items():
        if isinstance(values, str):  # "grpo,m2po", as on the command line
            values = parse_grid_item(f"{key}={values}")[1]
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: grid.{key} must be a non-empty list of values, got {values!r}")
        checked[str(key)] = values
    seeds = spec.get("seeds", 1)
    if isinstance(seeds, bool) or not isinstance(seeds, (int, list)):
        raise ConfigError(f"{path}: 'seeds' must be a count or a list of integers, got {seeds!r}")
    try:  # repeated values or seeds are refused at deploy time
        expand_grid(check_grid(checked), seed_list(cfg, seeds))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    max_parallel = spec.get("max_parallel", 1)
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise ConfigError(f"{path}: 'max_parallel' must be an integer >= 1, got {max_parallel!r}")
    return {
        "base_config": cfg.model_dump(mode="json"),
        "grid": checked,
        "seeds": seeds,
        "max_parallel": max_parallel,
        "metric": str(spec.get("metric", "eval/accuracy")),
        "target": float(spec.get("target", 0.9)),
        "sweep_id": spec.get("sweep_id"),
        "directory": str(REPO_ROOT),
    }


def _base_config(path: Path, spec: dict):
    config_file = spec.get("config_file")
    if config_file and not Path(config_file).is_absolute():
        config_file = REPO_ROOT / config_file
    overrides = spec.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"{path}: 'overrides' must be a list of 'dotted.key=value' strings")
    return load_config(config_file, overrides)
