"""One place that builds a run's parts from its config, in whichever process needs them.

The single-process loop, the rollout and trainer actors, and `atrlhf evaluate` all build their model,
tokenizer, prompts, reward, engine, evaluator and trainer here, so that a new option (a reward source, an
EOS set, LoRA) is added once and behaves the same everywhere.
"""

from __future__ import annotations

import copy
import random
import threading
from pathlib import Path

import numpy as np
import torch

from rlhf_core.config import TrainConfig
from rlhf_core.data import Prompt, build_prompt_splits
from rlhf_core.model.lora import adapter_state_dict, apply_lora
from rlhf_core.model.policy import ensure_policy, load_policy, load_tokenizer, stop_token_ids
from rlhf_core.reward.components import build_reward_fn
from rlhf_core.reward.functions.external import PythonFunctionRewards
from rlhf_core.reward.model import LocalRewardModel, RewardModelScorer
from rlhf_core.reward.overlong import OverlongPenalty
from rlhf_core.rollout import HFEngine, RolloutWorker, SamplingParams, build_engine
from rlhf_core.rollout import probe as sync_probe
from rlhf_core.rollout.probe import SyncCheck
from rlhf_core.run.checkpoint import export_policy
from rlhf_core.run.evaluation import Evaluator
from rlhf_core.trainer import Trainer

ROLLOUT_SEED_STRIDE = 1000  # rollout worker i samples with seed trainer.seed + 1000 * i


def setup_process(cfg: TrainConfig, seed: int) -> None:
    """Thread count and global RNGs of a process that is about to build run parts."""
    torch.set_num_threads(cfg.cluster.torch_threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rollout_seed(cfg: TrainConfig, worker_index: int | None) -> int:
    """Sampling seed of rollout worker `worker_index` (None: the single-process loop's one engine). Worker 0
    samples with the loop's seed, so that one worker at max_staleness 0 draws the loop's samples (the tau = 0
    invariant); worker i > 0 with trainer.seed + 1000 * i."""
    return cfg.trainer.seed + ROLLOUT_SEED_STRIDE * (worker_index or 0)


def resolve_policy_dir(cfg: TrainConfig) -> Path:
    """The policy directory: model.path, or the tiny default built once under run.output_dir."""
    with _BUILDING:  # the tiny default is built here
        return Path(ensure_policy(cfg.model, cfg.data.task, cfg.run.output_dir, seed=cfg.trainer.seed)).resolve()


def build_tokenizer(cfg: TrainConfig, policy_dir: str | Path):
    return load_tokenizer(policy_dir, trust_remote_code=cfg.model.trust_remote_code)


# one policy built at a time in a process: transformers' loading swaps process-wide state (the meta device, the
# init functions), so that two runs building in threads of one process (a sweep's points on the threads host, a
# shared fleet's pinned evaluations) would see each other's ("Cannot copy out of meta tensor")
_BUILDING = threading.RLock()


def build_policy(cfg: TrainConfig, policy_dir: str | Path, adapters: bool = True):
    """(model, tokenizer) from the policy directory, with the config's dtype and device; with model.lora (and
    `adapters`) wrapped with its LoRA adapters (rlhf_core.model.lora), the same in every process so that adapter
    names agree between the trainer, the rollout engines and checkpoints."""
    with _BUILDING:
        model, tokenizer = load_policy(
            policy_dir, dtype=cfg.model.dtype, device=cfg.model.device, trust_remote_code=cfg.model.trust_remote_code
        )
        if adapters and cfg.model.lora is not None:
            model = apply_lora(model, cfg.model.lora)
    return model, tokenizer


def build_prompts(cfg: TrainConfig, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts, tokenized."""
    return build_prompt_splits(cfg.data, tokenizer, reward_cfg=cfg.reward)


def build_stop_ids(cfg: TrainConfig, tokenizer, policy_dir: str | Path) -> list[int]:
    """The one stop set: generation_config.json's eos ids, the tokenizer's EOS and rollout.stop_token_ids.
    Engines, rewards and evaluation all end a response at the first of these."""
    return stop_token_ids(policy_dir, tokenizer, cfg.rollout.stop_token_ids)


def build_reward(cfg: TrainConfig, tokenizer, stop_ids: list[int]):
    """The configured tensor-native reward: (response_ids, patterns) -> (total [N], components)."""
    return build_reward_fn(cfg.reward, tokenizer, stop_ids, cfg.rollout.max_new_tokens)


def build_reward_functions(cfg: TrainConfig, tokenizer, stop_ids: list[int]) -> PythonFunctionRewards:
    """reward.functions in their process pool, stopping the run at supervision.max_consecutive_failures."""
    return PythonFunctionRewards(cfg.reward, tokenizer, stop_ids, cfg.supervision.max_consecutive_failures)


def build_external_rewards(cfg: TrainConfig, tokenizer, stop_ids: list[int], reward_model=None) -> list:
    """The rewards scored beside the tensor-native one, on the rollout side (`RolloutWorker`'s contract), in
    the column order of `RewardConfig.column_names()`: reward.functions (Python functions in a process pool,
    rlhf_core.reward.functions.external), then the reward model when reward.model.path is set, scored in this
    process or through `reward_model` (an external reward over the same scorer elsewhere: the Ray runtime's
    reward-model actor); then reward.overlong's length penalty (rlhf_core.reward.overlong). Each has `weights`
    and `score(prompts, batch)`."""
    external = []
    if cfg.reward.functions:
        external.append(build_reward_functions(cfg, tokenizer, stop_ids))
    if cfg.reward.model.path:
        if reward_model is None:
            reward_model = LocalRewardModel(
                RewardModelScorer(cfg.reward.model, tokenizer, stop_ids, trust_remote_code=cfg.model.trust_remote_code)
            )
        external.append(reward_model)
    if cfg.reward.overlong is not None:
        overlong = cfg.reward.overlong
        external.append(OverlongPenalty(cfg.rollout.max_new_tokens, overlong.buffer_len, overlong.penalty))
    return external


def build_rollout_worker(
    cfg: TrainConfig,
    model,
    tokenizer,
    policy_dir: str | Path,
    seed: int,
    reward_fn=None,
    reward_model=None,
    engine=None,
) -> RolloutWorker:
    """The configured engine over `model`, its rewards and sampling settings, all with the one stop set.
    `reward_model`: the reward model as an external reward scored elsewhere (the Ray runtime's actor); None
    scores it in this process when reward.model.path is set. `engine`: an engine built elsewhere (a shared
    fleet's view of one adapter), `model` then unused."""
    stop_ids = build_stop_ids(cfg, tokenizer, policy_dir)
    if engine is None:
        model = rollout_model(cfg, model)
        engine = build_engine(cfg, model, tokenizer, model_path=str(policy_dir), seed=seed, stop_token_ids=stop_ids)
    return RolloutWorker(
        engine,
        reward_fn or build_reward(cfg, tokenizer, stop_ids),
        SamplingParams.from_config(cfg.rollout),
        cfg.rollout.samples_per_prompt,
        tokenizer.pad_token_id,
        cfg.data.max_prompt_tokens,
        component_names=cfg.reward.column_names() + cfg.env.column_names() + cfg.agent.column_names(),
        external=build_external_rewards(cfg, tokenizer, stop_ids, reward_model=reward_model),
        env=build_env_runner(cfg, tokenizer, stop_ids, policy_dir),
        agent=build_agent_runner(cfg, tokenizer, stop_ids, policy_dir),
        sync_check=build_sync_check(cfg),
    )


def build_policy_engine(cfg: TrainConfig, model, tokenizer, policy_dir: str | Path, from_checkpoint: bool):
    """The engine rollout.engine names over a policy to evaluate or serve (`atrlhf evaluate`, `atrlhf serve`): the
    HF engine over `model`; vLLM loads policy_dir and, where a checkpoint's weights (or LoRA adapters) were loaded
    into `model` (`from_checkpoint`), takes them as a weight sync does, checked by the sync probe (SyncCheckError
    where the engine does not compute the model's log-probs)."""
    stop_ids = build_stop_ids(cfg, tokenizer, policy_dir)
    engine_model = rollout_model(cfg, model)
    engine = build_engine(
        cfg, engine_model, tokenizer, model_path=str(policy_dir), seed=cfg.trainer.seed, stop_token_ids=stop_ids
    )
    if from_checkpoint and not isinstance(engine, HFEngine):
        if cfg.model.lora is not None:
            weights = adapter_state_dict(model)
        else:
            named = list(model.named_parameters()) + list(model.named_buffers())
            weights = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named}
        weights, probe = sync_probe.split(sync_probe.attach(weights, model))
        engine.load_weights(weights, 1)
        SyncCheck("fail").check(engine, probe, 1, f"rollout.engine {cfg.rollout.engine!r}")
    return engine


def build_sync_check(cfg: TrainConfig) -> SyncCheck:
    """supervision.sync_check (a tolerance of None: by the engine's dtype, `SyncCheck`)."""
    return SyncCheck(cfg.supervision.sync_check.action, cfg.supervision.sync_check.tolerance)


def rollout_casts(cfg: TrainConfig, model) -> bool:
    """Whether rollout.engine_kwargs.dtype asks the HF engine for another dtype than `model`'s parameters."""
    from rlhf_core.model.policy import resolve_dtype

    name = cfg.rollout.engine_option("dtype")
    dtype = resolve_dtype(name) if name else None
    return dtype is not None and cfg.rollout.engine == "hf" and next(model.parameters()).dtype != dtype


def rollout_model(cfg: TrainConfig, model):
    """The rollout engine's model: `model` itself, or with rollout.engine_kwargs.dtype a copy whose parameters are
    in that dtype (a LoRA model's adapters too; buffers such as rotary frequencies keep theirs, as
    from_pretrained(dtype=) leaves them). Syncs copy the trainer's tensors into it, cast on load
    (HFEngine.load_weights: copy_)."""
    if not rollout_casts(cfg, model):
        return model
    from rlhf_core.model.policy import resolve_dtype

    dtype = resolve_dtype(cfg.rollout.engine_option("dtype"))
    engine_model = copy.deepcopy(model).eval()
    with torch.no_grad():
        for param in engine_model.parameters():  # tied weights are one Parameter: cast once
            param.data = param.data.to(dtype)
    return engine_model


def build_env_runner(cfg: TrainConfig, tokenizer, stop_ids: list[int], policy_dir: str | Path = "model"):
    """The multi-turn environment's runner (its process pool: env.workers processes) when
    env.name or env.tools is set, else None."""
    if not cfg.env.enabled:
        return None
    from rlhf_core.rollout.multiturn import EnvRunner

    limit = cfg.supervision.max_consecutive_failures
    return EnvRunner(cfg.env, tokenizer, stop_ids, where=str(policy_dir), max_failures=limit)


def build_agent_runner(cfg: TrainConfig, tokenizer, stop_ids: list[int], policy_dir: str | Path = "model"):
    """The agent's runner and its OpenAI-compatible endpoint (rlhf_core.agent) when agent.name is set, else
    None."""
    if not cfg.agent.enabled:
        return None
    from rlhf_core.agent.runner import AgentRunner

    return AgentRunner(
        cfg.agent,
        tokenizer,
        stop_ids,
        model_name=Path(policy_dir).name or "policy",
        max_context=cfg.env.max_total_tokens,
        max_failures=cfg.supervision.max_consecutive_failures,
    )


def build_evaluator(
    cfg: TrainConfig,
    model,
    tokenizer,
    policy_dir: str | Path,
    heldout: list[Prompt],
    reward_fn=None,
    engine=None,
    env=None,
    functions=None,
) -> Evaluator:
    """Held-out evaluation of `model` (through `engine` when given, else an HF engine over `model`): greedy
    eval/accuracy, and eval/pass@k and eval/mean@k when cfg.eval.n_samples > 0; with an environment, its
    episodes run greedily (`env`: the rollout worker's runner to share, else one of its own). The reward
    functions score the held-out answers where evaluation needs them (`evaluation_needs_functions`):
    `functions`, the rollout worker's `PythonFunctionRewards` to share, else a pool of its own (closed by
    `Evaluator.close`)."""
    stop_ids = build_stop_ids(cfg, tokenizer, policy_dir)
    if env is None:
        env = build_env_runner(cfg, tokenizer, stop_ids, policy_dir)
    engine = engine or HFEngine(model, stop_ids, tokenizer.pad_token_id, seed=cfg.trainer.seed)
    if cfg.agent.enabled:  # the agent's episodes, greedy, on an endpoint of the evaluator's own
        from rlhf_core.agent.runner import AgentEvaluator

        runner = build_agent_runner(cfg, tokenizer, stop_ids, policy_dir)
        return AgentEvaluator(runner, engine, heldout, cfg.rollout.max_new_tokens)
    external, owns = (), False
    if evaluation_needs_functions(cfg) and env is None:
        owns = functions is None
        external = [functions if functions is not None else build_reward_functions(cfg, tokenizer, stop_ids)]
    return Evaluator(
        engine,
        heldout,
        reward_fn or build_reward(cfg, tokenizer, stop_ids),
        tokenizer.pad_token_id,
        cfg.rollout.max_new_tokens,
        cfg.data.max_prompt_tokens,
        eval_cfg=cfg.eval,
        seed=cfg.trainer.seed,
        env=env,
        external=external,
        owns_external=owns,
    )


def evaluation_needs_functions(cfg: TrainConfig) -> bool:
    """Whether held-out evaluation scores with reward.functions: eval.metric names one of their columns, or
    the reward has no component (the functions are then the whole reward; eval/accuracy: a total above 0)."""
    if not cfg.reward.functions:
        return False
    return cfg.eval.metric in cfg.reward.function_column_names() or not cfg.reward.components


def build_trainer(cfg: TrainConfig, model, tokenizer, policy_dir: str | Path | None = None, group=None) -> Trainer:
    """The Trainer of `model` with the run's stop set (algorithm.mask_truncated) and, for algorithm.advantage
    'gae', its critic (critic.path, or the policy's architecture and weights from `policy_dir` with a value
    head). policy_dir: where the policy was loaded from (default: the tokenizer's directory). group: the
    process group of a sharded trainer (every rank builds its Trainer here: the policy and the critic are
    sharded on it)."""
    policy_dir = Path(policy_dir if policy_dir is not None else tokenizer.name_or_path)
    stop_ids = build_stop_ids(cfg, tokenizer, policy_dir)
    critic = build_critic(cfg, model, policy_dir, group=group)
    return Trainer(model, cfg, tokenizer.pad_token_id, group=group, stop_ids=stop_ids, critic=critic)


def build_critic(cfg: TrainConfig, model, policy_dir: str | Path, group=None):
    """The critic of algorithm.advantage 'gae' on the policy's device (None for the other estimators);
    sharded on `group` (a sharded trainer's) when given."""
    if not cfg.algorithm.advantage_spec.critic:
        return None
    from rlhf_core.model.policy import resolve_dtype
    from rlhf_core.trainer.critic import Critic, load_value_model

    path = cfg.critic.path or policy_dir
    device = next(model.parameters()).device
    with _BUILDING:
        value_model = load_value_model(path, resolve_dtype(cfg.model.dtype), device, cfg.model.trust_remote_code)
    return Critic(value_model, cfg, group=group)


def export_run_policy(cfg: TrainConfig, model, tokenizer, path: str | Path) -> Path:
    """The trained policy exported to `path` (rlhf_core.run.checkpoint.export_policy): a Hugging Face model
    directory; with LoRA the PEFT adapter under adapter/ and, when model.lora.export_merged, the merged model."""
    merged = cfg.model.lora is None or cfg.model.lora.export_merged
    return export_policy(model, tokenizer, cfg.model_dump(mode="json"), path, merged=merged)
