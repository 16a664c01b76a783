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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlhf_core.config import ConfigError, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]
_KNOWN_KEYS = {"config_file", "overrides", "resume_from"}


def load_parameters(file: str) -> dict[str, Any]:
    """Outputs: config (validated, as JSON-ready mapping), resume_from, directory (the checkout root)."""
    path = Path(file)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_file():
        raise ConfigError(f"deployment parameter file {path} does not exist")
    spec = yaml.safe_load(path.read_text()) or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: expected a mapping with {sorted(_KNOWN_KEYS)}")
    unknown = sorted(set(spec) - _KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; expected {sorted(_KNOWN_KEYS)}")
    config_file = spec.get("config_file")
    if config_file and not Path(config_file).is_absolute():
        config_file = REPO_ROOT / config_file
    overrides = spec.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"{path}: 'overrides' must be a list of 'dotted.key=value' strings")
    cfg = load_config(config_file, overrides)
    return {"config": cfg.model_dump(mode="json"), "resume_from": spec.get("resume_from"), "directory": str(REPO_ROOT)}
