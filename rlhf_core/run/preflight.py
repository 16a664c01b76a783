"""Checks made at launch, once the model directory and the output directory are known, before anything starts.

`load_config` already refuses what a config alone can show to be wrong. What depends on the machine or on
the model is checked here, each failing with a `ConfigError` that names the field, the file and what to do:

- `check_output_dir(path)`: run.output_dir can be created and written (not a file, not read-only);
- `check_lengths(policy_dir, cfg, prompts)`: the longest prompt plus rollout.max_new_tokens fits the model's
  context (config.json max_position_embeddings, or its equivalent);
- `claim_run_dir(output_dir, name)`: this run's own directory under run.output_dir, locked while the run is
  alive so that a second live run refuses it; `output_dir/latest` is pointed at it once it holds something
  (`RunDirClaim.point_latest`), so a run that fails before producing anything does not move it.
- `check_reward_model_config(path)` (rlhf_core.model.directory, which the reward model checks with too):
  reward.model.path is a model directory whose config.json describes a sequence-classification model with one
  label (its weights and tokenizer are checked when it loads).
- `check_paths(cfg)`: every other local path the config names (model.path, critic.path, data files), the user
  code it imports (reward functions, environment, tools: imported here, as the workers will) and a run.name
  held by a live run; `check_lora_targets(cfg)`: model.lora.target_modules against the model's linear layers.
  The command line calls them before the Prefect API, Ray or MLflow start.

Plain Python: no torch, no transformers (`check_lora_targets` alone imports them, to build the model on the
meta device).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import ConfigError
from rlhf_core.model.directory import check_reward_model_config, model_context_length


def check_output_dir(path: str | os.PathLike, field: str = "run.output_dir") -> Path:
    """Create `path` if needed and prove it writable (a file is written and removed); returns it resolved.

    Raises ConfigError naming the field and the path when it is a file, lies under a file, or cannot be
    written (permissions, a read-only file system, a full disk)."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(
            f"{field}={str(path)!r}: {p} exists and is not a directory; choose another {field} or move the file"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{field}={str(path)!r}: cannot create {p} ({exc.strerror or exc}); choose a {field} you can write to"
        ) from None
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-test-") as handle:
            handle.write(b"ok")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise ConfigError(
            f"{field}={str(path)!r}: {p} cannot be written ({exc.strerror or exc}); checkpoints, the built tiny "
            f"model and the exported policy go there. Fix its permissions or choose another {field}"
        ) from None
    return p.resolve()


def check_lengths(policy_dir: str | os.PathLike, cfg, prompts: Optional[Iterable[Any]] = None) -> Optional[int]:
    """Refuse a run whose prompts plus rollout.max_new_tokens do not fit the model's context.

    `prompts` (Prompt objects, or token-id lists), when given, are the tokenized prompts the run will use
    (already truncated to data.max_prompt_tokens): the longest one counts. Without them
    data.max_prompt_tokens counts. Returns the model's context length (None when config.json names none:
    nothing is checked then)."""
    found = model_context_length(policy_dir)
    if found is None:
        return None
    limit, source = found
    prompt_budget, prompt_source = cfg.data.max_prompt_tokens, f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
    if prompts is not None:
        lengths = [len(getattr(p, "prompt_ids", p)) for p in prompts]
        if lengths:
            longest = min(max(lengths), cfg.data.max_prompt_tokens)
            prompt_budget, prompt_source = longest, f"the longest prompt ({longest} tokens)"
    need = prompt_budget + cfg.rollout.max_new_tokens
    if need > limit:
        room = limit - prompt_budget
        hint = (
            f"lower rollout.max_new_tokens to at most {room}, or data.max_prompt_tokens"
            if room > 0
            else f"lower data.max_prompt_tokens below {limit} (prompts are left-truncated to it)"
        )
        raise ConfigError(
            f"{prompt_source} + rollout.max_new_tokens={cfg.rollout.max_new_tokens} = {need} tokens do not fit "
            f"the model's context of {limit} tokens ({source} in {Path(policy_dir) / 'config.json'}); {hint}"
        )
    return limit


# ------------------------------------------------------------------------------------------- run directory
LOCK_FILE = ".run.lock"
LATEST = "latest"


def default_run_name(flow_run_name: str = "") -> str:
    """<UTC time>-<flow run name>: sorts by start time, and names the Prefect run it belongs to."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    tail = "".join(c if c.isalnum() or c in "-_." else "-" for c in flow_run_name).strip("-.") or f"pid{os.getpid()}"
    return f"{stamp}-{tail}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunDirClaim:
    """A run's own directory, held through its lock file until `release()` (idempotent)."""

    def __init__(self, path: Path, lock: Path):
        self.path = path
        self.lock = lock
        self.latest = False  # output_dir/latest points here (moved by point_latest)

    def point_latest(self) -> None:
        """Point output_dir/latest here (once): call it when the run has produced something (a checkpoint)."""
        if not self.latest:
            point_latest(self.path.parent, self.path.name)
            self.latest = True

    def release(self) -> None:
        try:
            held = json.loads(self.lock.read_text())
        except (OSError, ValueError):
            return
        if held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
            self.lock.unlink(missing_ok=True)


def claim_run_dir(output_dir: str | os.PathLike, name: str, field: str = "run.name") -> RunDirClaim:
    """Create output_dir/name and lock it for this process (output_dir/latest moves once the run has produced
    something: `RunDirClaim.point_latest`).

    A directory locked by a live process (this host) refuses the claim with a ConfigError naming `field`, the
    directory and the process holding it; a lock left by a dead process is taken over. Other hosts' locks are
    respected (their liveness cannot be checked from here): remove the lock file once that run is gone."""
    base = check_output_dir(output_dir)
    run_dir = base / name
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_FILE
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text())
            except (OSError, ValueError):
                held = {}
            pid, host = held.get("pid"), held.get("host")
            if isinstance(pid, int) and host == socket.gethostname() and not _pid_alive(pid):
                lock.unlink(missing_ok=True)  # a dead run's lock: take the directory over
                continue
            raise ConfigError(
                f"{field}={name!r}: {run_dir} is in use by another run (pid {pid} on {host}, started "
                f"{held.get('started', '?')}); two live runs must not write one directory. Leave {field} empty "
                f"(each run gets its own directory) or choose another; remove {lock} if that run is gone"
            ) from None
        with os.fdopen(fd, "w") as handle:
            json.dump(me, handle)
        break
    return RunDirClaim(run_dir, lock)


def point_latest(base: Path, name: str) -> None:
    """base/latest -> name (a relative symlink, replaced atomically); `base/latest.txt` where links are not allowed."""
    tmp = base / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(name, tmp, target_is_directory=True)
        os.replace(tmp, base / LATEST)
    except OSError:
        tmp.unlink(missing_ok=True)
        (base / f"{LATEST}.txt").write_text(name + "\n")


# ----------------------------------------------------------------- every path and name, before anything starts
def check_paths(cfg) -> None:
    """Every local path the config names, and the user code it imports, without starting anything: model.path
    (config.json, tokenizer, weight headers), critic.path, reward.model.path, data.train_path / eval_path,
    reward.functions, env and env.tools (imported, as the workers will), a run.name held by a live run.
    ConfigError, one line naming the field, for the first that fails. Nothing is created."""
    from rlhf_core.model.directory import ModelLoadError, check_model_dir

    if cfg.model.path:
        try:
            check_model_dir(cfg.model.path)
        except ModelLoadError as exc:
            raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from None
    if cfg.critic.path:
        critic = Path(cfg.critic.path).expanduser()
        if not (critic / "config.json").is_file():
            state = "has no config.json" if critic.is_dir() else "does not exist"
            raise ConfigError(f"critic.path={cfg.critic.path!r}: {critic} {state}; give a Hugging Face model directory")
    if cfg.reward.model.path:
        check_reward_model_config(cfg.reward.model.path)
    for field in ("train_path", "eval_path"):
        path = getattr(cfg.data, field)
        if path and cfg.data.task in ("jsonl", "dataset"):
            check_data_path(path, f"data.{field}", cfg.data.task)
    check_user_code(cfg)
    if cfg.run.name:
        holder = live_lock(Path(cfg.run.output_dir).expanduser() / cfg.run.name / LOCK_FILE)
        if holder:
            raise ConfigError(
                f"run.name={cfg.run.name!r}: {Path(cfg.run.output_dir) / cfg.run.name} is in use by a live run (pid "
                f"{holder.get('pid')}, started {holder.get('started', '?')}); leave run.name empty or choose another"
            )


def check_data_path(path: str, field: str, task: str) -> None:
    """data.task 'jsonl': a file. 'dataset': a file, a folder, or a hub id (with HF_HUB_OFFLINE=1, the default of
    the command line, one in the Hugging Face cache)."""
    p = Path(path).expanduser()
    if task == "jsonl":
        if not p.is_file():
            state = "is a directory, not a JSONL file" if p.is_dir() else "does not exist"
            raise ConfigError(f"{field}={path!r}: {p} {state} (data.task 'jsonl' reads one JSONL file)")
        return
    if p.exists():
        return
    from rlhf_core.data.dataset import _looks_local  # (no torch)

    if _looks_local(path) or path.count("/") > 1:
        raise ConfigError(f"{field}={path!r}: {p} does not exist")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") and not _in_hf_cache(path):
        raise ConfigError(
            f"{field}={path!r}: no such local file or folder, and no hub dataset of that id in the Hugging Face cache "
            "(HF_HUB_OFFLINE=1: the hub is not asked); give a local path, or download it first"
        )


def _in_hf_cache(repo_id: str) -> bool:
    """A hub dataset id downloaded into the hub cache (datasets--org--name) or `datasets`' own (org___name)."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE") or home / "hub").expanduser()
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets").expanduser()
    return (hub / ("datasets--" + repo_id.replace("/", "--"))).is_dir() or (
        datasets_cache / repo_id.replace("/", "___")
    ).is_dir()


def check_user_code(cfg) -> None:
    """reward.functions, the env class and env.tools imported here as the workers will import them (the config
    only read their source): a missing dependency or an error at import is named before anything starts."""
    from rlhf_core.usercode import load_env_class, load_function, load_tools

    checks = [
        (f"reward.functions[{i}]", fn.path or fn.name, lambda fn=fn, i=i: load_function(fn.path, fn.name, ""))
        for i, fn in enumerate(cfg.reward.functions)
    ]
    if cfg.env.adapter:
        from rlhf_core.env.adapters import load_factory

        checks.append(("env.path/env.name", cfg.env.factory, lambda: load_factory(cfg.env.factory)))
    elif cfg.env.enabled:
        checks.append(
            ("env", cfg.env.path or cfg.env.class_name, lambda: load_env_class(cfg.env.path, cfg.env.class_name))
        )
    checks += [
        (f"env.tools[{i}]", tool.path, lambda tool=tool: load_tools([(tool.path, tool.name)]))
        for i, tool in enumerate(cfg.env.tools)
    ]
    for where, path, load in checks:
        try:
            load()
        except Exception as exc:  # whatever the user's module raises on import
            text = " ".join(str(exc).split()).removeprefix(": ")
            raise ConfigError(f"{where}: importing {path} failed: {type(exc).__name__}: {text}") from None


def check_lora_targets(cfg) -> None:
    """model.lora.target_modules against the linear layers of the model: read from model.path's (or the tiny
    default's) safetensors headers when they tell, else from the model built on the meta device from its config
    (no weights, no Ray; imports torch and transformers)."""
    if cfg.model.lora is None:
        return
    from rlhf_core.model.directory import TINY_MODEL_TYPES, TINY_POLICY_DIRS, linear_layer_names, target_modules_problem

    kind = cfg.model.tiny.kind
    policy_dir = Path(cfg.model.path or Path(cfg.run.output_dir) / TINY_POLICY_DIRS[kind]).expanduser()
    names = linear_layer_names(policy_dir)
    if names is None:
        from rlhf_core.model.lora import config_linear_module_names

        if cfg.model.path:
            names = config_linear_module_names(policy_dir, trust_remote_code=cfg.model.trust_remote_code)
        else:  # the tiny default, not built yet
            names = config_linear_module_names(model_type=TINY_MODEL_TYPES[kind])
    if names is None:
        return  # an architecture that cannot be built on the meta device: the workers' loading checks it
    problem = target_modules_problem(cfg.model.lora.target_modules, names)  # as the workers' apply_lora checks
    if problem:
        raise ConfigError(problem)


def live_lock(lock: Path) -> Optional[dict]:
    """What a run directory's lock file says, when a live process on this host holds it (else None)."""
    try:
        held = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    pid = held.get("pid") if isinstance(held, dict) else None
    if isinstance(pid, int) and held.get("host") == socket.gethostname() and _pid_alive(pid):
        return held
    return None
