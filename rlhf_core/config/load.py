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
from rlhf_core.config.data import TINY_PRESETS, TinyShape, preset_name, preset_shape
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
    overrides, validate.

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
    apply_overrides(data, overrides)
    if overrides:
        source += f" (with overrides {overrides})"
    return validate_config(data, source)


def _runtime_mode(data: dict) -> Optional[str]:
    """runtime.mode (removed): lockstep is runtime.max_staleness 0, and 'async' was the only other value."""
    runtime = data.get("runtime")
    if not isinstance(runtime, dict) or "mode" not in runtime:
        return None
    mode = runtime.pop("mode")
    if mode == "sync":
        runtime["max_staleness"] = 0
        return "runtime.mode: sync is runtime.max_staleness: 0 now (lockstep); loaded as such"
    if mode == "async":
        return None  # what every run does: simply accepted
    raise ConfigError(f"runtime.mode={mode!r}: the key is gone; lockstep is runtime.max_staleness: 0")


def _restart_limit(data: dict) -> Optional[str]:
    """supervision.restart_limit (removed): cluster.max_restarts is the run's one restart budget."""
    sup = data.get("supervision")
    if not isinstance(sup, dict) or "restart_limit" not in sup:
        return None
    limit = sup.pop("restart_limit")
    cluster = data.setdefault("cluster", {})
    if isinstance(cluster, dict) and "max_restarts" not in cluster:
        cluster["max_restarts"] = limit
        return "supervision.restart_limit is cluster.max_restarts now (the run's one restart budget); loaded as such"
    return "supervision.restart_limit is gone (cluster.max_restarts, also given, is the run's one restart budget)"


_ABSENT = object()


def _pop(data: dict, dotted: str) -> Any:
    """Remove the raw config's key `dotted` ('rollout.dtype') and return its value, or _ABSENT."""
    *path, last = dotted.split(".")
    node = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return _ABSENT
    return node.pop(last)


def _moved(old: str, new: str):
    """A key that moved: its value goes to the new key (unless that is given too) with one line naming it."""

    def migrate(data: dict) -> Optional[str]:
        *new_path, new_key = new.split(".")
        value = _pop(data, old)
        if value is _ABSENT:
            return None
        target = data
        for part in new_path:
            target = target.setdefault(part, {}) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            raise ConfigError(f"{old} moved to {new}, but {'.'.join(new_path)} is not a section")
        if new_key in target:
            return f"{old} is {new} now; {new}, also given, wins"
        target[new_key] = value
        return f"{old} is {new} now; loaded as such"

    return migrate


def _tis_cap(data: dict) -> Optional[str]:
    """algorithm.tis_cap (removed): truncated IS is algorithm.rollout_correction {mode: tis, level: token, upper}."""
    algo = data.get("algorithm")
    if not isinstance(algo, dict) or "tis_cap" not in algo:
        return None
    cap = algo.pop("tis_cap")
    if cap is None or "rollout_correction" in algo:
        return "algorithm.tis_cap is gone (algorithm.rollout_correction is the one correction); ignored"
    algo["rollout_correction"] = {"mode": "tis", "level": "token", "upper": cap}
    return f"algorithm.tis_cap is algorithm.rollout_correction {{mode: tis, level: token, upper: {cap}}} now; loaded as such"


_TINY_KEYS = {"tiny_kind": 0, "tiny_layers": 1, "tiny_hidden": 2, "tiny_heads": 3}  # their place in a TinyShape


def _tiny_preset(data: dict) -> Optional[str]:
    """model.tiny_kind / tiny_layers / tiny_hidden / tiny_heads (removed): one model.preset names the demo policy.
    The keys given are laid over model.preset when that is given too (else over the old defaults, 'tiny'), so an
    old `--set model.tiny_hidden=64` still changes a config's preset."""
    model = data.get("model")
    if not isinstance(model, dict) or not any(k in model for k in _TINY_KEYS):
        return None
    given = {k: model.pop(k) for k in list(_TINY_KEYS) if k in model}
    try:
        shape = list(preset_shape(model.get("preset", "tiny")))
    except ValueError:  # a bad preset is reported by validation, naming it
        shape = list(TINY_PRESETS["tiny"])
    for key, value in given.items():
        shape[_TINY_KEYS[key]] = value
    model["preset"] = preset_name(TinyShape(*shape))
    return f"{', '.join(f'model.{k}' for k in given)} {'is' if len(given) == 1 else 'are'} model.preset now; loaded as model.preset: {model['preset']}"


def _engine_kwarg(old: str, key: str, engine: str):
    """rollout.<old> (removed): an option only `engine` reads is rollout.engine_kwargs.<key> now; under another
    engine (which never read it) it is dropped, with the line saying so."""

    move = _moved(f"rollout.{old}", f"rollout.engine_kwargs.{key}")

    def migrate(data: dict) -> Optional[str]:
        rollout = data.get("rollout")
        if not isinstance(rollout, dict) or old not in rollout:
            return None
        if rollout.get("engine", "hf") != engine:
            rollout.pop(old)
            return f"rollout.{old} is rollout.engine_kwargs.{key} now, read by rollout.engine {engine!r} only; ignored"
        return move(data)

    return migrate


def _custom_resources(role: str):
    """cluster.<role>_resources (removed): the custom Ray resources of a role are keys of cluster.resources.<role>
    now, beside its CPU and GPU (a key also given there wins)."""
    old, new = f"cluster.{role}_resources", f"cluster.resources.{role}"

    def migrate(data: dict) -> Optional[str]:
        cluster = data.get("cluster")
        if not isinstance(cluster, dict) or f"{role}_resources" not in cluster:
            return None
        custom = cluster.pop(f"{role}_resources")
        if custom is None:
            custom = {}
        if not isinstance(custom, dict):
            raise ConfigError(f"{old} (now {new}) must map custom resource names to amounts, got {custom!r}")
        for name in custom:
            if name in ("CPU", "GPU"):
                raise ConfigError(f"{old}: {name!r} is not a custom resource; set {new}.{name}")
        resources = cluster.setdefault("resources", {})
        target = resources.setdefault(role, {}) if isinstance(resources, dict) else None
        if not isinstance(target, dict):
            raise ConfigError(f"{old} moved to {new}, but {new} is not a mapping")
        given = sorted(name for name in custom if name in target)
        for name, amount in custom.items():
            target.setdefault(name, amount)
        if given:
            return f"{old} is {new} now (its keys beside CPU and GPU); {', '.join(f'{new}.{n}' for n in given)}, also given, wins"
        return f"{old} is {new} now (its keys beside CPU and GPU); loaded as such"

    return migrate


def _gone(key: str, why: str):
    """A key that went with nothing in its place: it is dropped with one line saying why."""

    def migrate(data: dict) -> Optional[str]:
        return None if _pop(data, key) is _ABSENT else f"{key} is gone ({why}); ignored"

    return migrate


def _messages_key(data: dict) -> Optional[str]:
    """data.messages_key (removed): data.prompt_key takes text or a chat list; with its default ('prompt') a row's
    'messages' are used, as the old default messages_key did."""
    section = data.get("data")
    if not isinstance(section, dict) or "messages_key" not in section:
        return None
    key = section.pop("messages_key")
    if key == "messages":
        return "data.messages_key is gone (with data.prompt_key 'prompt', a row's 'messages' are used); ignored"
    if "prompt_key" in section:
        return "data.messages_key is data.prompt_key now (text or a chat list); data.prompt_key, also given, wins"
    section["prompt_key"] = key
    return f"data.messages_key is data.prompt_key now (text or a chat list); loaded as data.prompt_key: {key}"


def _env_factory(data: dict) -> Optional[str]:
    """env.factory (removed): with env.adapter the factory is env.path (module or file) and env.name (callable)."""
    env = data.get("env")
    if not isinstance(env, dict) or "factory" not in env:
        return None
    factory = env.pop("factory")
    if not factory:
        return "env.factory is env.path + env.name now; it was empty: ignored"
    path, _, name = str(factory).rpartition(":")
    if not path or not name:
        raise ConfigError(f"env.factory {factory!r} (now env.path + env.name) is not 'module:callable'")
    if env.get("path") or env.get("name"):
        return "env.factory is env.path + env.name now; env.path / env.name, also given, win"
    env["path"], env["name"] = path, name
    return f"env.factory is env.path + env.name now; loaded as env.path: {path}, env.name: {name}"


# Keys that moved or went: each rewrites the raw mapping in place and returns the one line to print (or None).
MIGRATIONS = [
    _runtime_mode,
    _restart_limit,
    _moved("tracking.checkpoint_every", "checkpoint.every"),
    _moved("tracking.keep_checkpoints", "checkpoint.keep"),
    _moved("tracking.eval_every", "eval.every"),
    _tis_cap,
    _tiny_preset,
    _engine_kwarg("random_tokens_per_s", "tokens_per_s", "random"),
    _engine_kwarg("vllm_gpu_memory_utilization", "gpu_memory_utilization", "vllm"),
    _moved("trainer.warm_start_steps", "trainer.warm_start.steps"),
    _moved("trainer.warm_start_lr", "trainer.warm_start.lr"),
    _moved("trainer.warm_start_targets", "trainer.warm_start.targets"),
    *(
        _moved(f"cluster.{role}_{kind}s", f"cluster.resources.{role}.{kind.upper()}")
        for role in ("rollout", "trainer", "reward")
        for kind in ("cpu", "gpu")
    ),
    _custom_resources("rollout"),
    _custom_resources("trainer"),
    _moved("supervision.engine_mismatch_kl", "supervision.engine_mismatch.kl"),
    _moved("supervision.engine_mismatch_polls", "supervision.engine_mismatch.polls"),
    _moved("rollout.max_total_tokens", "env.max_total_tokens"),
    *(_engine_kwarg(key, key, "hf") for key in ("continuous_batching", "max_active_rows", "dtype")),
    _gone(
        "runtime.prefetch", "the trainer always prefetches; benchmarks turn it off with ASYNCTENSORRLHF_NO_PREFETCH=1"
    ),
    _moved("critic.micro_batch_size", "trainer.micro_batch_size"),
    *(
        _moved(f"{s}.max_consecutive_failures", "supervision.max_consecutive_failures")
        for s in ("reward", "env", "agent")
    ),
    _messages_key,
    _env_factory,
]


def migrate_config(data: dict) -> list[str]:
    """Rewrite renamed or removed keys of a raw config mapping in place; returns one note per key rewritten."""
    notes = []
    for migration in MIGRATIONS:
        note = migration(data)
        if note:
            notes.append(note)
    return notes


def validate_config(data: dict | TrainConfig, source: str = "") -> TrainConfig:
    """Validate a nested dict (or re-validate a TrainConfig) into a TrainConfig, raising ConfigError. Renamed keys
    load under their new name, with one logged line each (`migrate_config`)."""
    if isinstance(data, TrainConfig):
        data = data.model_dump(mode="python")
    else:
        data = copy.deepcopy(data)  # the caller's mapping stays as it was
        for note in migrate_config(data):
            logging.getLogger("rlhf_core.config").warning("%s%s", note, source)
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
