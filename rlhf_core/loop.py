"""The synchronous single-process loop: generate -> reward -> train -> load weights.

Used by tests, by the sync baseline, and by anyone debugging without Ray. `build_run` assembles the
parts every runtime shares (policy, tokenizer, prompts, reward, engine, worker, trainer); the Ray runtime
builds the same parts inside its actors.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from rlhf_core.checkpoint import capture_rng, read_checkpoint, restore_rng, save_checkpoint, load_weights_into
from rlhf_core.config import TrainConfig
from rlhf_core.data import Prompt, PromptSource, build_prompt_splits, collate_prompts
from rlhf_core.models import ensure_policy, load_policy
from rlhf_core.reward import build_reward_fn
from rlhf_core.rollout import RolloutWorker, SamplingParams, build_engine
from rlhf_core.trainer import Trainer, sequence_logprobs
from rlhf_core.types import RolloutBatch

log = logging.getLogger("rlhf_core")

# Reward components that say whether the answer is right, in order of preference, for eval/accuracy.
ACCURACY_COMPONENTS = ("exact_match", "answer_after_marker", "contains")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class RunParts:
    """Everything a run is made of, built once from the config."""

    cfg: TrainConfig
    policy_dir: Path
    model: torch.nn.Module
    tokenizer: object
    train_prompts: list[Prompt]
    heldout_prompts: list[Prompt]
    source: PromptSource
    reward_fn: object
    engine: object
    worker: RolloutWorker
    trainer: Trainer
    history: list[dict] = field(default_factory=list)


def build_run(cfg: TrainConfig, share_weights: bool = True) -> RunParts:
    """Build policy, prompts, reward, engine, worker and trainer. With `share_weights` the engine
    generates with the trainer's own model (lockstep on-policy: loading weights is free); otherwise the
    engine holds a copy that only `load_weights` updates."""
    seed_everything(cfg.trainer.seed)
    torch.set_num_threads(cfg.cluster.torch_threads)
    policy_dir = ensure_policy(cfg.model, cfg.data.task, cfg.run.output_dir, seed=cfg.trainer.seed)
    model, tokenizer = load_policy(policy_dir, dtype=cfg.model.dtype, device=cfg.model.device,
                                   trust_remote_code=cfg.model.trust_remote_code)
    train_prompts, heldout = build_prompt_splits(cfg.data, tokenizer)
    source = PromptSource(train_prompts, seed=cfg.data.seed)
    reward_fn = build_reward_fn(cfg.reward, tokenizer, tokenizer.eos_token_id, cfg.rollout.max_new_tokens)
    engine_model = model if share_weights else copy.deepcopy(model)
    engine = build_engine(cfg, engine_model, tokenizer, model_path=str(policy_dir), seed=cfg.trainer.seed)
    worker = RolloutWorker(engine, reward_fn, SamplingParams.from_config(cfg.rollout), cfg.rollout.samples_per_prompt,
                           tokenizer.pad_token_id, cfg.data.max_prompt_tokens)
    trainer = Trainer(model, cfg, tokenizer.pad_token_id)
    return RunParts(cfg, policy_dir, model, tokenizer, train_prompts, heldout, source, reward_fn, engine, worker, trainer)


def accuracy_from_components(total: torch.Tensor, components: dict[str, torch.Tensor]) -> torch.Tensor:
    """1/0 correctness per row: the first answer-checking component configured, else total reward > 0."""
    for name in ACCURACY_COMPONENTS:
        if name in components:
            return (components[name] > 0).float()
    return (total > 0).float()


@torch.no_grad()
def evaluate(engine, prompts: Sequence[Prompt], reward_fn, pad_token_id: int, max_new_tokens: int,
             batch_size: int = 256, max_prompt_tokens: Optional[int] = None) -> dict:
    """Greedy decoding on held-out prompts: eval/accuracy and eval/reward_mean."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    correct, reward_sum, n = 0.0, 0.0, 0
    for s in range(0, len(prompts), batch_size):
        pb = collate_prompts(prompts[s:s + batch_size], pad_token_id, max_prompt_tokens)
        batch = engine.generate(pb, 1, greedy)
        total, components = reward_fn(batch.response_ids, pb.patterns.to(batch.response_ids.device))
        correct += float(accuracy_from_components(total, components).sum())
        reward_sum += float(total.sum())
        n += len(pb)
    return {"eval/accuracy": correct / max(1, n), "eval/reward_mean": reward_sum / max(1, n)}


def evaluate_parts(parts: RunParts) -> dict:
    return evaluate(parts.engine, parts.heldout_prompts, parts.reward_fn, parts.tokenizer.pad_token_id,
                    parts.cfg.rollout.max_new_tokens, max_prompt_tokens=parts.cfg.data.max_prompt_tokens)


def warm_start(parts: RunParts, steps: int) -> dict:
    """Optional supervised warm start that teaches the answer FORMAT, not the task.

    Each training prompt is paired with an answer drawn uniformly from the set of distinct training
    answers (not its own), followed by EOS, and the policy takes `steps` cross-entropy steps on them. The
    policy learns to emit one well-formed answer and stop, so rewards are not all zero at the start of
    RL, while its accuracy stays at chance (reported as eval/accuracy_warm_start).
    """
    cfg, tok, model = parts.cfg, parts.tokenizer, parts.model
    rng = np.random.default_rng(cfg.trainer.seed + 1)
    answers = sorted({tuple(p.answers[0]) for p in parts.train_prompts if p.answers})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    n = cfg.trainer.prompts_per_step * cfg.rollout.samples_per_prompt
    dev = next(model.parameters()).device
    model.train()
    for _ in range(steps):
        idx = rng.integers(0, len(parts.train_prompts), n)
        prompts = [parts.train_prompts[i] for i in idx]
        pb = collate_prompts(prompts, tok.pad_token_id, cfg.data.max_prompt_tokens)
        targets = [list(answers[j]) + [tok.eos_token_id] for j in rng.integers(0, len(answers), n)]
        L = max(len(t) for t in targets)
        resp = torch.full((n, L), tok.pad_token_id, dtype=torch.long)
        rmask = torch.zeros((n, L), dtype=torch.bool)
        for i, t in enumerate(targets):
            resp[i, :len(t)] = torch.tensor(t)
            rmask[i, :len(t)] = True
        logprobs, _ = sequence_logprobs(model, pb.prompt_ids.to(dev), pb.prompt_mask.to(dev), resp.to(dev), rmask.to(dev))
        loss = -(logprobs * rmask.to(dev)).sum() / rmask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return {"eval/accuracy_warm_start": evaluate_parts(parts)["eval/accuracy"], "warm_start/steps": steps}


def generate_step_batch(parts: RunParts) -> tuple[RolloutBatch, dict]:
    """prompts_per_step prompts, generated in chunks of prompts_per_batch, scored; returns (batch, reward stats)."""
    from rlhf_core.types import cat_rollouts

    prompts = parts.source.next(parts.cfg.trainer.prompts_per_step)
    chunk = parts.cfg.rollout.prompts_per_batch
    batches, comp_sums = [], {}
    for s in range(0, len(prompts), chunk):
        batch, components = parts.worker.rollout(prompts[s:s + chunk])
        batches.append(batch)
        for k, v in components.items():
            comp_sums[k] = comp_sums.get(k, 0.0) + float(v.sum())
    batch = cat_rollouts(batches, parts.tokenizer.pad_token_id)
    return batch, {f"reward/{k}": v / len(batch) for k, v in comp_sums.items()}


def checkpoint_state(parts: RunParts, extra: Optional[dict] = None) -> dict:
    gens = {"engine": parts.engine.generator} if hasattr(parts.engine, "generator") else {}
    return {"trainer": parts.trainer.state_dict(), "data": parts.source.state_dict(), "rng": capture_rng(gens),
            "engine_version": parts.engine.version, **(extra or {})}


def save_run_checkpoint(parts: RunParts, path: str | Path, extra: Optional[dict] = None) -> Path:
    return save_checkpoint(path, parts.model, checkpoint_state(parts, extra))


def restore_run_checkpoint(parts: RunParts, path: str | Path) -> dict:
    """Validate the whole checkpoint first, then restore weights, optimizer, versions, data and RNG."""
    state, weights = read_checkpoint(path, parts.model)
    load_weights_into(parts.model, weights)
    parts.trainer.load_state_dict(state["trainer"])
    parts.source.load_state_dict(state["data"])
    if parts.engine is not None and getattr(parts.engine, "model", None) is not parts.model:
        parts.engine.load_weights(parts.trainer.state_dict_for_sync(), int(state.get("engine_version", parts.trainer.version)))
    else:
        parts.engine.version = int(state.get("engine_version", parts.trainer.version))
    gens = {"engine": parts.engine.generator} if hasattr(parts.engine, "generator") else {}
    restore_rng(state["rng"], gens)
    return state


def run_sync(cfg: TrainConfig, resume_from: Optional[str] = None, on_step: Optional[Callable[[dict], None]] = None,
             parts: Optional[RunParts] = None, checkpoint_dir: Optional[str | Path] = None) -> dict:
    """Train in lockstep for cfg.trainer.total_steps and return the final metrics.

    Returned keys include eval/accuracy_start (held-out accuracy before training; on resume, the value
    recorded at the start of the original run) and eval/accuracy (after training).
    """
    parts = parts or build_run(cfg, share_weights=True)
    ckpt_dir = Path(checkpoint_dir or Path(cfg.run.output_dir) / "checkpoints")
    result: dict = {}
    if resume_from:
        state = restore_run_checkpoint(parts, resume_from)
        result.update(state.get("result", {}))
    else:
        result["eval/accuracy_start"] = evaluate_parts(parts)["eval/accuracy"]
        if cfg.trainer.warm_start_steps:
            result.update(warm_start(parts, cfg.trainer.warm_start_steps))
    start = time.perf_counter()
    trainer = parts.trainer
    saved_step = trainer.step
    while trainer.step < cfg.trainer.total_steps:
        t0 = time.perf_counter()
        batch, reward_stats = generate_step_batch(parts)
        t1 = time.perf_counter()
        metrics = trainer.train_step(batch)
        t2 = time.perf_counter()
        shared = getattr(parts.engine, "model", None) is parts.model  # lockstep: the engine already has them
        parts.worker.load_weights(None if shared else trainer.state_dict_for_sync(), trainer.version)
        metrics.update(reward_stats)
        metrics.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1,
                        "throughput/samples_per_s": len(batch) / (t2 - t0),
                        "throughput/tokens_per_s": batch.num_tokens / (t2 - t0), "step": trainer.step})
        if cfg.tracking.eval_every and trainer.step % cfg.tracking.eval_every == 0 and trainer.step < cfg.trainer.total_steps:
            metrics.update(evaluate_parts(parts))
        parts.history.append(metrics)
        if on_step:
            on_step(metrics)
        if cfg.tracking.checkpoint_every and trainer.step % cfg.tracking.checkpoint_every == 0:
            save_run_checkpoint(parts, ckpt_dir / f"step_{trainer.step:06d}", {"result": result})
            saved_step = trainer.step
        if trainer.consecutive_skips >= cfg.supervision.nonfinite_limit:
            raise RuntimeError(f"{trainer.consecutive_skips} consecutive non-finite trainer steps (limit "
                               f"supervision.nonfinite_limit={cfg.supervision.nonfinite_limit}); stopping")
    if trainer.step != saved_step:  # tracking.checkpoint_every=0 means "only at the end"
        save_run_checkpoint(parts, ckpt_dir / f"step_{trainer.step:06d}", {"result": result})
    result.update(parts.history[-1] if parts.history else {})
    result.update(evaluate_parts(parts))
    result["time/train_wall_s"] = time.perf_counter() - start
    result["steps"] = trainer.step
    return result
