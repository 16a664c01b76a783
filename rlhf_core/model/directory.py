"""A local Hugging Face model directory, checked before anything loads it: config.json, tokenizer files and the
safetensors headers (a few KB each, never the weights), its context length (`model_context_length`), and a reward
model's directory (`check_reward_model_config`: a sequence-classification model with one label). Plain Python: no
torch, no transformers, so the command line checks `model.path` and `reward.model.path` before anything starts
(rlhf_core.run.preflight); `rlhf_core.model.policy` and `rlhf_core.reward.model` load what passes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config.base import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
TINY_POLICY_DIRS = {"word": "tiny_policy", "chat": "tiny_chat_policy"}  # under run.output_dir, by model.preset's kind
TINY_MODEL_TYPES = {"word": "llama", "chat": "qwen2"}  # their architectures (rlhf_core.model.policy builds them)
# config.json keys that hold a model's context length, by architecture family (the first present wins)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_SCALING_TYPES = ("linear", "dynamic", "yarn", "longrope")


class ModelLoadError(ValueError):
    """A model directory is missing, incomplete or unreadable."""


def check_model_dir(path: str | Path) -> Path:
    """Fail with a message naming the path and what is missing, before transformers gives a vaguer one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {p} does not exist")
    if not p.is_dir():
        raise ModelLoadError(f"model path {p} is not a directory")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"model directory {p} has no config.json")
    try:
        model_config = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg} is not valid JSON: {exc}") from exc
    if not isinstance(model_config, dict) or not model_config.get("model_type"):
        raise ModelLoadError(
            f"{cfg} is not a Hugging Face model config (it has no 'model_type'); model.path must be a directory "
            "written by save_pretrained (or downloaded from the Hub) with the model's own config.json"
        )
    if not any(
        (p / name).is_file()
        for name in (
            "model.safetensors",
            "pytorch_model.bin",
            "model.safetensors.index.json",
            "pytorch_model.bin.index.json",
        )
    ):
        raise ModelLoadError(
            f"model directory {p} has no weights (model.safetensors, pytorch_model.bin or a sharded index)"
        )
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model directory {p} has no tokenizer files (expected one of {list(TOKENIZER_FILES)})")
    weight_headers(p)
    return p


def weight_headers(p: Path) -> Optional[dict[str, dict]]:
    """{tensor name: {dtype, shape, data_offsets}} from the safetensors headers (a few KB, not the weights), every
    shard's; None for pytorch_model.bin weights. A garbage, truncated or missing weight file is named here
    (ModelLoadError), where transformers would say only 'Error while deserializing header'."""
    index = p / "model.safetensors.index.json"
    if (p / "model.safetensors").is_file():
        shards = [p / "model.safetensors"]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no 'weight_map'; re-download or re-export the model")
        shards = [p / name for name in sorted(set(map(str, weight_map.values())))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} lists weight files that are not in {p}: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; the download is incomplete"
            )
    else:
        return None  # pytorch_model.bin (and its index): torch.load's own error is wrapped by load_policy
    tensors: dict[str, dict] = {}
    for shard in shards:
        size = shard.stat().st_size
        problem = None
        with shard.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or n > min(size - 8, 100 * 2**20):
                problem = "its header is unreadable"
            else:
                try:
                    header = json.loads(fh.read(n))
                    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
                except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError, ValueError):
                    problem = "its header is not valid safetensors JSON"
                else:
                    if 8 + n + end > size:
                        problem = f"it is truncated ({size} bytes, its header describes {8 + n + end})"
                    tensors.update((k, t) for k, t in header.items() if k != "__metadata__")
        if problem:
            raise ModelLoadError(
                f"could not load the model from {p}: {shard} is not a usable safetensors weight file: {problem}. "
                "Re-download or re-export the model "
                "(save_pretrained) into the model directory"
            )
    return tensors


def linear_layer_names(p: Path) -> Optional[list[str]]:
    """The distinct last names of the linear layers of a causal LM saved with safetensors, read from its headers
    (2-D weights that are no embedding; `lm_head` too when config.json ties it to the embedding, so that the file
    holds no copy): the names model.lora.target_modules can give, without torch. None when this cannot be read
    from the files (pytorch_model.bin weights, a quantized model): build the model to know."""
    try:
        config = json.loads((p / "config.json").read_text())
        tensors = weight_headers(p)
    except (OSError, ValueError, ModelLoadError):
        return None
    if not isinstance(config, dict) or config.get("quantization_config") or not tensors:
        return None
    names = {
        key[: -len(".weight")].rsplit(".", 1)[-1]
        for key, t in tensors.items()
        if key.endswith(".weight") and isinstance(t, dict) and len(t.get("shape") or []) == 2
    }
    names = {n for n in names if "embed" not in n and n not in ("wte", "wpe")}
    if config.get("tie_word_embeddings", True):
        names.add("lm_head")
    return sorted(names)


def target_modules_problem(targets, linear: list[str]) -> Optional[str]:
    """What is wrong with model.lora.target_modules for a model whose linear layers are `linear` (None: nothing)."""
    unknown = [t for t in targets if t not in linear]
    if not unknown:
        return None
    return (
        f"model.lora.target_modules: {unknown} match no linear layer of the model; its linear modules are {linear} "
        "(name some of these)"
    )


def model_context_length(policy_dir: str | os.PathLike) -> Optional[tuple[int, str]]:
    """(context length, how it was read) from a model directory's config.json, or None when it names none."""
    cfg_file = Path(policy_dir) / "config.json"
    try:
        config: Any = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # check_model_dir reports a missing or broken config.json with its own message
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config") or {}):  # multimodal models nest the language model's
        if not isinstance(section, dict):
            continue
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                scaling = section.get("rope_scaling") or {}
                kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
                factor = scaling.get("factor") if isinstance(scaling, dict) else None
                if kind in _SCALING_TYPES and isinstance(factor, (int, float)) and factor > 1:
                    base = scaling.get("original_max_position_embeddings") or value
                    scaled = int(base * factor)
                    if scaled > value:
                        return scaled, f"{key}={value} with rope_scaling {kind} x{factor:g}"
                return value, f"{key}={value}"
    return None


def check_reward_model_config(path: str | os.PathLike, field: str = "reward.model.path") -> Path:
    """reward.model.path is a directory whose config.json names a *ForSequenceClassification architecture
    with one label (num_labels=1: one score per sequence); ConfigError naming the field otherwise."""
    p = Path(path).expanduser()
    where = f"{field}={str(path)!r}"
    if not p.is_dir():
        raise ConfigError(
            f"{where}: {p} {'is not a directory' if p.exists() else 'does not exist'}; it must be a local "
            "directory saved from AutoModelForSequenceClassification (save_pretrained)"
        )
    cfg_file = p / "config.json"
    try:
        config: Any = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: the reward model directory {p} has no config.json") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {cfg_file} is not valid JSON: {exc}") from None
    archs = (config.get("architectures") if isinstance(config, dict) else None) or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(
            f"{where}: {cfg_file} names architectures {archs}, not a sequence-classification model; a reward "
            "model must be saved from AutoModelForSequenceClassification (e.g. LlamaForSequenceClassification) "
            "with num_labels=1"
        )
    labels = config.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else config.get("num_labels", 2)
    if num_labels != 1:
        raise ConfigError(
            f"{where}: the model has {num_labels} labels (id2label in {cfg_file}); a reward model gives one score "
            "per sequence: num_labels must be 1"
        )
    return p
