"""Renamed and removed config keys: each migration rewrites one old key of a raw config mapping in place and
returns the line that says so (`migrate_config`, applied by rlhf_core.config.load before validation).

What the user typed last wins, whatever spelling of a key either place uses: the file is migrated first, then
each override is applied and migrated in turn with `old_wins=True` (the old key just typed is the latest word,
over its new spelling already present); a file or one mapping that gives both spellings keeps the new one."""

from __future__ import annotations

from typing import Any, Optional

from rlhf_core.config.base import ConfigError
from rlhf_core.config.data import ENGINE_KWARGS, TINY_PRESETS, TinyShape, preset_name, preset_shape


def _runtime_mode(data: dict, old_wins: bool = False) -> Optional[str]:
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


def _restart_limit(data: dict, old_wins: bool = False) -> Optional[str]:
    """supervision.restart_limit (removed): cluster.max_restarts is the run's one restart budget."""
    sup = data.get("supervision")
    if not isinstance(sup, dict) or "restart_limit" not in sup:
        return None
    limit = sup.pop("restart_limit")
    cluster = data.setdefault("cluster", {})
    if isinstance(cluster, dict) and ("max_restarts" not in cluster or old_wins):
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

    def migrate(data: dict, old_wins: bool = False) -> Optional[str]:
        *new_path, new_key = new.split(".")
        value = _pop(data, old)
        if value is _ABSENT:
            return None
        target = data
        for part in new_path:
            target = target.setdefault(part, {}) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            raise ConfigError(f"{old} moved to {new}, but {'.'.join(new_path)} is not a section")
        if new_key in target and not old_wins:
            return f"{old} is {new} now; {new}, also given, wins"
        given = new_key in target
        target[new_key] = value
        return f"{old} is {new} now; loaded as such" + (f" (given after {new}, it wins)" if given else "")

    return migrate


def _tis_cap(data: dict, old_wins: bool = False) -> Optional[str]:
    """algorithm.tis_cap (removed): truncated IS is algorithm.rollout_correction {mode: tis, level: token, upper}."""
    algo = data.get("algorithm")
    if not isinstance(algo, dict) or "tis_cap" not in algo:
        return None
    cap = algo.pop("tis_cap")
    if cap is None or ("rollout_correction" in algo and not old_wins):
        return "algorithm.tis_cap is gone (algorithm.rollout_correction is the one correction); ignored"
    algo["rollout_correction"] = {"mode": "tis", "level": "token", "upper": cap}
    return f"algorithm.tis_cap is algorithm.rollout_correction {{mode: tis, level: token, upper: {cap}}} now; loaded as such"


_TINY_KEYS = {"tiny_kind": 0, "tiny_layers": 1, "tiny_hidden": 2, "tiny_heads": 3}  # their place in a TinyShape


def _tiny_preset(data: dict, old_wins: bool = False) -> Optional[str]:
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

    def migrate(data: dict, old_wins: bool = False) -> Optional[str]:
        rollout = data.get("rollout")
        if not isinstance(rollout, dict) or old not in rollout:
            return None
        if rollout.get("engine", "hf") != engine:
            rollout.pop(old)
            return f"rollout.{old} is rollout.engine_kwargs.{key} now, read by rollout.engine {engine!r} only; ignored"
        return move(data, old_wins)

    return migrate


def _other_engines_options(data: dict, old_wins: bool = False) -> Optional[str]:
    """rollout.engine_kwargs that belong to another engine than rollout.engine are set aside, with one line: one
    override (`--set rollout.engine=hf`) switches the engine of any recipe. A key no engine takes is still refused."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or not isinstance(rollout.get("engine_kwargs"), dict):
        return None
    engine = rollout.get("engine", "hf")
    takes = ENGINE_KWARGS.get(engine)
    if takes is None:  # the engine itself is wrong: validation names rollout.engine
        return None
    kwargs = rollout["engine_kwargs"]
    aside = {
        key: next(name for name, spec in ENGINE_KWARGS.items() if key in spec.model_fields)
        for key in list(kwargs)
        if key not in takes.model_fields and any(key in spec.model_fields for spec in ENGINE_KWARGS.values())
    }
    for key in aside:
        kwargs.pop(key)
    if not aside:
        return None
    named = ", ".join(f"rollout.engine_kwargs.{key} (rollout.engine {owner!r})" for key, owner in aside.items())
    return f"{named}: set aside, rollout.engine is {engine!r}"


def _custom_resources(role: str):
    """cluster.<role>_resources (removed): the custom Ray resources of a role are keys of cluster.resources.<role>
    now, beside its CPU and GPU (a key also given there wins)."""
    old, new = f"cluster.{role}_resources", f"cluster.resources.{role}"

    def migrate(data: dict, old_wins: bool = False) -> Optional[str]:
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
            if old_wins:
                target[name] = amount
            else:
                target.setdefault(name, amount)
        if given and old_wins:
            return f"{old} is {new} now (its keys beside CPU and GPU); loaded as such (given after {new}, it wins)"
        if given:
            return f"{old} is {new} now (its keys beside CPU and GPU); {', '.join(f'{new}.{n}' for n in given)}, also given, wins"
        return f"{old} is {new} now (its keys beside CPU and GPU); loaded as such"

    return migrate


def _gone(key: str, why: str):
    """A key that went with nothing in its place: it is dropped with one line saying why."""

    def migrate(data: dict, old_wins: bool = False) -> Optional[str]:
        return None if _pop(data, key) is _ABSENT else f"{key} is gone ({why}); ignored"

    return migrate


def _get(data: dict, dotted: str) -> Any:
    """The raw config's value at `dotted`, or _ABSENT."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _fixed(key: str, value: Any, now: str):
    """A key that went because its value is fixed now (`now` says where): the fixed value (or null) is dropped with
    one line. Any other cannot be kept: it stays for a later override to replace, and validation refuses it, naming
    the key and where the figure lives (`refuse`)."""

    def migrate(data: dict, old_wins: bool = False) -> Optional[str]:
        given = _get(data, key)
        if given is _ABSENT or not (given is None or given == value):
            return None
        _pop(data, key)
        return f"{key} is gone ({now}); ignored"

    def refuse(data: dict) -> Optional[str]:
        given = _get(data, key)
        return None if given is _ABSENT else f"{key}={given!r} cannot be kept: the key is gone ({now}); remove it"

    migrate.refuse = refuse  # type: ignore[attr-defined]
    return migrate


def _reward_model_trust(data: dict, old_wins: bool = False) -> Optional[str]:
    """reward.model.trust_remote_code (removed): model.trust_remote_code is the one switch for code shipped in the
    run's model directories (policy, critic, reward model). Trusting the reward model's code but not the policy's
    cannot be kept: the key stays for a later `--set model.trust_remote_code=true`, and validation refuses it
    (`refuse`), rather than trusting the policy's code unasked."""
    trusted = _get(data, "reward.model.trust_remote_code")
    run_trusts = _get(data, "model.trust_remote_code") is True
    if trusted is _ABSENT or (trusted is not False and trusted is not None and not run_trusts):
        return None
    _pop(data, "reward.model.trust_remote_code")
    return (
        "reward.model.trust_remote_code is model.trust_remote_code now (one switch for every model directory of the "
        f"run); {'true' if run_trusts else 'false'} for the reward model too"
    )


def _refuse_reward_model_trust(data: dict) -> Optional[str]:
    trusted = _get(data, "reward.model.trust_remote_code")
    if trusted is _ABSENT:
        return None
    return (
        f"reward.model.trust_remote_code={str(trusted).lower()} cannot be kept alone: the key is gone, and "
        "model.trust_remote_code is the one switch for code shipped in the run's model directories (policy, critic, "
        "reward model); set model.trust_remote_code=true"
    )


_reward_model_trust.refuse = _refuse_reward_model_trust  # type: ignore[attr-defined]


def _messages_key(data: dict, old_wins: bool = False) -> Optional[str]:
    """data.messages_key (removed): data.prompt_key takes text or a chat list; with its default ('prompt') a row's
    'messages' are used, as the old default messages_key did."""
    section = data.get("data")
    if not isinstance(section, dict) or "messages_key" not in section:
        return None
    key = section.pop("messages_key")
    if key == "messages":
        return "data.messages_key is gone (with data.prompt_key 'prompt', a row's 'messages' are used); ignored"
    if "prompt_key" in section and not old_wins:
        return "data.messages_key is data.prompt_key now (text or a chat list); data.prompt_key, also given, wins"
    section["prompt_key"] = key
    return f"data.messages_key is data.prompt_key now (text or a chat list); loaded as data.prompt_key: {key}"


def _env_factory(data: dict, old_wins: bool = False) -> Optional[str]:
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
    if (env.get("path") or env.get("name")) and not old_wins:
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
    _reward_model_trust,
    _fixed(
        "trainer.padding_free",
        True,
        "training is always padding-free, with the same results as padded rows; a benchmark measures padded rows "
        "with ASYNCTENSORRLHF_NO_PADDING_FREE=1",
    ),
    _fixed(
        "runtime.autopilot.wait_frac",
        0.2,
        "the trainer counts as waiting above rlhf_core.autopilot.WAIT_FRAC, 0.2 of its step time, as for the autoscaler",
    ),
    _fixed(
        "model.lora.dropout",
        0,
        "no LoRA dropout: the trainer computes log-probs without dropout, as the rollout engines do; with it on-policy "
        "ratios differ from 1 and M2PO's mask comes from another dropout sample than the gradient",
    ),
    _other_engines_options,  # not a renamed key: the last word on the engine's options, after every move above
]


def migrate_config(data: dict, old_wins: bool = False) -> list[str]:
    """Rewrite renamed or removed keys of a raw config mapping in place; returns one note per key rewritten.
    `old_wins`: an old key present was given after its new spelling (an override just applied), so it wins."""
    return list(migration_notes(data, old_wins).values())


def refuse_unkept(data: dict) -> None:
    """After the last migration: an old key whose value cannot be kept (no override replaced it) is a ConfigError
    naming the key and its replacement."""
    for migration in MIGRATIONS:
        refuse = getattr(migration, "refuse", None)
        problem = refuse(data) if refuse is not None else None
        if problem:
            raise ConfigError(problem)


def migration_notes(data: dict, old_wins: bool = False) -> dict[int, str]:
    """migrate_config's notes by the index of the migration (in MIGRATIONS) that wrote each: a later note of the
    same migration (the next override) replaces the earlier one."""
    notes = {}
    for i, migration in enumerate(MIGRATIONS):
        note = migration(data, old_wins)
        if note:
            notes[i] = note
    return notes
