"""Load a policy from a local Hugging Face directory, or build the tiny default policy.

The tiny policy is a real `LlamaForCausalLM` with a `PreTrainedTokenizerFast` built by `tokenizers`,
saved with `save_pretrained` and loaded back through `load_policy`: the same path a real model takes.
Nothing is fetched from any hub.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.model.directory import TINY_POLICY_DIRS, ModelLoadError, check_model_dir

TINY_SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_WORDS = [str(d) for d in range(10)] + ["max", "sum", "+", "=", ","]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# transformers resolves its classes lazily on first access, and that first access is not thread-safe: a sweep's
# points build and load models in threads of one process, and one of them was seen to fail with "cannot import
# name 'LlamaConfig' from 'transformers'". Every first access from this module goes through this lock.
_TRANSFORMERS_IMPORT = threading.Lock()


def _transformers(*names: str):
    """The named attributes of `transformers`, resolved under `_TRANSFORMERS_IMPORT`."""
    with _TRANSFORMERS_IMPORT:
        import transformers

        found = tuple(getattr(transformers, name) for name in names)
    return found if len(found) > 1 else found[0]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' picks CUDA when available, else CPU; anything else is passed to torch.device."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device is {str(device)!r} but CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None) -> Optional[torch.dtype]:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or 'auto'") from None


def load_policy(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
):
    """Load `(model, tokenizer)` from a local directory through AutoModelForCausalLM / AutoTokenizer.

    The tokenizer pads on the left (generation) and gets a pad token (its EOS) when it has none.
    """
    AutoModelForCausalLM = _transformers("AutoModelForCausalLM")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    p = check_model_dir(path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    tokenizer = load_tokenizer(p, trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(p), dtype=torch_dtype or "auto", trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as exc:
        raise ModelLoadError(f"could not load the model from {p}: {exc}") from exc
    model.to(dev)
    model.eval()
    return model, tokenizer


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a local model directory, padding on the left (generation), with a pad token (its
    EOS when it has none). Raises ModelLoadError naming the path when it cannot be loaded or has no EOS."""
    AutoTokenizer = _transformers("AutoTokenizer")

    p = Path(path).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as exc:  # transformers raises many types; name the path and the cause
        raise ModelLoadError(f"could not load the tokenizer from {p}: {exc}") from exc
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"the tokenizer in {p} has no EOS token; generation could never stop")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def stop_token_ids(policy_dir: str | Path, tokenizer, extra: Sequence[int] = ()) -> list[int]:
    """The ids at which a response ends: every id of `generation_config.json`'s eos_token_id (an int or a
    list), the tokenizer's EOS, and `extra` (rollout.stop_token_ids). Sorted, without duplicates.

    Chat models list several: Qwen2.5-Instruct ends a turn with <|im_end|> and a document with
    <|endoftext|>. Generation, reward trimming and evaluation all stop at the same set."""
    ids = {int(tokenizer.eos_token_id), *(int(i) for i in extra)}
    generation = Path(policy_dir) / "generation_config.json"
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{generation} is not valid JSON: {exc}") from exc
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
    vocab = len(tokenizer)
    bad = sorted(i for i in ids if not 0 <= i < vocab)
    if bad:
        raise ModelLoadError(
            f"stop token id(s) {bad} are outside the vocabulary of {policy_dir} ({vocab} tokens); "
            "check rollout.stop_token_ids and generation_config.json"
        )
    return sorted(ids)


def build_tiny_tokenizer():
    """A word-level tokenizer for the synthetic tasks: special tokens, digits and a few operator words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    PreTrainedTokenizerFast = _transformers("PreTrainedTokenizerFast")

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + TINY_WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    core.decoder = decoders.Sequence([])
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )
    return tok


def build_tiny_policy(
    task: str, out_dir: str | Path, layers: int = 2, hidden: int = 128, heads: int = 4, seed: int = 0
) -> Path:
    """Build a small Llama policy and its tokenizer for a synthetic task and `save_pretrained` both.

    Returns `out_dir`. The task name is recorded in the config (`task_name`); the vocabulary covers
    every synthetic task, so one tiny model serves all of them.
    """
    LlamaConfig, LlamaForCausalLM = _transformers("LlamaConfig", "LlamaForCausalLM")
    from transformers.utils import logging as hf_logging

    from rlhf_core.model.chat import seeded_tiny_model

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    if hidden % heads:
        raise ValueError(f"model.preset: hidden ({hidden}) must be divisible by heads ({heads})")
    model = seeded_tiny_model(
        LlamaConfig,
        LlamaForCausalLM,
        seed,
        len(tokenizer),
        hidden,
        layers,
        heads,
        num_key_value_heads=heads,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        task_name=task,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _build_once(target: Path, build) -> None:
    """Build a model directory at `target` unless it exists: into a private temporary directory, then renamed
    into place, so that two runs starting at once in one run.output_dir never see (or write) a half-built one."""
    if (target / "config.json").is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not lost to a concurrent builder: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_DROPOUT = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


@contextmanager
def eval_mode(model: torch.nn.Module):
    """The model in eval mode for the block, then back in the mode it was in (train or eval)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout off for good, in train mode too (as TRL's disable_dropout): every dropout module's p is set to 0,
    and so is the attention dropout that Hugging Face attention modules keep as a float (`attention_dropout`).

    The trainer computes its log-probs in train mode and the rollout engines theirs in eval mode: with dropout
    the on-policy ratio would differ from 1 and a loss's token mask (M2PO) would come from another dropout
    sample than its gradient. Returns the model."""
    for module in model.modules():
        if isinstance(module, _DROPOUT):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


def dropout_max(model: torch.nn.Module) -> float:
    """The largest dropout probability left in the model (its dropout modules' p and attention_dropout floats)."""
    found = [0.0]
    for module in model.modules():
        if isinstance(module, _DROPOUT):
            found.append(float(module.p))
        if isinstance(getattr(module, "attention_dropout", None), float):
            found.append(float(module.attention_dropout))
    return max(found)


def ensure_policy(model_cfg, task: str, output_dir: str | Path, seed: int = 0) -> Path:
    """The policy directory a run uses: `model.path`, or the tiny default built once under output_dir.

    A tiny policy already under output_dir must have the shape the config's model.preset names: a different one
    is refused, never silently used."""
    if model_cfg.path:
        return check_model_dir(model_cfg.path)
    tiny_shape = model_cfg.tiny
    shape = {
        "num_hidden_layers": tiny_shape.layers,
        "hidden_size": tiny_shape.hidden,
        "num_attention_heads": tiny_shape.heads,
    }
    size = {"layers": tiny_shape.layers, "hidden": tiny_shape.hidden, "heads": tiny_shape.heads}
    if tiny_shape.kind == "chat":
        from rlhf_core.model.chat import build_chat_policy

        tiny = Path(output_dir) / TINY_POLICY_DIRS["chat"]
        _build_once(tiny, lambda out: build_chat_policy(out, seed=seed, **size))
    else:
        tiny = Path(output_dir) / TINY_POLICY_DIRS["word"]
        _build_once(tiny, lambda out: build_tiny_policy(task, out, seed=seed, **size))
    built = json.loads((tiny / "config.json").read_text())
    differs = {k: (built.get(k), v) for k, v in shape.items() if built.get(k) != v}
    if differs:
        names = {"num_hidden_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads"}
        detail = ", ".join(f"{names[k]} {want} but it has {have}" for k, (have, want) in differs.items())
        raise ModelLoadError(
            f"the tiny policy already built in {tiny} has another shape (model.preset={model_cfg.preset} asks for "
            f"{detail}); use another run.output_dir, delete that directory to rebuild it, or set model.preset to "
            "match"
        )
    return tiny
