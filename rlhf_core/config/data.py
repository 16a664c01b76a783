"""The sections of what is trained and on what: buffer, model (and LoRA), data, held-out evaluation, rollout."""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple, Optional

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from rlhf_core.config.base import PRIORITY_FLOOR, Count, NonEmptyStr, PositiveFraction, _Section


class BufferConfig(_Section):
    """Replay buffer between rollout and trainer."""

    max_size: Count = Field(
        4096, description="Capacity in samples; the oldest ready data is dropped (and counted) on overflow."
    )


class LoraConfig(_Section):
    """LoRA adapters (peft): the trainer optimises them only; the base weights stay frozen. No LoRA dropout: the
    trainer computes log-probs without dropout, as the rollout engines do."""

    r: Count = Field(8, description="LoRA rank of every adapted linear layer (at least 1).")
    alpha: PositiveFloat = Field(16.0, description="LoRA alpha: the adapter's update is scaled by alpha / r.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Linear modules that get adapters, by name suffix (peft's target_modules); must match some.",
    )
    export_merged: bool = Field(
        True, description="At export, also write the adapters merged into the base weights as a plain HF model."
    )


class TinyShape(NamedTuple):
    """The locally built demo policy a model.preset names: its kind (word or chat) and shape."""

    kind: str
    layers: int
    hidden: int
    heads: int


TINY_PRESETS: dict[str, TinyShape] = {
    "tiny": TinyShape("word", 2, 128, 4),
    "tiny-chat": TinyShape("chat", 2, 128, 4),
    "micro": TinyShape("word", 1, 32, 2),
    "micro-chat": TinyShape("chat", 1, 32, 2),
}
"""The named model.preset values; any other shape is written kind:LAYERSxHIDDENxHEADS."""

_CUSTOM_PRESET = re.compile(r"^(word|chat):(\d+)x(\d+)x(\d+)$")


def preset_shape(preset: str) -> TinyShape:
    """The TinyShape a model.preset names; ValueError naming model.preset and the presets otherwise."""
    key = preset.strip() if isinstance(preset, str) else preset
    if key in TINY_PRESETS:
        return TINY_PRESETS[key]
    match = _CUSTOM_PRESET.match(key) if isinstance(key, str) else None
    if match is None:
        raise ValueError(
            f"model.preset {preset!r} is not a preset: choose one of {', '.join(TINY_PRESETS)}, or write a shape "
            "as kind:LAYERSxHIDDENxHEADS with kind word or chat (e.g. word:1x64x2)"
        )
    shape = TinyShape(match[1], int(match[2]), int(match[3]), int(match[4]))
    if shape.layers < 1 or shape.heads < 1 or shape.hidden < 16:
        raise ValueError(f"model.preset {preset!r}: layers and heads must be at least 1 and hidden at least 16")
    if shape.hidden % shape.heads:
        raise ValueError(f"model.preset {preset!r}: hidden ({shape.hidden}) must be divisible by heads ({shape.heads})")
    return shape


def preset_name(shape: TinyShape) -> str:
    """The model.preset of a shape: its name when it has one, else kind:LAYERSxHIDDENxHEADS."""
    for name, named in TINY_PRESETS.items():
        if named == tuple(shape):
            return name
    return f"{shape[0]}:{shape[1]}x{shape[2]}x{shape[3]}"


class ModelConfig(_Section):
    """Policy model. `path` empty builds the demo policy model.preset names (the tiny default: the synthetic tasks)."""

    path: str = Field(
        "", description="Local Hugging Face model directory; empty builds the tiny default policy under run.output_dir."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype; 'auto' takes the checkpoint's."
    )
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    trust_remote_code: bool = Field(
        False,
        description="Allow model code shipped inside a model directory of the run to run: the policy's, the "
        "critic's and the reward model's.",
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the trainer's forward pass.")
    preset: str = Field(
        "tiny",
        description="The demo policy built locally when path is empty: 'tiny' (word-level Llama for the synthetic "
        "tasks, 2 layers, hidden 128, 4 heads), 'tiny-chat' (Qwen2 of that shape with a byte-level BPE tokenizer "
        "trained locally, ChatML template, two EOS ids: reads jsonl/dataset prompts), 'micro' / 'micro-chat' (1 "
        "layer, hidden 32, 2 heads: the fast test shape), or any shape as kind:LAYERSxHIDDENxHEADS (e.g. "
        "word:1x64x2, chat:2x128x4).",
    )
    lora: Optional[LoraConfig] = Field(
        None, description="LoRA adapters {r, alpha, target_modules, export_merged}; empty or null is full fine-tuning."
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        preset_shape(v)
        return v.strip()

    @property
    def tiny(self) -> TinyShape:
        """The shape of the demo policy model.preset names (used when model.path is empty)."""
        return preset_shape(self.preset)

    @field_validator("lora", mode="before")
    @classmethod
    def _empty_lora_is_full(cls, v: Any) -> Any:
        return None if v in ({}, "", False) else v


class DataConfig(_Section):
    """Prompt source."""

    task: Literal["max3", "sum2", "max3_chat", "jsonl", "dataset"] = Field(
        "max3",
        description="Synthetic task ('max3': maximum of three digits; 'sum2': a+b; 'max3_chat': max3 in chat format, "
        "answered after '####', for chat models), a JSONL file ('jsonl'), or any table the `datasets` library reads "
        "('dataset': parquet, JSON, JSONL, a save_to_disk directory or a hub id; verl's parquet schema as it is).",
    )
    train_path: str = Field(
        "",
        description="Training prompts (task 'jsonl' or 'dataset'): rows with 'prompt' (text or chat list) or "
        "'messages', and 'answer' or verl's reward_model.ground_truth (key names: prompt_key, answer_key).",
    )
    eval_path: str = Field(
        "", description="Held-out prompts (task 'jsonl' or 'dataset'); empty holds out eval_size rows of train_path."
    )
    train_split: NonEmptyStr = Field(
        "train",
        description="Task 'dataset': split of train_path read from a hub id or a saved DatasetDict.",
    )
    eval_split: NonEmptyStr = Field(
        "test",
        description="Task 'dataset': split of eval_path read from a hub id or a saved DatasetDict.",
    )
    eval_size: Count = Field(200, description="Held-out prompts used for eval/accuracy.")
    heldout_frac: float = Field(
        0.2, gt=0, lt=1, description="Synthetic tasks: fraction of all problems held out from training."
    )
    max_prompt_tokens: Count = Field(256, description="Prompts longer than this are left-truncated.")
    system_prompt: str = Field("", description="System message for chat-template models (task 'jsonl' or 'dataset').")
    prompt_key: NonEmptyStr = Field(
        "prompt",
        description="The key holding the prompt: text or a chat list [{role, content}] (e.g. 'question' for raw "
        "GSM8K); dotted for nested keys. With 'prompt', a row that has 'messages' (TRL's conversational schema) "
        "uses them.",
    )
    answer_key: NonEmptyStr = Field(
        "answer",
        description="The key holding the answer, dotted for nested keys; with 'answer', rows without it use verl's reward_model.ground_truth.",
    )
    answer_after_marker: bool = Field(
        False,
        description="The answer field holds a whole solution: score the text after its last reward.marker (raw "
        "GSM8K lines {question, answer: '... #### 72'} load with prompt_key=question and this set).",
    )
    seed: int = Field(0, description="Shuffling seed of the prompt source.")
    sampler: Literal["epochs", "prioritized"] = Field(
        "epochs",
        description="How training prompts are served: 'epochs', seeded shuffled epochs as TRL and verl serve them "
        "(each prompt once per epoch, exactly once across a resume); 'prioritized', drawn with probability "
        "proportional to max(priority_floor, 1 - success), success being the mean reward of the prompt's latest "
        "group read as a rate in [0, 1] (Kimi k1.5's prioritized sampling: unsolved prompts come back more often).",
    )
    priority_floor: PositiveFraction = Field(
        PRIORITY_FLOOR,
        description="sampler 'prioritized': the weight of a solved prompt, relative to 1 for an unsolved one.",
    )


class EvalConfig(_Section):
    """Held-out evaluation: greedy eval/accuracy every `every` steps, and sampled eval/pass@k and eval/mean@k."""

    every: NonNegativeInt = Field(
        20, description="Evaluate on held-out prompts every this many steps (0 = only at start and end)."
    )
    n_samples: NonNegativeInt = Field(
        0, description="Samples per held-out prompt for eval/pass@k and eval/mean@k (0 = greedy accuracy only)."
    )
    temperature: PositiveFloat = Field(1.0, description="Sampling temperature of the sampled evaluation.")
    top_p: PositiveFraction = Field(1.0, description="Nucleus sampling mass of the sampled evaluation.")
    k: Count = Field(
        1,
        description="k of eval/pass@k (unbiased estimator, Chen et al. 2021) and eval/mean@k; at most n_samples.",
    )
    metric: NonEmptyStr = Field(
        "accuracy",
        description="The held-out score reported as eval/accuracy: 'accuracy' (the first answer-checking component, "
        "else a total reward above 0), or any reward column (a component's name or a reward function's label, "
        "reward.column_names()): its mean over the greedy held-out answers, also logged as eval/<metric>.",
    )


class _VllmEngineKwargs(_Section):
    gpu_memory_utilization: PositiveFraction = Field(0.5)
    enforce_eager: Optional[bool] = None
    kv_cache_memory_bytes: Optional[int] = Field(None, ge=1 << 20)


class _RandomEngineKwargs(_Section):
    tokens_per_s: NonNegativeFloat = Field(0.0)


class _HfEngineKwargs(_Section):
    continuous_batching: bool = Field(True)
    max_active_rows: Optional[Count] = Field(None)
    dtype: Optional[Literal["float32", "bfloat16"]] = None


ENGINE_KWARGS: dict[str, type[_Section]] = {
    "hf": _HfEngineKwargs,
    "vllm": _VllmEngineKwargs,
    "random": _RandomEngineKwargs,
}
"""rollout.engine_kwargs each engine takes, with their defaults and bounds."""


class RolloutConfig(_Section):
    """Generation."""

    engine: Literal["hf", "vllm", "random"] = Field(
        "hf", description="Rollout engine; 'random' emits uniform random tokens (load tests only)."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of rollout.engine only it reads (verl's name), checked against it: vllm "
        "{gpu_memory_utilization: fraction of GPU memory it may take, 0.5; enforce_eager: no CUDA graphs or "
        "torch.compile (null: true on the CPU, where compiling costs ~40 s of start-up, false on a GPU); "
        "kv_cache_memory_bytes: the KV cache's size (null: on the CPU sized from the run, on a GPU from "
        "gpu_memory_utilization)}; random {tokens_per_s: simulated "
        "generation rate, 0 = as fast as possible}; hf {continuous_batching: true (a row that ends leaves the batch "
        "and a waiting row takes its place; false: every row of a batch is computed until the longest one ends), "
        "max_active_rows: rows decoding at once (null: prompts_per_batch x samples_per_prompt), dtype: the "
        "engine's weights and compute dtype, float32 or bfloat16 (null: model.dtype; bfloat16 with a float32 "
        "trainer is a real engine mismatch, as vLLM in bf16: syncs are cast on load, log-probs stay float32)}.",
    )
    num_workers: Count = Field(1, description="Rollout workers (Ray actors in the distributed runtime).")
    prompts_per_batch: Count = Field(
        16,
        description="Prompts per generation batch on one worker. With an environment on an async host (Ray or "
        "threads) the groups kept in flight per worker: a group is pushed as soon as its episodes end and a new "
        "one starts, with no batch barrier (newer weights adopted between turns).",
    )
    samples_per_prompt: Count = Field(8, description="Completions per prompt (the GRPO group size G).")
    max_new_tokens: Count = Field(4, description="Maximum generated tokens per completion.")
    temperature: PositiveFloat = Field(1.0, description="Sampling temperature.")
    top_p: PositiveFraction = Field(1.0, description="Nucleus sampling mass.")
    top_k: NonNegativeInt = Field(0, description="Top-k sampling (0 disables).")
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Min-p sampling: drop tokens whose probability is below min_p x the most likely one's (0 disables).",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Extra token ids that end a response, besides the tokenizer's EOS and every id of the model's "
        "generation_config.json eos_token_id.",
    )
    partial_rollout: bool = Field(
        False,
        description="Adopt newly published weights between decode steps instead of between batches (the KV cache "
        "is recomputed under them), and with an environment also between a trajectory's turns; token_versions "
        "records each token's version.",
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_takes_them(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        engine = info.data.get("engine")
        spec = ENGINE_KWARGS.get(engine)
        if spec is None:  # the engine itself is wrong: that error names rollout.engine
            return kwargs
        takes = list(spec.model_fields)
        for key in kwargs:
            if key not in spec.model_fields:
                raise ValueError(
                    f"rollout.engine_kwargs.{key}: rollout.engine {engine!r} takes no such option ("
                    + (f"it takes {', '.join(takes)})" if takes else "it takes none: engine_kwargs must be empty)")
                )
        try:
            given = spec.model_validate(kwargs)
        except ValidationError as err:
            e = err.errors()[0]
            raise ValueError(f"rollout.engine_kwargs.{e['loc'][0]}: {e['msg']} (got {e.get('input')!r})") from None
        return {key: getattr(given, key) for key in kwargs}

    def engine_option(self, key: str) -> Any:
        """rollout.engine_kwargs[key], or the default of the engine option `key` (an engine built under another
        rollout.engine, as tests do, gets its defaults)."""
        if key in self.engine_kwargs:
            return self.engine_kwargs[key]
        for spec in ENGINE_KWARGS.values():
            if key in spec.model_fields:
                return spec.model_fields[key].default
        raise KeyError(f"no rollout engine takes the option {key!r}")
