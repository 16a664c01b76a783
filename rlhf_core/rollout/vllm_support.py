"""VLLMEngine's helpers that need no engine: its batch packing, LoRA adapter files, model shape and CPU KV-cache
size, and its log settings (rlhf_core.rollout.vllm)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.types import RolloutBatch

# buffers that vLLM recomputes itself and whose names its load_weights does not know (transformers 5 also keeps
# rotary_emb.original_inv_freq)
_SKIPPED_WEIGHTS = ("inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def pack_completions(
    completions: Sequence[Sequence[tuple[Sequence[int], Sequence[float]]]],
    prompts: PromptBatch,
    pad_token_id: int,
    version: int,
    device: torch.device | str = "cpu",
) -> RolloutBatch:
    """Build a RolloutBatch from per-prompt lists of G (token_ids, sampled-token logprobs) completions.

    completions[i][g] is the g-th completion of prompt i; every prompt has the same number G. The response
    mask is True on each completion's own tokens (its EOS included when it stopped on one).
    """
    n_prompts = len(completions)
    if n_prompts != len(prompts):
        raise ValueError(f"got completions for {n_prompts} prompts, expected {len(prompts)}")
    G = len(completions[0]) if n_prompts else 0
    if any(len(c) != G for c in completions):
        raise ValueError("every prompt needs the same number of completions")
    rows = [c for per_prompt in completions for c in per_prompt]
    N = len(rows)
    L = max(1, max((len(ids) for ids, _ in rows), default=1))
    tokens = torch.full((N, L), pad_token_id, dtype=torch.long)
    logps = torch.zeros((N, L), dtype=torch.float32)
    lengths = torch.zeros(N, dtype=torch.long)
    for r, (ids, lps) in enumerate(rows):
        if len(ids) != len(lps):
            raise ValueError(f"completion {r}: {len(ids)} tokens but {len(lps)} logprobs")
        if ids:
            tokens[r, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            logps[r, : len(ids)] = torch.tensor(list(lps), dtype=torch.float32)
        lengths[r] = len(ids)
    mask = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
    batch = RolloutBatch(
        prompt_ids=prompts.prompt_ids.repeat_interleave(G, 0),
        prompt_mask=prompts.prompt_mask.repeat_interleave(G, 0),
        response_ids=tokens,
        response_mask=mask,
        behavior_logprobs=logps,
        response_lengths=lengths,
        group_ids=torch.arange(n_prompts).repeat_interleave(G),
        policy_version=torch.full((N,), int(version), dtype=torch.long),
        prompt_uids=prompts.uids.repeat_interleave(G),
    )
    return batch.to(device)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # max_lora_rank values vLLM accepts


def vllm_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank r."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"model.lora.r={r} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def adapter_config_json(lora_cfg, base_model_path: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter for `lora_cfg` (rlhf_core.config.LoraConfig)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_path),
        "r": int(lora_cfg.r),
        "lora_alpha": float(lora_cfg.alpha),
        "lora_dropout": 0.0,
        "target_modules": list(lora_cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def _vllm_version() -> tuple[int, ...]:
    import vllm

    parts = []
    for piece in str(getattr(vllm, "__version__", "0")).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention


def _model_shape(model_path: str) -> dict:
    """config.json of the model directory ({} where it cannot be read: vLLM then reports the problem itself)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def cpu_kv_cache_bytes(shape: dict, rows: int, max_len: int, dtype: str) -> int:
    """KV-cache bytes for `rows` sequences of `max_len` tokens, at least 64 MiB and at most an eighth of the machine's
    memory (vLLM preempts and recomputes requests that find no room: slower, never wrong); on the CPU vLLM otherwise
    reserves most of the machine's memory. rollout.engine_kwargs.kv_cache_memory_bytes sets it outright."""
    layers = int(shape.get("num_hidden_layers", 1))
    heads = int(shape.get("num_attention_heads", 1))
    kv_heads = int(shape.get("num_key_value_heads") or heads)
    head_dim = int(shape.get("head_dim") or int(shape.get("hidden_size", 64)) // heads)
    per_token = 2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    try:
        ceiling = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8
    except (OSError, ValueError):
        ceiling = 4 << 30
    return max(64 << 20, min(ceiling, max(rows, 64) * max_len * per_token))


class _RotaryReloadNote(logging.Filter):
    """vLLM's in-place reload warns at every sync that the rotary embedding got no weights: it has none to get
    (its inv_freq buffer is recomputed by vLLM, and skipped here on purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def _quiet_vllm_logs() -> None:
    """vLLM logs several INFO lines per weight sync and per engine start; a run shows its warnings only, unless the
    user set VLLM_LOGGING_LEVEL (vLLM reconfigures its loggers from it whenever an engine is built)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReloadNote) for f in reload_log.filters):
        reload_log.addFilter(_RotaryReloadNote())
