"""LoRA adapters (peft) on the policy: wrap, validate, move adapter tensors, merge for export.

With `model.lora` set, `build.build_policy` wraps every process's policy (trainer, rollout workers,
`atrlhf evaluate` of a checkpoint) with the same peft adapters, so parameter names agree everywhere:

- the trainer optimises the adapters only (peft freezes the base weights);
- the KL reference is the same model with its adapters disabled (`adapters_disabled`), no second copy;
- a weight sync and a checkpoint carry the adapter tensors only, under peft's saved names
  (`adapter_state_dict`: `...q_proj.lora_A.weight`, the PEFT file format vLLM's LoRA loader reads too);
- an HF rollout engine holds the same peft model and copies the adapters in (`load_adapter_state_dict`),
  so its logits are the trainer's exactly; export writes the adapter (PEFT format) and, on request, the
  adapters merged into the base weights as a plain Hugging Face model (`save_merged`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from pathlib import Path

import torch

from rlhf_core.model.directory import target_modules_problem
from rlhf_core.model.sharding import _CACHE, forget_adapter_params, iter_full_tensors, shard_like  # noqa: F401

ADAPTER_DIR = "adapter"  # the PEFT adapter inside an export or a checkpoint directory
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's weights file name in it
DEFAULT_ADAPTER = "default"  # peft's name for a model's one adapter


class LoraConfigError(ValueError):
    """model.lora does not fit the model (target_modules that match no linear layer)."""


def is_lora(model) -> bool:
    """Whether `model` is a peft model with adapters."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def linear_module_names(model) -> list[str]:
    """The distinct last names of the model's linear layers (what target_modules can name); of a peft model, its
    base model's (an adapted layer by its own name, not its `base_layer` and adapter parts)."""
    names = set()
    for name, m in model.named_modules():
        if hasattr(m, "base_layer") and isinstance(m.base_layer, torch.nn.Linear):
            names.add(name.rsplit(".", 1)[-1])
        elif isinstance(m, torch.nn.Linear) and ".lora_" not in name and not name.endswith(".base_layer"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def config_linear_module_names(config_dir=None, model_type: str = "", trust_remote_code: bool = False):
    """`linear_module_names` of the model that `config_dir`'s config.json describes (or a small one of
    `model_type`), built on the meta device: no weights read, no memory taken, no Ray. None when the
    architecture cannot be built that way (the check is then left to the model's loading)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if config_dir is not None:
                config = AutoConfig.from_pretrained(str(config_dir), trust_remote_code=trust_remote_code)
            else:
                config = AutoConfig.for_model(model_type, num_hidden_layers=1, tie_word_embeddings=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # an architecture transformers cannot build from its config alone (or on meta)
        return None
    finally:
        hf_logging.set_verbosity(verbosity)
    return linear_module_names(model)


def apply_lora(model, lora_cfg, adapter_name: str = DEFAULT_ADAPTER, dropout: float = 0.0):
    """Wrap `model` with LoRA adapters of `lora_cfg` (rlhf_core.config.LoraConfig); base weights frozen. A peft
    model already (`is_lora`): `lora_cfg`'s adapters are added beside the others as `adapter_name` (a shared
    fleet's one base model with every sweep point's adapter; the active adapter stays as it was).

    Adapters start at B = 0, so the wrapped model computes exactly what the base model does. The random
    state of each process (set from trainer.seed) decides A's initialisation; every process's A is replaced by
    the trainer's at the first sync. `dropout`: peft's lora_dropout, 0 for every run (the trainer computes
    log-probs without dropout); a test gives one to a model as a peft model built elsewhere may have it.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise LoraConfigError(
            "model.lora is set but peft is not installed: pip install 'asynctensorrlhf[lora]' (or unset model.lora)"
        ) from None

    problem = target_modules_problem(lora_cfg.target_modules, linear_module_names(model))
    if problem:
        raise LoraConfigError(problem)
    targets = list(lora_cfg.target_modules)
    peft_cfg = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    was_training = model.training
    with warnings.catch_warnings():
        # a tied lm_head with an adapter is intended: the adapter sits on the output layer only, and
        # save_merged unties before merging; and peft's own call of a transformers name deprecated in v5
        warnings.filterwarnings("ignore", message=".*tied layer is part of the adapter.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated.*")
        if is_lora(model):
            model.add_adapter(adapter_name, peft_cfg)
            model.train(was_training)
            return model
        wrapped = get_peft_model(model, peft_cfg, adapter_name=adapter_name)
    wrapped.train(was_training)
    return wrapped


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model (adapters off) for the duration: the KL reference without a second copy."""
    with model.disable_adapter():
        yield model


def adapter_state_dict(model, keep: bool = True) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the adapter tensors under peft's saved names (no adapter name).

    A model sharded by FSDP2 (a trainer group) holds DTensor shards: the adapters are gathered whole, many
    per all-gather (`iter_full_tensors`), so every rank must call this (a collective); ranks with keep=False
    get {}."""

    out = {}
    params = [(name, p.detach()) for name, p in _adapter_params(model).items()]
    group = None
    if params and hasattr(params[0][1], "device_mesh"):  # sharded: gather in buckets over the mesh's group
        group = params[0][1].device_mesh.get_group()
    with torch.no_grad():
        for name, whole in iter_full_tensors(params, group):
            if keep:
                out[name] = whole.to("cpu", copy=True).contiguous()
    return out


def adapter_shapes(model) -> dict[str, list[int]]:
    return {k: list(p.shape) for k, p in _adapter_params(model).items()}


def load_adapter_state_dict(model, state_dict: dict[str, torch.Tensor], adapter: str | None = None) -> None:
    """Copy adapter tensors (peft's saved names) into the model's adapters in place (`adapter`: that one of a
    model with several; default the active one); unknown or missing names raise KeyError before anything is
    copied."""
    params = _adapter_params(model, adapter)
    unknown = [k for k in state_dict if k not in params]
    missing = [k for k in params if k not in state_dict]
    if unknown or missing:
        raise KeyError(
            f"adapter tensors do not fit the model's adapters: unknown {unknown[:3]}, missing {missing[:3]} "
            "(is model.lora the same as the run's that wrote them?)"
        )

    with torch.no_grad():
        for name, tensor in state_dict.items():
            # a sharded (FSDP2) model: this rank's shard of the whole tensor, cut locally
            params[name].copy_(shard_like(tensor, params[name]), non_blocking=True)


def _adapter_params(model, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """peft's saved name (as in get_peft_model_state_dict and adapter_model.safetensors) -> the live
    parameter of `adapter` (default: the active adapter; a model may hold several); cached on the model per
    adapter (names never change), so a sync does not walk the whole state dict."""
    adapter = adapter or model.active_adapter
    per_adapter = model.__dict__.setdefault(_CACHE, {})
    cached = per_adapter.get(adapter)
    if cached is None:
        cached = {}
        for name, p in model.named_parameters():
            if "lora_" in name and f".{adapter}." in name:
                cached[name.replace(f".{adapter}.", ".")] = p
        per_adapter[adapter] = cached
    return cached


def peft_config_dict(model) -> dict:
    """The active adapter's peft config as JSON-safe dict (adapter_config.json's content)."""
    cfg = model.peft_config[model.active_adapter].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


def portable_base_path(base: str, adapter_dir: str | Path) -> str:
    """What adapter_config.json names as the base model, so that `AutoPeftModelForCausalLM.from_pretrained(
    <adapter dir>)` finds it from any working directory (peft hands the name to `from_pretrained` as it is, a
    relative path read from the working directory): a model from the Hugging Face cache by its hub id (as peft
    writes for a hub model: `.../models--Qwen--Qwen2.5-0.5B/snapshots/<rev>` -> `Qwen/Qwen2.5-0.5B`), another
    local directory by its absolute path (a relative one resolved from the working directory), anything else (a
    hub id) as it is. `adapter_dir` is where the adapter is written (kept for callers; the name does not
    depend on it)."""
    path = Path(base).expanduser()
    if not base:
        return base
    if not path.is_absolute():
        return str(path.resolve()) if path.is_dir() else base  # a local directory, else a hub id
    parts = path.parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--") :].replace("--", "/")
    return str(path.resolve())


def _make_base_path_portable(adapter_dir: Path) -> None:
    """peft writes the base model's name_or_path, for a local model its absolute path: rewrite it portably."""
    config_file = adapter_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    base = config.get("base_model_name_or_path")
    if isinstance(base, str):
        config["base_model_name_or_path"] = portable_base_path(base, adapter_dir)
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def save_adapter(model, directory: str | Path) -> Path:
    """The adapter in PEFT format (adapter_config.json + adapter_model.safetensors) in `directory`; the base
    model is named portably (`portable_base_path`)."""
    out = Path(directory)
    # the base (embeddings included, even when a tied lm_head is adapted) is frozen: adapters only
    model.save_pretrained(str(out), save_embedding_layers=False)
    _make_base_path_portable(out)
    return out


def save_adapter_weights(model, weights: dict[str, torch.Tensor], directory: str | Path) -> Path:
    """The PEFT adapter of `save_adapter` written from whole adapter tensors (`adapter_state_dict` of a model
    sharded across ranks, gathered by every rank and written by one) and `model`'s peft config."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.peft_config[model.active_adapter].save_pretrained(str(out))
    _make_base_path_portable(out)
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def save_merged(model, directory: str | Path) -> Path:
    """The adapters merged into a copy of the base weights (W = W0 + alpha/r · B·A), saved as a plain
    Hugging Face model that transformers and `atrlhf evaluate` load without peft. The live model is untouched."""
    out = Path(directory)
    work = copy.deepcopy(model)
    base = work.get_base_model()
    head = base.get_output_embeddings()
    head = getattr(head, "base_layer", head)  # the adapted lm_head's frozen Linear
    embeddings = base.get_input_embeddings()
    if head is not None and embeddings is not None and head.weight is embeddings.weight:
        # A tied lm_head that has an adapter: merging would move the input embeddings too. Untie first, so
        # the merged model's embeddings stay the base's and only its output layer takes B·A.
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        base.config.tie_word_embeddings = False
    merged = work.merge_and_unload()
    merged.save_pretrained(str(out))
    return out
