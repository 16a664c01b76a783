"""One configuration object for a whole run.

`TrainConfig` is loaded once (`load_config(path, overrides)`) and handed down. Every field carries a
one-line description; the defaults run the embedded tiny demo on a laptop CPU. Prefect renders the model
as the flow's parameter form and MLflow logs it flattened as params (`flatten_config`).

Bad input fails with `ConfigError`, whose message names the dotted field path and the offending value.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf_core.reward.functions.spec import check_source, is_file_path

RUN_CONFIG_FILE = "train_config.yaml"  # the run's config, inside every checkpoint and exported policy


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


MAX_LR = 1.0
"""Largest trainer.lr accepted: above it AdamW diverges at once (1e38 overflows to inf in its update)."""
MAX_SEQUENCE_TOKENS = 131072
"""Largest rollout.max_new_tokens (and data.max_prompt_tokens) accepted before any model is loaded: the
longest context of current open models. The model's own limit is checked at launch
(rlhf_core.preflight.check_lengths)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AlgorithmConfig(_Section):
    """Policy loss and advantage estimator."""

    loss: Literal["grpo", "ppo", "m2po"] = Field(
        "grpo", description="Policy loss, by name from rlhf_core.algorithms.POLICY_LOSSES."
    )
    advantage: Literal["grpo", "rloo", "gae"] = Field(
        "grpo",
        description="Advantage estimator, by name from rlhf_core.algorithms.ADVANTAGE_ESTIMATORS ('gae': a learned "
        "critic, configured under critic:).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount over response tokens (advantage 'gae' only).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (advantage 'gae' only).")
    whiten_advantages: bool = Field(
        True, description="GAE: whiten advantages over the step's valid tokens (advantage 'gae' only)."
    )
    kl_in_reward: bool = Field(
        False,
        description="Apply kl_coef x KL(behaviour || reference) as a per-token reward penalty (the classic PPO "
        "recipe; advantage 'gae') instead of as a KL loss term.",
    )
    filter_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: groups whose rewards are all equal are not trained on; the step is "
        "filled from further groups (logged as buffer/filtered_groups_frac).",
    )
    filter_max_rounds: int = Field(
        10,
        ge=1,
        description="filter_groups: once this many steps' worth of groups (x trainer.prompts_per_step) arrived "
        "since the last step and fewer than a step passed, the step trains on the groups it has (the newest "
        "filtered ones when none passed) instead of waiting; every host alike.",
    )
    mask_truncated: bool = Field(
        False,
        description="Samples cut at rollout.max_new_tokens (no stop id) contribute no tokens to the loss.",
    )
    adv_scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="GRPO advantage normalisation: group std, batch std, or none (Dr.GRPO). Not for advantage 'rloo'.",
    )
    adv_eps: float = Field(
        1e-6, gt=0, description="Added to the std when normalising GRPO advantages. Not for advantage 'rloo'."
    )
    clip_eps: Optional[float] = Field(
        0.2,
        gt=0,
        lt=1,
        description="PPO clip range (lower, and upper unless clip_eps_high is set); M2PO clips only when set.",
    )
    clip_eps_high: Optional[float] = Field(
        None, gt=0, description="Upper clip range (DAPO clip-higher); None uses clip_eps."
    )
    dual_clip: Optional[float] = Field(
        None,
        gt=1,
        description="Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables.",
    )
    m2_threshold: float = Field(
        0.04, gt=0, description="M2PO bound on the mean squared log-ratio over candidate tokens."
    )
    masking: Literal["trust_region", "ratio_sq"] = Field(
        "trust_region",
        description="M2PO masking: Algorithm 1 of arXiv 2510.01161, or the r^2 < ratio_sq_threshold rule; computed over the whole step's batch.",
    )
    ratio_sq_threshold: float = Field(
        4.0, gt=0, description="M2PO 'ratio_sq' masking: keep tokens with r^2 below this."
    )
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean",
        description="How per-token losses are aggregated into a scalar ('seq-mean-token-sum-norm' divides by rows x rollout.max_new_tokens).",
    )
    importance_level: Literal["token", "sequence"] = Field(
        "token", description="Per-token ratios (PPO) or one geometric-mean ratio per sequence (GSPO)."
    )
    tis_cap: Optional[float] = Field(
        None,
        gt=0,
        description="Truncated importance sampling cap for rollout-vs-trainer logprob mismatch; None disables.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the KL penalty to the frozen reference policy; 0 loads no reference model."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator used for the penalty.")

    @model_validator(mode="after")
    def _advantage_options(self) -> AlgorithmConfig:
        # Options the chosen estimator would ignore are refused rather than dropped silently. A value equal
        # to the default is let through: a config dumped whole (a checkpoint, a Prefect parameter form)
        # lists every field, and that must stay valid.
        if self.advantage != "gae":
            for name in ("gamma", "lam", "whiten_advantages"):
                if name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(
                        f"algorithm.{name} has no effect with algorithm.advantage '{self.advantage}'; it is an "
                        "option of algorithm.advantage 'gae'"
                    )
            if self.kl_in_reward:
                raise ValueError(
                    "algorithm.kl_in_reward needs algorithm.advantage 'gae' (a per-token reward penalty needs "
                    "per-token advantages); with group advantages use the KL loss (algorithm.kl_coef alone)"
                )
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("algorithm.kl_in_reward needs algorithm.kl_coef > 0 (the penalty's weight)")
        if self.advantage in ("rloo", "gae"):
            for name in ("adv_scale", "adv_eps"):
                if name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(
                        f"algorithm.{name} has no effect with algorithm.advantage '{self.advantage}' (only "
                        f"GRPO's advantages are scaled); remove algorithm.{name} or use algorithm.advantage 'grpo'"
                    )
        return self


REWARD_COMPONENT_NAMES: tuple[str, ...] = ("exact_match", "contains", "answer_after_marker", "format", "length_penalty")
"""The built-in reward components, named here so that validating a config does not import torch (they are
the keys of rlhf_core.reward.REWARD_COMPONENTS; tests/test_config.py checks the two agree)."""


class RewardFunctionConfig(_Section):
    """A Python reward function (TRL's or verl's signature), run in the rollout worker's process pool."""

    path: str = Field(
        "",
        description="A .py file (relative to the working directory) or an importable module; empty for a built-in (math_verify).",
    )
    name: str = Field(
        ..., min_length=1, description="The function's name in that file or module (verl's is usually compute_score)."
    )
    weight: float = Field(1.0, description="Weight of the function's score in the total reward.")
    label: str = Field("", description="Metric name: logged as reward/<label>; empty uses `name`.")
    metrics: list[str] = Field(
        default_factory=list,
        description="Keys of a verl function's returned dict (besides 'score') to log as reward/<label>/<key> means.",
    )

    @property
    def metric_name(self) -> str:
        return self.label or self.name


class RewardModelConfig(_Section):
    """A learned reward model: a local sequence-classification model giving one score per sequence."""

    path: str = Field(
        "",
        description="Local Hugging Face AutoModelForSequenceClassification directory (num_labels=1); empty = no "
        "reward model.",
    )
    weight: float = Field(1.0, description="Weight of the reward model's score in the total reward.")
    batch_size: int = Field(64, ge=1, description="Sequences per reward-model forward pass.")
    max_length: int = Field(
        1024,
        ge=2,
        description="Longest scored sequence in RM tokens (capped at the RM's context); longer ones keep their "
        "last max_length tokens.",
    )
    normalize: Literal["none", "running"] = Field(
        "none",
        description="'running': scores are standardised by the running mean and std of all scores so far; "
        "'none': raw scores.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Reward model parameter dtype; 'auto' takes the checkpoint's."
    )
    device: str = Field(
        "auto", description="'auto' (CUDA when its process has one, else CPU), 'cpu', 'cuda' or 'cuda:N'."
    )
    trust_remote_code: bool = Field(False, description="Allow model code shipped inside the RM directory to run.")


class OverlongConfig(_Section):
    """DAPO's soft overlong punishment: no penalty up to max_new_tokens - buffer_len generated tokens, then
    linear down to -penalty at max_new_tokens (logged as reward/overlong)."""

    buffer_len: int = Field(..., ge=1, description="Tokens before rollout.max_new_tokens where the penalty starts.")
    penalty: float = Field(1.0, gt=0, description="The penalty at rollout.max_new_tokens (the reward gets -penalty).")


class RewardConfig(_Section):
    """Reward: a weighted sum of tensor-native components (token space) and Python reward functions."""

    components: dict[str, float] = Field(
        default_factory=lambda: {"exact_match": 1.0},
        description="Reward components by name (rlhf_core.reward.REWARD_COMPONENTS) and their weights.",
    )
    marker: str = Field(
        "####", description="Text whose LAST occurrence precedes the answer, for the 'answer_after_marker' component."
    )
    continuation_chars: str = Field(
        "0123456789.,",
        description="Characters that may not directly follow the answer in 'answer_after_marker' ('42' must not match '421').",
    )
    format_sequences: list[str] = Field(
        default_factory=list, description="Texts that must appear in order in the response, for the 'format' component."
    )
    length_target: int = Field(
        0,
        ge=0,
        description="Responses longer than this many tokens are penalised by the 'length_penalty' component (0 = max_new_tokens).",
    )
    match: Literal["text", "tokens"] = Field(
        "text",
        description="How exact_match, contains, answer_after_marker and format compare: 'text' = as text on the "
        "device, any tokenization, numbers normalised (docs/rewards.md); 'tokens' = the answers' token sequences "
        "(special-token answers, one known tokenization: docs/rewards.md).",
    )
    model: RewardModelConfig = Field(
        default_factory=RewardModelConfig,
        description="A learned reward model scored beside the components (logged as reward/reward_model).",
    )

    overlong: Optional[OverlongConfig] = Field(
        None,
        description="DAPO overlong shaping {buffer_len, penalty}, added to the reward (reward/overlong); null = off.",
    )

    functions: list[RewardFunctionConfig] = Field(
        default_factory=list,
        description="Python reward functions [{path, name, weight}], TRL or verl signature, added to the total by weight (docs/rewards.md).",
    )
    function_timeout_s: float = Field(
        30.0, gt=0, description="Longest one call of a Python reward function may run; past it the call fails."
    )
    function_workers: int = Field(
        2, ge=1, description="Processes per rollout worker that run the Python reward functions."
    )
    max_consecutive_failures: int = Field(
        20,
        ge=1,
        description="Stop the run when a Python reward function fails (raises or times out) this many calls in a row.",
    )

    @model_validator(mode="after")
    def _known_components(self) -> RewardConfig:
        unknown = sorted(set(self.components) - set(REWARD_COMPONENT_NAMES))
        if unknown:
            raise ValueError(f"unknown reward component(s) {unknown}; known: {sorted(REWARD_COMPONENT_NAMES)}")
        if not self.components:
            raise ValueError("at least one reward component is required")
        return self

    @model_validator(mode="after")
    def _functions_exist(self) -> RewardConfig:
        """Each function's file or module exists, defines the function, with TRL's or verl's signature (read
        from the source: nothing is imported or run here), and its metric names are free."""
        seen = set(self.components)
        for i, fn in enumerate(self.functions):
            where = f"reward.functions[{i}]"
            kind = check_source(fn.path, fn.name, where)
            label = fn.metric_name
            if label in seen or "/" in label:
                raise ValueError(
                    f"{where}: metric name {label!r} is already a reward component or function, or has a '/'; "
                    f"give this function a unique `label`"
                )
            seen.add(label)
            if fn.metrics and kind != "verl":
                raise ValueError(
                    f"{where}: metrics {fn.metrics} are the keys of a verl function's dict; {fn.name} is TRL-style"
                )
            if "failed" in fn.metrics or len(set(fn.metrics)) < len(fn.metrics):
                raise ValueError(
                    f"{where}: metrics must be distinct and not 'failed' (reward/<label>/failed is logged always)"
                )
            if is_file_path(fn.path):  # absolute: Ray workers need not share the working directory
                fn.path = str(Path(fn.path).resolve())
            if not fn.path and fn.name == "math_verify":
                if importlib.util.find_spec("math_verify") is None:
                    raise ValueError(
                        f'{where}: the built-in math_verify needs the math-verify package: pip install -e ".[math]"'
                    )
        return self

    def column_names(self) -> list[str]:
        """The per-row reward columns a rollout batch carries (`RolloutBatch.reward_components`), logged as
        reward/<column>: the components, then per function its score, <label>/failed (1 where the call
        failed) and <label>/<key> for each declared verl metric; then reward_model when reward.model.path is
        set; then overlong when reward.overlong is set."""
        return (
            list(self.components)
            + self.function_column_names()
            + (["reward_model"] if self.model.path else [])
            + (["overlong"] if self.overlong is not None else [])
        )

    def function_column_names(self) -> list[str]:
        """The Python reward functions' columns, in order: per function its score, <label>/failed and
        <label>/<key> for each declared verl metric."""
        names = []
        for fn in self.functions:
            names += [fn.metric_name, f"{fn.metric_name}/failed", *(f"{fn.metric_name}/{k}" for k in fn.metrics)]
        return names


ENV_COLUMNS = ("env", "env/turns_mean", "env/tool_calls_mean", "env/truncated_frac")


class EnvToolConfig(_Section):
    """A Python function offered to the model as a tool by the built-in ToolEnv."""

    path: str = Field(
        ..., min_length=1, description="A .py file (relative to the working directory) or an importable module."
    )
    name: str = Field(..., min_length=1, description="The function's name there (also the tool's name).")


class EnvConfig(_Section):
    """A multi-turn environment (docs/environments.md): a class with reset(row) and step(action), one instance
    per trajectory, run in the rollout worker's process pool; empty name = single-turn prompts as before."""

    path: str = Field(
        "",
        description="A .py file (relative to the working directory) or an importable module holding the class; "
        "empty for the built-in ToolEnv.",
    )
    name: str = Field(
        "",
        description="The environment class's name there; empty = no environment (ToolEnv when env.tools is set).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the class's __init__.")
    max_turns: int = Field(4, ge=1, description="Most model turns per trajectory; the trajectory ends after it.")
    step_timeout_s: float = Field(
        30.0, gt=0, description="Longest one reset or step (and one tool call) may run; past it the trajectory fails."
    )
    max_consecutive_failures: int = Field(
        20, ge=1, description="Stop the run when this many environment steps in a row raise or time out."
    )
    observation_role: str = Field(
        "user", min_length=1, description="Chat role of an observation the environment returns as a plain string."
    )
    reward_weight: float = Field(
        1.0, description="Weight of the environment's summed rewards (reward/env) in the trajectory's reward."
    )
    tools: list[EnvToolConfig] = Field(
        default_factory=list,
        description="Python functions [{path, name}] the built-in ToolEnv offers as tools (schemas from signature and docstring).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.class_name)

    def column_names(self) -> list[str]:
        """The per-row columns a trajectory batch carries after the reward's (`RolloutBatch.reward_components`):
        env (the summed environment reward, logged as reward/env), env/turns_mean, env/tool_calls_mean and
        env/truncated_frac (logged under these names, as batch means); none without an environment."""
        return list(ENV_COLUMNS) if self.enabled else []

    @property
    def class_name(self) -> str:
        """The class to load: `name`, or ToolEnv when only tools are given."""
        return self.name or ("ToolEnv" if self.tools else "")

    @model_validator(mode="after")
    def _env_exists(self) -> EnvConfig:
        """The class's file or module exists and defines it, and each tool's function (read from the source:
        nothing is imported or run here)."""
        from rlhf_core.env.spec import check_env_source, check_tool_source

        if self.enabled:
            check_env_source(self.path, self.class_name, "env")
            resolved = str(Path(self.path).resolve()) if is_file_path(self.path) else self.path
            if resolved != self.path:  # absolute: Ray workers need not share the working directory
                self.path = resolved  # (assignment validates again: only when it changes)
        seen = set()
        for i, tool in enumerate(self.tools):
            where = f"env.tools[{i}]"
            check_tool_source(tool.path, tool.name, where)
            if tool.name in seen:
                raise ValueError(f"{where}: tool name {tool.name!r} is given twice; tool names must be unique")
            seen.add(tool.name)
            if is_file_path(tool.path):
                tool.path = str(Path(tool.path).resolve())
        return self


# --- agent: section (docs/agents.md) -----------------------------------------------------------------------
AGENT_COLUMNS = ("agent", "agent/requests_mean", "agent/prefix_breaks", "agent/latency_s")


class AgentConfig(_Section):
    """An agent written against the OpenAI client (docs/agents.md): `async def run(client, row, **kwargs)`,
    called once per episode with an `openai.AsyncOpenAI` on the policy's endpoint; empty name = no agent."""

    path: str = Field("", description="A .py file (relative to the working directory) or an importable module.")
    name: str = Field("", description="The agent's async function there; empty = no agent.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to it every call.")
    timeout_s: float = Field(
        120.0, gt=0, description="Longest one episode may run; past it the episode fails (agent/timeouts)."
    )
    max_requests: int = Field(32, ge=1, description="Most requests one episode may make; later ones get a 400.")
    max_consecutive_failures: int = Field(
        20, ge=1, description="Stop the run when this many episodes in a row raise or time out."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def column_names(self) -> list[str]:
        """The per-row columns an agent batch carries after the reward's and the environment's: agent (the
        episode's reward, logged as reward/agent), agent/requests_mean, agent/prefix_breaks, agent/latency_s."""
        return list(AGENT_COLUMNS) if self.enabled else []

    @model_validator(mode="after")
    def _agent_exists(self) -> AgentConfig:
        from rlhf_core.env.spec import check_tool_source

        if self.enabled:
            if not self.path:
                raise ValueError("agent.path is empty: give the .py file or module that defines agent.name")
            check_tool_source(self.path, self.name, "agent")
            resolved = str(Path(self.path).resolve()) if is_file_path(self.path) else self.path
            if resolved != self.path:  # absolute: Ray workers need not share the working directory
                self.path = resolved
        return self


# --- end of the agent: section -----------------------------------------------------------------------------


class BufferConfig(_Section):
    """Replay buffer between rollout and trainer."""

    max_size: int = Field(
        4096, ge=1, description="Capacity in samples; the oldest ready data is dropped (and counted) on overflow."
    )


class LoraConfig(_Section):
    """LoRA adapters (peft): the trainer optimises them only; the base weights stay frozen."""

    r: int = Field(8, ge=1, description="LoRA rank of every adapted linear layer (at least 1).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapter's update is scaled by alpha / r.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Must be 0: the trainer computes log-probs without dropout (as the rollout does), so any other "
        "value could only be ignored.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Linear modules that get adapters, by name suffix (peft's target_modules); must match some.",
    )
    export_merged: bool = Field(
        True, description="At export, also write the adapters merged into the base weights as a plain HF model."
    )

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, dropout: float) -> float:
        if dropout:
            raise ValueError(
                f"model.lora.dropout={dropout:g} cannot take effect: the trainer computes log-probs without dropout, "
                "as the rollout engines do (with it, on-policy ratios differ from 1 and M2PO's mask comes from "
                "another dropout sample than the gradient). Set model.lora.dropout=0"
            )
        return dropout


class ModelConfig(_Section):
    """Policy model. `path` empty builds the tiny default model for the synthetic task."""

    path: str = Field(
        "", description="Local Hugging Face model directory; empty builds the tiny default policy under run.output_dir."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype; 'auto' takes the checkpoint's."
    )
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    trust_remote_code: bool = Field(False, description="Allow model code shipped inside the model directory to run.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the trainer's forward pass.")
    tiny_layers: int = Field(2, ge=1, description="Tiny default policy: number of transformer layers.")
    tiny_hidden: int = Field(128, ge=16, description="Tiny default policy: hidden width.")
    tiny_heads: int = Field(4, ge=1, description="Tiny default policy: attention heads.")
    tiny_kind: Literal["word", "chat"] = Field(
        "word",
        description="Tiny default policy: 'word' (Llama, word-level tokenizer, synthetic tasks) or 'chat' (Qwen2, "
        "byte-level BPE tokenizer trained locally, ChatML template, generation_config with two EOS ids).",
    )
    lora: Optional[LoraConfig] = Field(
        None, description="LoRA adapters {r, alpha, dropout, target_modules}; empty or null is full fine-tuning."
    )

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
        "'messages', and 'answer' or verl's reward_model.ground_truth (key names: prompt_key, messages_key, answer_key).",
    )
    eval_path: str = Field(
        "", description="Held-out prompts (task 'jsonl' or 'dataset'); empty holds out eval_size rows of train_path."
    )
    train_split: str = Field(
        "train",
        min_length=1,
        description="Task 'dataset': split of train_path read from a hub id or a saved DatasetDict.",
    )
    eval_split: str = Field(
        "test",
        min_length=1,
        description="Task 'dataset': split of eval_path read from a hub id or a saved DatasetDict.",
    )
    eval_size: int = Field(200, ge=1, description="Held-out prompts used for eval/accuracy.")
    heldout_frac: float = Field(
        0.2, gt=0, lt=1, description="Synthetic tasks: fraction of all problems held out from training."
    )
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts longer than this are left-truncated.")
    system_prompt: str = Field("", description="System message for chat-template models (task 'jsonl' or 'dataset').")
    prompt_key: str = Field(
        "prompt",
        min_length=1,
        description="The key holding the prompt: text or a chat list (e.g. 'question' for raw GSM8K); dotted for nested keys.",
    )
    messages_key: str = Field(
        "messages",
        min_length=1,
        description="The key holding chat messages [{role, content}] (used instead of prompt_key when present).",
    )
    answer_key: str = Field(
        "answer",
        min_length=1,
        description="The key holding the answer, dotted for nested keys; with 'answer', rows without it use verl's reward_model.ground_truth.",
    )
    answer_after_marker: bool = Field(
        False,
        description="The answer field holds a whole solution: score the text after its last reward.marker (raw "
        "GSM8K lines {question, answer: '... #### 72'} load with prompt_key=question and this set).",
    )
    seed: int = Field(0, description="Shuffling seed of the prompt source.")


class EvalConfig(_Section):
    """Sampled held-out evaluation beside greedy eval/accuracy: eval/pass@k and eval/mean@k."""

    n_samples: int = Field(
        0, ge=0, description="Samples per held-out prompt for eval/pass@k and eval/mean@k (0 = greedy accuracy only)."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the sampled evaluation.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass of the sampled evaluation.")
    k: int = Field(
        1,
        ge=1,
        description="k of eval/pass@k (unbiased estimator, Chen et al. 2021) and eval/mean@k; at most n_samples.",
    )


class RolloutConfig(_Section):
    """Generation."""

    engine: Literal["hf", "vllm", "random"] = Field(
        "hf", description="Rollout engine; 'random' emits uniform random tokens (load tests only)."
    )
    num_workers: int = Field(1, ge=1, description="Rollout workers (Ray actors in the distributed runtime).")
    prompts_per_batch: int = Field(16, ge=1, description="Prompts per generation batch on one worker.")
    samples_per_prompt: int = Field(8, ge=1, description="Completions per prompt (the GRPO group size G).")
    max_new_tokens: int = Field(4, ge=1, description="Maximum generated tokens per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 disables).")
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
    max_total_tokens: Optional[int] = Field(
        None,
        ge=2,
        description="Multi-turn (env): most tokens of a trajectory, prompt plus every turn; it ends, truncated, "
        "where it would pass this (None: the model's context).",
    )
    random_tokens_per_s: float = Field(
        0.0, ge=0, description="RandomEngine only: simulated generation rate (0 = as fast as possible)."
    )
    continuous_batching: bool = Field(
        True,
        description="HF engine: a row that ends leaves the batch and a waiting row takes its place (false: every "
        "row of a batch is computed until the longest one ends).",
    )
    max_active_rows: Optional[int] = Field(
        None,
        ge=1,
        description="HF engine with continuous batching: rows decoding at once (None: prompts_per_batch x "
        "samples_per_prompt).",
    )
    partial_rollout: bool = Field(
        False,
        description="Adopt newly published weights between decode steps instead of between batches (the KV cache "
        "is recomputed under them), and with an environment also between a trajectory's turns; token_versions "
        "records each token's version.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM engine: fraction of GPU memory it may take."
    )


class TrainerConfig(_Section):
    """Optimisation."""

    total_steps: int = Field(400, ge=1, description="Trainer steps (policy versions) in the run.")
    prompts_per_step: int = Field(
        16, ge=1, description="Prompt groups consumed per trainer step (batch = prompts_per_step x samples_per_prompt)."
    )
    micro_batch_size: int = Field(
        64, ge=1, description="Sequences per forward/backward; gradients accumulate over micro-batches."
    )
    lr: float = Field(3e-4, gt=0, description=f"AdamW peak learning rate (at most {MAX_LR:g}).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine schedule floor as a fraction of lr.")
    warm_start_steps: int = Field(
        0,
        ge=0,
        description="Supervised steps that teach the answer format (not the task) before RL, on both runtimes "
        "(reported as eval/accuracy_warm_start; 0 = none).",
    )
    warm_start_lr: Optional[float] = Field(
        None, gt=0, le=1.0, description="AdamW learning rate of the warm start; None uses trainer.lr."
    )
    warm_start_targets: Literal["any_answer", "prompt_number"] = Field(
        "any_answer",
        description="What the warm start imitates, in the reward's format: any_answer, a training answer drawn "
        "uniformly regardless of the prompt; prompt_number, a number quoted in the prompt's own question "
        "(drawn uniformly among them; the right one only by chance), so that the policy learns to answer "
        "with a number from the question, as an instruct model does, and RL learns which.",
    )
    seed: int = Field(0, description="Seed for torch, sampling and initialisation.")
    padding_free: bool = Field(
        True,
        description="Pack a micro-batch's sequences end to end (own position ids, attention within each sequence) "
        "instead of padding every row to the longest; falls back to padding where the model does not isolate them.",
    )

    @field_validator("lr")
    @classmethod
    def _sane_lr(cls, lr: float) -> float:
        # 1e38 passes gt=0 and then overflows inside AdamW; nothing above 1 is a learning rate anyone means
        if not math.isfinite(lr) or lr > MAX_LR:
            raise ValueError(
                f"trainer.lr={lr:g} is not a usable learning rate: it must be at most {MAX_LR:g} "
                "(RL fine-tuning uses about 1e-6 to 1e-4; the tiny demo 3e-4)"
            )
        return lr


class CriticConfig(_Section):
    """The learned critic of algorithm.advantage 'gae': trained in the trainer role, checkpointed with it."""

    path: str = Field(
        "",
        description="Local Hugging Face model directory of the critic's body (the policy's tokenizer); empty = the "
        "policy's architecture and weights, with a scalar value head.",
    )
    lr: float = Field(1e-5, gt=0, le=1.0, description="AdamW learning rate of the critic.")
    value_clip: Optional[float] = Field(
        0.5, gt=0, description="Clip range of new values around the step's old values in the value loss; null = none."
    )
    micro_batch_size: int = Field(64, ge=1, description="Sequences per critic forward/backward.")
    warmup_steps: int = Field(
        0, ge=0, description="First trainer steps in which only the critic trains (the policy's weights stay)."
    )


class AutopilotConfig(_Section):
    """The staleness autopilot: the supervisor moves runtime.max_staleness within [min_staleness, max_staleness]."""

    enabled: bool = Field(
        False, description="Let the supervisor raise and lower the staleness bound (the one policy over it)."
    )
    min_staleness: int = Field(0, ge=0, description="Lowest bound the autopilot sets.")
    max_staleness: int = Field(8, ge=0, description="Highest bound the autopilot sets (also the trainer's hard check).")
    target_m2: float = Field(
        0.04,
        gt=0,
        description="Mismatch target: the mean squared behaviour/current log-ratio (async/mismatch_m2) above it "
        "lowers the bound; below it, with the trainer waiting and its data at the bound (async/staleness_max), the "
        "bound rises.",
    )
    wait_frac: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="The trainer counts as waiting for data when time/wait_s is above this fraction of its step time.",
    )
    cooldown_steps: int = Field(
        4, ge=1, description="Trainer steps after a change before the next one (the new bound takes effect first)."
    )


class RuntimeConfig(_Section):
    """How rollout and training are interleaved."""

    max_staleness: int = Field(
        2,
        ge=0,
        description="tau_max: every consumed sample has trainer_version - sample_version <= this; 0 is lockstep "
        "(generate -> train -> load weights, every sample on-policy). The bound in force unless the autopilot is on.",
    )
    sync_every: int = Field(1, ge=1, description="Publish weights to rollout workers every this many trainer versions.")
    wait_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest any blocking wait may last before failing with a message naming what it waited for.",
    )
    prefetch: bool = Field(
        True,
        description="The trainer takes the next batch (for version V + 1) from the buffer while step V trains.",
    )
    autopilot: AutopilotConfig = Field(
        default_factory=AutopilotConfig,
        description="Staleness autopilot {enabled, min_staleness, max_staleness, target_m2, ...}: the supervisor "
        "moves max_staleness at runtime.",
    )


class ClusterConfig(_Section):
    """Ray placement. Only rlhf_core.distributed reads it."""

    address: str = Field(
        "",
        description="'' starts a local Ray instance; 'auto' or 'ray://host:port' joins a cluster. Defaults from RAY_ADDRESS.",
    )
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs of a local Ray instance (None = all).")
    num_gpus: Optional[int] = Field(None, ge=0, description="GPUs of a local Ray instance (None = detected).")
    rollout_cpus: float = Field(1.0, ge=0, description="CPUs per rollout worker.")
    rollout_gpus: float = Field(0.0, ge=0, description="GPUs per rollout worker (fractions allowed).")
    trainer_workers: int = Field(
        1,
        ge=1,
        description="Trainer ranks: N > 1 starts N trainer actors in one placement group that form a torch.distributed "
        "group (gloo on CPU, NCCL on GPU), shard the policy with FSDP2 and each train on a slice of every step's "
        "batch, with the update of one process; 1 keeps the single trainer actor.",
    )
    trainer_cpus: float = Field(
        1.0,
        ge=0,
        description="CPUs of the trainer role, split evenly across its cluster.trainer_workers ranks (Ray's logical "
        "CPUs: a 2-core machine runs one rollout worker and 2 trainer ranks as they are).",
    )
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs of each trainer rank (fractions allowed).")
    reward_cpus: float = Field(
        0.0,
        ge=0,
        description="CPUs reserved for the reward-model actor (when reward.model.path is set); 0 by default: the "
        "rollout workers wait while it scores their rows, so a small RM runs in their share (a 2-core machine fits "
        "the default roles); reserve CPUs for a large RM on CPU.",
    )
    reward_gpus: float = Field(
        0.0, ge=0, description="GPUs of the reward-model actor (when reward.model.path is set; fractions allowed)."
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per worker.")
    max_restarts: int = Field(
        5,
        ge=0,
        description="The run's one restart budget: rollout-worker restarts it survives, all workers together (Ray "
        "restarts a worker that died; one restart more fails the run, naming this field).",
    )
    dashboard: bool = Field(
        False,
        description="Local Ray instance only: start the Ray dashboard (on 127.0.0.1:8265). A local instance binds "
        "every port to 127.0.0.1 either way; joining a cluster (address set) is unaffected.",
    )

    @property
    def trainer_rank_cpus(self) -> float:
        """Ray CPUs of each trainer rank: trainer_cpus split across the trainer_workers ranks."""
        return self.trainer_cpus / self.trainer_workers


class TrackingConfig(_Section):
    """MLflow tracking, checkpoints and evaluation."""

    experiment: str = Field("asynctensorrlhf", description="MLflow experiment name.")
    tracking_uri: str = Field(
        "",
        description="MLflow tracking URI; empty uses MLFLOW_TRACKING_URI or sqlite:///mlflow.db in the working directory.",
    )
    run_name: str = Field(
        "", description="MLflow run name; empty takes the Prefect flow run's name (MLflow picks one outside a flow)."
    )
    checkpoint_every: int = Field(
        20, ge=0, description="Checkpoint every this many trainer steps (0 = only at the end)."
    )
    eval_every: int = Field(
        20, ge=0, description="Evaluate on held-out prompts every this many steps (0 = only at start and end)."
    )
    keep_checkpoints: int = Field(
        3,
        ge=0,
        description="Checkpoints a run keeps, newest first, on disk and in MLflow's artifacts (older ones are "
        "deleted; the newest complete one and the final one are always kept); 0 keeps every checkpoint.",
    )
    log_system_metrics: bool = Field(True, description="Let MLflow sample CPU/GPU/memory during the run.")
    log_model: bool = Field(True, description="Log the final policy as an MLflow artifact that loads back.")


class SupervisionConfig(_Section):
    """The Prefect flow's health checks and their limits."""

    supervise_interval_s: float = Field(2.0, gt=0, description="Seconds between polls of the actors' stats.")
    staleness_warn: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Above this fraction of max_staleness, mean staleness is reported and weights are published "
        "sooner where runtime.sync_every leaves workers behind; it never changes the staleness bound (only the "
        "autopilot does, when enabled).",
    )
    nonfinite_limit: int = Field(
        5, ge=1, description="Fail after this many consecutive non-finite (skipped) trainer steps."
    )
    stall_timeout_s: float = Field(
        180.0, gt=0, description="Fail when no trainer step completes for this long, naming the stuck role."
    )


class RunConfig(_Section):
    """Where outputs go."""

    output_dir: str = Field(
        "runs/tiny",
        description="Directory for the built tiny model and the runs: each flow run writes its checkpoints, export and resume downloads under output_dir/<run.name>/, and output_dir/latest points to the newest run.",
    )
    name: str = Field(
        "",
        description="This run's directory under run.output_dir. Empty: the flow names it <UTC time>-<flow run name> (the single-process loop writes to run.output_dir itself). Two live runs never share one: the second is refused at start.",
    )
    log_every: int = Field(5, ge=1, description="Print a progress line every this many trainer steps.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if v and (v in (".", "..", "latest") or "/" in v or "\\" in v or v != v.strip()):
            raise ValueError(f"must be a plain directory name (no '/', not '.', '..' or 'latest'); got {v!r}")
        return v

    @property
    def run_dir(self) -> Path:
        """Where this run's checkpoints, export and downloads go: output_dir/name, or output_dir when unnamed."""
        return Path(self.output_dir) / self.name if self.name else Path(self.output_dir)


class TrainConfig(_Section):
    """Everything a run needs. Load with `load_config`."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Policy loss and advantages.")
    reward: RewardConfig = Field(
        default_factory=RewardConfig,
        description="Rewards: tensor-native components, Python reward functions and a learned reward model.",
    )
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Replay buffer.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt source.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Optimisation.")
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig, description="Staleness (0: lockstep), weight syncs and waits."
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Ray placement.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow, checkpoints, evaluation.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Sampled held-out evaluation (pass@k, mean@k).")
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="The critic of algorithm.advantage 'gae' (unused otherwise)."
    )
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig, description="Flow health checks.")
    env: EnvConfig = Field(
        default_factory=EnvConfig, description="Multi-turn environment and tools (empty: single-turn prompts)."
    )
    agent: AgentConfig = Field(
        default_factory=AgentConfig, description="An agent on the OpenAI-compatible endpoint (empty: none)."
    )
    run: RunConfig = Field(default_factory=RunConfig, description="Outputs.")

    @model_validator(mode="after")
    def _cross_field(self) -> TrainConfig:
        if self.data.task in ("jsonl", "dataset") and not self.data.train_path:
            raise ValueError(f"data.train_path is required when data.task is '{self.data.task}'")
        if self.data.task in ("jsonl", "dataset") and not self.model.path:
            raise ValueError(
                f"model.path is required when data.task is '{self.data.task}' (the tiny model only speaks the "
                "synthetic tasks)"
            )
        keys = {f"data.{k}": getattr(self.data, k) for k in ("prompt_key", "messages_key", "answer_key")}
        if len(set(keys.values())) < len(keys):
            raise ValueError(f"{', '.join(keys)} must name different keys (got {list(keys.values())})")
        if self.eval.n_samples and self.eval.k > self.eval.n_samples:
            raise ValueError(
                f"eval.k={self.eval.k} is more than eval.n_samples={self.eval.n_samples}: pass@k needs at least k "
                f"samples per prompt. Set eval.n_samples to {self.eval.k} or more, or lower eval.k"
            )
        if self.data.answer_after_marker and not self.reward.marker.strip():
            raise ValueError("data.answer_after_marker needs a non-empty reward.marker to split the answer at")
        if self.data.task == "max3_chat" and not self.model.path and self.model.tiny_kind != "chat":
            raise ValueError(
                "data.task 'max3_chat' needs a chat model: set model.tiny_kind=chat (the small local chat model) "
                "or model.path to a chat model"
            )
        return self

    @model_validator(mode="after")
    def _agent_alone(self) -> TrainConfig:
        """An agent is a sample's whole story: its episode's reward is the reward (docs/agents.md)."""
        if self.agent.enabled:
            if self.env.enabled:
                raise ValueError("agent and env are both set: a sample is an agent's episode or an environment's")
            if self.reward.functions or self.reward.model.path:
                raise ValueError(
                    "agent: the agent's reward is the episode's reward; reward.functions and reward.model are not "
                    "scored with an agent (remove them, or score inside the agent)"
                )
        return self

    @model_validator(mode="after")
    def _run_can_learn(self) -> TrainConfig:
        """Settings that validate field by field but would crash, stall or learn nothing once the run started."""
        for name, value in (
            ("rollout.max_new_tokens", self.rollout.max_new_tokens),
            ("data.max_prompt_tokens", self.data.max_prompt_tokens),
        ):
            if value > MAX_SEQUENCE_TOKENS:
                raise ValueError(
                    f"{name}={value} is above {MAX_SEQUENCE_TOKENS}, longer than any model's context (the KV cache "
                    f"alone would not fit in memory). Set {name} to what the model supports: data.max_prompt_tokens "
                    "+ rollout.max_new_tokens must fit its config.json max_position_embeddings"
                )
        if self.algorithm.filter_groups and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "algorithm.filter_groups drops groups whose rewards are all equal; with rollout.samples_per_prompt="
                f"{self.rollout.samples_per_prompt} every group of one is 'all equal' and every group would be "
                "dropped. Set rollout.samples_per_prompt to 2 or more, or algorithm.filter_groups to false"
            )
        if self.algorithm.advantage in ("grpo", "rloo") and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"algorithm.advantage '{self.algorithm.advantage}' compares the completions of one prompt with "
                f"each other; with rollout.samples_per_prompt={self.rollout.samples_per_prompt} every advantage is "
                "zero and the run learns nothing. Set rollout.samples_per_prompt to 2 or more (8 is usual)"
            )
        if self.reward.overlong is not None and self.reward.overlong.buffer_len > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong.buffer_len={self.reward.overlong.buffer_len} is more than rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}: the penalty would start before the first token. Lower buffer_len"
            )
        pilot = self.runtime.autopilot
        if pilot.enabled:
            if not pilot.min_staleness <= self.runtime.max_staleness <= pilot.max_staleness:
                raise ValueError(
                    f"runtime.max_staleness={self.runtime.max_staleness} is the autopilot's starting bound and must lie "
                    f"within runtime.autopilot.min_staleness={pilot.min_staleness} and "
                    f"runtime.autopilot.max_staleness={pilot.max_staleness}"
                )
        ranks = self.cluster.trainer_workers
        micros = [("trainer.micro_batch_size", self.trainer.micro_batch_size)]
        if self.algorithm.advantage == "gae":  # the critic is sharded on the same ranks, in its own micro-batches
            micros.append(("critic.micro_batch_size", self.critic.micro_batch_size))
        # each rank trains on its rows (trainer.sharding.rank_rows, sizes differing by at most 1) in as many
        # micro-batches as the widest rank needs: every rank must have a row for each of them
        fewest, widest = self.batch_size // ranks, -(-self.batch_size // ranks)
        for field_name, micro in micros:
            if ranks > 1 and fewest < -(-widest // micro):
                raise ValueError(
                    f"a sharded trainer group cannot split the batch: trainer.prompts_per_step="
                    f"{self.trainer.prompts_per_step} x rollout.samples_per_prompt={self.rollout.samples_per_prompt} "
                    f"= {self.batch_size} rows over cluster.trainer_workers={ranks} ranks leaves a rank {fewest} "
                    f"row(s) for the {-(-widest // micro)} micro-batches of {field_name}={micro} every "
                    f"rank must run together. Make the batch a multiple of {field_name} x "
                    f"cluster.trainer_workers, or raise {field_name}"
                )
        lowest = pilot.min_staleness if pilot.enabled else self.runtime.max_staleness
        bound = "runtime.autopilot.min_staleness" if pilot.enabled else "runtime.max_staleness"
        window = self.trainer.prompts_per_step * (lowest + 1)
        if window < self.rollout.prompts_per_batch:
            raise ValueError(
                f"rollout.prompts_per_batch={self.rollout.prompts_per_batch} is more than trainer.prompts_per_step="
                f"{self.trainer.prompts_per_step} x ({bound}={lowest} + 1) = "
                f"{window}: admission control only lets a worker start a batch that can be consumed within "
                "runtime.max_staleness, so no batch would ever be admitted and the run would stall. Lower "
                f"rollout.prompts_per_batch to at most {window}, or raise trainer.prompts_per_step or {bound}"
            )
        return self

    @property
    def batch_size(self) -> int:
        """Samples per trainer step."""
        return self.trainer.prompts_per_step * self.rollout.samples_per_prompt


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"] if p not in ("function-after",)) or "<root>"
        if path == "<root>" and e["type"] == "value_error":  # a cross-field rule: its message names the fields
            lines.append(str(e["msg"]).removeprefix("Value error, "))
            continue
        value = e.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown field (value {shown})")
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

    >>> cfg = load_config(None, ["algorithm.clip_eps=0.1"])
    >>> cfg.algorithm.clip_eps
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


# Keys that moved or went: each rewrites the raw mapping in place and returns the one line to print (or None).
MIGRATIONS = [_runtime_mode, _restart_limit]


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
