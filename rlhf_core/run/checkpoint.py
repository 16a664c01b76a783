"""Checkpoints: one layout for every kind of run, written and read by this module only.

    <dir>/policy.safetensors   policy weights (safetensors; shared/tied tensors handled); or, for a LoRA
                               run, <dir>/adapter/ instead: the adapters in PEFT format (adapter_config.json,
                               adapter_model.safetensors), and meta.json and the state say `lora`
    <dir>/state.pt             CheckpointState: trainer (optimizer, scheduler, version, step; for
                               algorithm.advantage 'gae' the critic's weights, optimizer and counters under
                               trainer["critic"], `Critic.state_dict`), data position
                               (prompt source and queued prompts), RNG states (trainer process and each
                               rollout engine), run facts (held-out accuracy at the start, MLflow run id)
                               (torch.save, read back with weights_only=True)
    <dir>/meta.json            layout version, step, version, parameter names and shapes (checked on load)
    <dir>/train_config.yaml    the full TrainConfig of the run that wrote it

The single-process loop and the Ray runtime write the same layout, so either resumes from the other's
checkpoint; so does a sharded trainer group (FSDP2, `trainer.sharding`): it writes whole tensors gathered
from its ranks (`Trainer.full_weights`, an optimizer state of whole tensors, and the critic's weights and
optimizer state alike), and loads a checkpoint by keeping each rank's shard (`load_weights_into`, in
rlhf_core/model/weights.py, for the critic too), so a run saved with N trainer ranks resumes with any other N.

A checkpoint is written to a temporary sibling directory and renamed into place, so a crash mid-write never
leaves a half checkpoint under the final name. Loading validates every file and the parameter names and
shapes against the model, and those of the critic's weights against the configured critic (`critic=`), BEFORE
anything is overwritten; a checkpoint of an older layout fails with a message that says so.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import yaml

from rlhf_core.config import RUN_CONFIG_FILE as CONFIG_FILE
from rlhf_core.model.lora import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    adapter_shapes,
    is_lora,
    peft_config_dict,
    save_adapter,
    save_adapter_weights,
    save_merged,
)
from rlhf_core.model.policy import TINY_POLICY_DIRS
from rlhf_core.model.weights import CheckpointError, is_tied, load_weights_into
from rlhf_core.run.checkpoint_paths import CHECKPOINTS_DIR, META_FILE

FORMAT_VERSION = 2


def checkpoint_dir(run_dir: str | Path, step: int, under: Optional[str | Path] = None) -> Path:
    """Where the checkpoint of trainer step `step` of the run in `run_dir` goes: <run_dir>/checkpoints/step_NNNNNN
    (`under`: another directory to hold the step directories instead of <run_dir>/checkpoints)."""
    return Path(under if under is not None else Path(run_dir) / CHECKPOINTS_DIR) / f"step_{int(step):06d}"


@dataclass(frozen=True)
class PathContents:
    """What a directory holds, in the layouts this project writes (`inspect_path`).

    kind: "model"       a Hugging Face model directory (an exported policy, merged for LoRA, or any model)
          "checkpoint"  a checkpoint of this layout (meta.json): weights or adapters only, no architecture
          "adapter"     an exported LoRA policy without a merged model (the PEFT adapter in adapter/ only)
          "missing"     nothing there
          "unknown"     something else
    run_config: the train_config.yaml of the run that wrote it, when there is one.
    """

    path: Path
    kind: str
    run_config: Optional[Path] = None

    def policy_beside(self, kind: str = "word") -> Optional[Path]:
        """For a checkpoint under <run_dir>/checkpoints/: the tiny policy (`kind`: word or chat, the kind of
        model.preset, cfg.model.tiny.kind) built in <run_dir>, which holds the architecture a tiny run's checkpoint
        lacks; None when it is not there."""
        if self.kind != "checkpoint":
            return None
        beside = self.path.parent.parent / TINY_POLICY_DIRS[kind]
        return beside if (beside / "config.json").is_file() else None


def inspect_path(path: str | Path) -> PathContents:
    """What `path` holds (a checkpoint, an exported policy or another Hugging Face model, an adapter only, ...)."""
    p = Path(path).expanduser()
    config = p / CONFIG_FILE
    run_config = config if config.is_file() else None
    if not p.exists():
        return PathContents(p, "missing")
    if not p.is_dir():
        return PathContents(p, "unknown")
    if (p / "config.json").is_file():
        kind = "model"
    elif (p / META_FILE).is_file():
        kind = "checkpoint"
    elif (p / ADAPTER_DIR / "adapter_config.json").is_file():
        kind = "adapter"
    else:
        kind = "unknown"
    return PathContents(p, kind, run_config)


@dataclass
class CheckpointState:
    """Everything but the weights. Every value is a tensor or a plain Python type (weights_only-safe)."""

    trainer: dict  # Trainer.state_dict(): optimizer, scheduler, version, step
    data: dict  # PromptQueue.state_dict(): source position, queued prompt uids
    rng: dict  # {"trainer": capture_rng(), "rollout": [engine generator states]}
    run: dict = field(default_factory=dict)  # eval_start, mlflow_run_id, ...: facts of the run so far
    config: Optional[dict] = None  # the TrainConfig (model_dump(mode="json")) that wrote it
    lora: Optional[dict] = None  # a LoRA checkpoint: {r, alpha, dropout, target_modules}; None: full weights

    @property
    def step(self) -> int:
        return int(self.trainer.get("step", 0))

    @property
    def version(self) -> int:
        return int(self.trainer.get("version", 0))

    def resumed_bound(self, cfg) -> Optional[int]:
        """The staleness bound a run resumed from here starts with: the autopilot's bound at this checkpoint where
        the autopilot is on (it moved the bound); None where the configured runtime.max_staleness is the bound."""
        bound = self.run.get("max_staleness")
        return int(bound) if cfg.runtime.autopilot.enabled and bound is not None else None


def capture_rng(extra_generators: Optional[dict[str, torch.Generator]] = None) -> dict:
    """RNG states of python, numpy, torch (CPU and CUDA) and named generators, as weights_only-safe types."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in (extra_generators or {}).items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, extra_generators: Optional[dict[str, torch.Generator]] = None) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in (extra_generators or {}).items():
        if k in state.get("generators", {}):
            g.set_state(state["generators"][k])


def _param_shapes(model) -> dict[str, list[int]]:
    """Names and shapes of what a checkpoint of `model` holds: every tensor, or with LoRA the adapters only."""
    if is_lora(model):
        return adapter_shapes(model)
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def _shape_mismatch(saved: dict, expected: dict[str, list[int]], may_lack=None) -> Optional[str]:
    """What differs between the tensor names and shapes a checkpoint holds (`saved`) and those a model expects
    (`expected`, `_param_shapes`: of a sharded model the whole tensors' shapes, a DTensor's shape being the
    whole one), up to three of each kind; None when they agree. may_lack(name): whether the checkpoint may
    leave out that expected name (a tied tensor stored once)."""
    found = {
        "missing": [k for k in expected if k not in saved and not (may_lack and may_lack(k))],
        "unexpected": [k for k in saved if k not in expected],
        "different shapes (checkpoint vs model)": [
            f"{k}: {saved[k]} vs {expected[k]}" for k in expected if k in saved and saved[k] != expected[k]
        ],
    }
    return ", ".join(f"{kind} {names[:3]}" for kind, names in found.items() if names) or None


def _check_critic(p: Path, state: CheckpointState, critic) -> None:
    """The critic's part of the trainer state (`Critic.state_dict`: weights, optimizer, counters) against the
    live `critic`'s value model: the same names and whole shapes, or CheckpointError naming the first
    mismatches. A checkpoint without a critic (of a group-advantage run) fails here too."""
    saved = state.trainer.get("critic") if isinstance(state.trainer, dict) else None
    if saved is None:
        raise CheckpointError(
            f"checkpoint {p} holds no critic, but algorithm.advantage is 'gae': resume it with the advantage "
            "it was trained with (its train_config.yaml)"
        )
    weights = saved.get("weights") if isinstance(saved, dict) else None
    if not isinstance(weights, dict) or not all(torch.is_tensor(v) for v in weights.values()):
        raise CheckpointError(f"{p / 'state.pt'}: the critic's state has no weights (trainer['critic']['weights'])")
    mismatch = _shape_mismatch({k: list(v.shape) for k, v in weights.items()}, _param_shapes(critic.model))
    if mismatch:
        raise CheckpointError(
            f"checkpoint {p}: its critic (state.pt, trainer['critic']['weights']) does not match the configured "
            f"critic (critic.path, or the policy's architecture when empty): {mismatch}"
        )


def lora_facts(model) -> Optional[dict]:
    """{r, alpha, dropout, target_modules} of a LoRA model's adapters (plain types), None for a full model."""
    if not is_lora(model):
        return None
    c = peft_config_dict(model)
    return {
        "r": int(c["r"]),
        "alpha": float(c["lora_alpha"]),
        "dropout": float(c["lora_dropout"]),
        "target_modules": sorted(c["target_modules"]),
    }


def save_checkpoint(
    path: str | Path, model, state: CheckpointState, weights: Optional[dict[str, torch.Tensor]] = None
) -> Path:
    """Write the weights and `state` atomically to directory `path` (replacing what is there).

    weights: the model's whole tensors when the model itself holds shards (`Trainer.full_weights()` of a
    sharded trainer, gathered by every rank and written by one: with LoRA, the adapter tensors); None: taken
    from `model`."""
    from safetensors.torch import save_file, save_model

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state.lora = lora_facts(model)
    if state.lora is not None and weights is not None:
        save_adapter_weights(model, weights, tmp / ADAPTER_DIR)
    elif state.lora is not None:
        save_adapter(model, tmp / ADAPTER_DIR)
    elif weights is not None:
        save_file(weights, str(tmp / "policy.safetensors"))
    else:
        save_model(model, str(tmp / "policy.safetensors"))
    body = asdict(state)
    config = body.pop("config")
    torch.save(body, tmp / "state.pt")
    meta = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "version": state.version,
        "params": _param_shapes(model),
        "lora": state.lora,
    }
    (tmp / META_FILE).write_text(json.dumps(meta))
    if config is not None:
        write_run_config(tmp, config)
    if final.exists():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


def prune_checkpoints(checkpoints_dir: str | Path, keep: int, newest_step: Optional[int] = None) -> list[Path]:
    """Delete a run's older checkpoints: of the checkpoints in `checkpoints_dir` (named as `checkpoint_dir`
    names them, holding what `inspect_path` takes for a checkpoint) up to `newest_step` (all when None), keep
    the `keep` newest and remove the rest; newer ones and anything else (a `.tmp` being written) are left
    alone. keep=0 keeps everything. Returns the removed directories.

    A checkpoint directory is complete once it has its name (save_checkpoint renames it into place last), so
    the newest one kept is always a checkpoint to resume from."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    root = Path(checkpoints_dir)
    if keep == 0 or not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        digits = entry.name.rpartition("_")[2]
        if not digits.isdigit() or checkpoint_dir(root.parent, int(digits), under=root) != entry:
            continue
        if inspect_path(entry).kind == "checkpoint" and (newest_step is None or int(digits) <= newest_step):
            steps.append((int(digits), entry))
    removed = [entry for _, entry in sorted(steps)[:-keep]]
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
    return removed


def read_checkpoint(path: str | Path, model=None, critic=None) -> tuple[CheckpointState, Optional[dict]]:
    """Validate and read a checkpoint without touching any live object.

    Returns (state, weights): the CheckpointState, and the weights as a state dict when `model` is given
    (their names and shapes checked against the model). critic: the live `Critic` of an algorithm.advantage
    'gae' run (`Trainer.critic`), whose value model the checkpoint's critic weights are checked against (None:
    not checked). Raises CheckpointError naming the file and the problem.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} does not exist or is not a directory")
    for name in ("state.pt", META_FILE):
        if not (p / name).is_file():
            raise CheckpointError(f"checkpoint {p} is missing {name}")
    try:
        meta = json.loads((p / META_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{p / META_FILE} is corrupt: {exc}") from exc
    saved_lora = meta.get("lora") if isinstance(meta, dict) else None
    weights_file = p / ADAPTER_DIR / ADAPTER_WEIGHTS if saved_lora else p / "policy.safetensors"
    if not weights_file.is_file():
        raise CheckpointError(f"checkpoint {p} is missing {weights_file.relative_to(p)}")
    layout = meta.get("format_version")
    if isinstance(layout, int) and layout < FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {p} has layout version {layout}, written by an older AsyncTensorRLHF; this "
            f"version reads layout {FORMAT_VERSION}. Resume it with the version that wrote it, or "
            "start a new run from its weights (policy.safetensors)"
        )
    if layout != FORMAT_VERSION:
        raise CheckpointError(f"{p / META_FILE}: format_version {layout!r}, expected {FORMAT_VERSION}")
    try:
        body = torch.load(p / "state.pt", map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{p / 'state.pt'} is corrupt or not a checkpoint state: {exc}") from exc
    missing = [k for k in ("trainer", "data", "rng") if not isinstance(body, dict) or k not in body]
    if missing:
        raise CheckpointError(f"{p / 'state.pt'} lacks {missing}: not a checkpoint state of layout {FORMAT_VERSION}")
    config = None
    if (p / CONFIG_FILE).is_file():
        try:
            config = yaml.safe_load((p / CONFIG_FILE).read_text())
        except yaml.YAMLError as exc:
            raise CheckpointError(f"{p / CONFIG_FILE} is corrupt: {exc}") from exc
    state = CheckpointState(
        trainer=body["trainer"],
        data=body["data"],
        rng=body["rng"],
        run=body.get("run") or {},
        config=config,
        lora=body.get("lora"),
    )
    weights = None
    if model is not None:
        live_lora = lora_facts(model)
        if bool(saved_lora) != bool(live_lora):
            raise CheckpointError(
                f"checkpoint {p} holds LoRA adapters {saved_lora} but the model has none: set model.lora as the "
                "run that wrote it did (its train_config.yaml)"
                if saved_lora
                else f"checkpoint {p} holds full weights but the model has LoRA adapters {live_lora}: unset "
                "model.lora to resume it"
            )
        expected = _param_shapes(model)
        mismatch = _shape_mismatch(meta.get("params") or {}, expected)
        if mismatch:
            raise CheckpointError(f"checkpoint {p} does not match the model: {mismatch}")
        try:
            weights = load_file(str(weights_file), device="cpu")
        except (SafetensorError, OSError, Exception) as exc:
            raise CheckpointError(f"{weights_file} is corrupt: {exc}") from exc
        # meta.json can agree with the model while the weights file does not (swapped or edited file):
        # check the tensors themselves, so that nothing is half-copied later.
        mismatch = _shape_mismatch(
            {k: list(v.shape) for k, v in weights.items()},
            expected,
            may_lack=None if live_lora else lambda k: is_tied(model, k, weights),
        )
        if mismatch:
            raise CheckpointError(f"{weights_file} does not match the model: {mismatch}")
    if critic is not None:
        _check_critic(p, state, critic)
    return state, weights


def write_run_config(directory: str | Path, config: dict) -> Path:
    """The run's config (TrainConfig.model_dump(mode="json")) as train_config.yaml in `directory`: every
    checkpoint and every exported policy carries the config that produced it."""
    path = Path(directory) / CONFIG_FILE
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def export_policy(model, tokenizer, config: dict, path: str | Path, merged: bool = True) -> Path:
    """The trained policy for use outside training, in directory `path`, with its tokenizer and the run's
    config. A full model: a Hugging Face model directory. A LoRA model: the adapter in PEFT format under
    `path/adapter/`, and with `merged` the adapters merged into the base weights as a plain Hugging Face
    model at `path` itself (what transformers, `atrlhf evaluate` and the MLflow logged model load)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        save_adapter(model, out / ADAPTER_DIR)
        if merged:
            save_merged(model, out)
    else:
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_run_config(out, config)
    return out


def load_checkpoint(path: str | Path, model, critic=None) -> CheckpointState:
    """Validate the whole checkpoint (with the critic's weights against `critic`, the live `Critic` of a 'gae'
    run), then copy its weights into `model`; returns the rest for the caller (`Trainer.load_state_dict` loads
    the critic from it)."""
    state, weights = read_checkpoint(path, model, critic=critic)
    load_weights_into(model, weights)
    return state
