"""Loading a config: YAML files (with `base:` inheritance), dotted overrides, renamed keys, validation with
errors that name the field, and the flattened view MLflow logs."""

from __future__ import annotations

import copy
import difflib
import logging
import os
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from rlhf_core.config.base import ConfigError
from rlhf_core.config.migrations import migrate_config, migration_notes, refuse_unkept
from rlhf_core.config.train import TrainConfig


def _model_in(annotation) -> Optional[type[BaseModel]]:
    """The config section class an annotation holds (itself, or inside Optional / list), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        model = _model_in(arg)
        if model is not None:
            return model
    return None


def _field_names_at(loc: tuple) -> list[str]:
    """The fields of the section a validation error's location points into (its last part the unknown key):
    ('reward', 'componets') -> RewardConfig's fields; [] where the path leaves the config's sections."""
    model: Optional[type[BaseModel]] = TrainConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # a list item: the list's section class
            continue
        field = model.model_fields.get(part) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"] if p not in ("function-after",)) or "<root>"
        if path == "<root>" and e["type"] == "value_error":  # a cross-field rule: its message names the fields
            lines.append(str(e["msg"]).removeprefix("Value error, "))
            continue
        if e["type"] == "value_error" and str(e["msg"]).removeprefix("Value error, ").startswith(path):
            lines.append(str(e["msg"]).removeprefix("Value error, "))  # the rule's message names the field itself
            continue
        value = e.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        if e["type"] == "extra_forbidden":
            guess = difflib.get_close_matches(str(e["loc"][-1]), _field_names_at(e["loc"]), n=1, cutoff=0.6)
            hint = f"; did you mean {'.'.join([*path.split('.')[:-1], guess[0]])}?" if guess else ""
            lines.append(f"{path}: unknown field (value {shown}){hint}")
        elif e["type"] == "missing":
            lines.append(f"{path}: required field is missing")
        else:
            lines.append(f"{path}: {e['msg']} (got {shown})")
    return f"invalid configuration{source}:\n  " + "\n  ".join(lines)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars/lists) to a nested dict, in place."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def parse_grid_item(item: str) -> tuple[str, list[Any]]:
    """`dotted.key=v1,v2,...` (or `dotted.key=[v1, v2]`) -> (key, values), each value parsed like an override
    value. Values are not validated here: a sweep validates each point on its own.

    >>> parse_grid_item("runtime.max_staleness=1,4,16")
    ('runtime.max_staleness', [1, 4, 16])
    """
    parts, whole = _parse_override(item)
    key, raw = ".".join(parts), item.split("=", 1)[1].strip()
    if isinstance(whole, list):
        values = whole
    else:
        values = [_parse_override(f"{key}={piece}")[1] for piece in raw.split(",")]
    if not values or any(v == "" for v in values):
        raise ConfigError(f"grid {item!r}: expected dotted.key=value1,value2,... with no empty value")
    return key, values


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section (a mapping in both is merged, anything else replaced)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_config_file(path: str | os.PathLike, _seen: tuple = ()) -> dict:
    """A YAML config as a mapping, with `base: other.yaml` (relative to the file) read first and this file's
    keys merged on top, section by section: a recipe states only what differs from its base."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist" + (f" (the base of {_seen[-1]})" if _seen else ""))
    if p.resolve() in _seen:
        raise ConfigError(f"config file {p}: its base: chain comes back to it ({' -> '.join(map(str, _seen))})")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(loaded).__name__}")
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"config file {p}: base must name another YAML file (got {base!r})")
    return _merge(read_config_file(p.parent / base, (*_seen, p.resolve())), loaded)


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Read a YAML config (or the defaults when `path` is None; `base: other.yaml` inherits), apply dotted
    overrides, validate. What is typed last wins whatever spelling of a key the file or an override uses: the
    file's renamed keys are migrated first, then each override is applied and migrated in turn.

    >>> cfg = load_config(None, ["algorithm.loss_options.clip_eps=0.1"])
    >>> cfg.algorithm.loss_options.clip_eps
    0.1
    """
    data: dict = {}
    source = ""
    if path is not None:
        source = f" in {Path(path)}"
        data = read_config_file(path)
    overrides = list(overrides)
    notes = migration_notes(data)  # one line per migration: the last override's word on it
    for override in overrides:
        apply_overrides(data, [override])
        notes.update(migration_notes(data, old_wins=True))
    if overrides:
        source += f" (with overrides {overrides})"
    for note in notes.values():
        logging.getLogger("rlhf_core.config").warning("%s%s", note, source)
    return validate_config(data, source)


def validate_config(data: dict | TrainConfig, source: str = "") -> TrainConfig:
    """Validate a nested dict (or re-validate a TrainConfig) into a TrainConfig, raising ConfigError. Renamed keys
    load under their new name, with one logged line each (`migrate_config`)."""
    if isinstance(data, TrainConfig):
        data = data.model_dump(mode="python")
    else:
        data = copy.deepcopy(data)  # the caller's mapping stays as it was
        for note in migrate_config(data):
            logging.getLogger("rlhf_core.config").warning("%s%s", note, source)
        refuse_unkept(data)
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
    if not cfg.cluster.address and os.environ.get("RAY_ADDRESS"):
        cfg.cluster.address = os.environ["RAY_ADDRESS"]
    if not cfg.tracking.tracking_uri and os.environ.get("MLFLOW_TRACKING_URI"):
        cfg.tracking.tracking_uri = os.environ["MLFLOW_TRACKING_URI"]
    return cfg


def flatten_config(cfg: TrainConfig) -> dict[str, Any]:
    """Dotted-key view of the config, as logged to MLflow params."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node and all(isinstance(k, str) for k in node):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(node, dict) and not node:
            out[prefix] = "{}"  # an empty mapping (env.kwargs): a param value, not a section
        else:
            out[prefix] = node

    walk("", cfg.model_dump(mode="json"))
    return out
