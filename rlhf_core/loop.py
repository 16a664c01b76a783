"""The synchronous single-process loop: generate -> reward -> train -> load weights.

Used by tests, by the sync baseline, and by anyone debugging without Ray. Its parts come from
`rlhf_core.build` (as the Ray actors' do), prompts from the same `PromptQueue` the Ray runtime serves, and
its checkpoints have the one layout of `rlhf_core.checkpoint`: a run of either kind resumes from the
other's checkpoint.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from rlhf_core import build
from rlhf_core.checkpoint import (
    CheckpointError,
    CheckpointState,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from rlhf_core.checkpoint import checkpoint_dir as step_checkpoint_dir  # run_sync's argument has the name
from rlhf_core.config import TrainConfig
from rlhf_core.data import Prompt
from rlhf_core.data.queue import PromptQueue
from rlhf_core.evaluation import Evaluator
from rlhf_core.preflight import check_lengths, check_output_dir
from rlhf_core.rollout import RolloutWorker
from rlhf_core.trainer import Trainer
from rlhf_core.types import RolloutBatch, cat_rollouts
from rlhf_core.warm_start import warm_start as run_warm_start

log = logging.getLogger("rlhf_core")


@dataclass
class RunParts:
    """Everything a single-process run is made of, built once from the config."""

    cfg: TrainConfig
    policy_dir: Path
    model: torch.nn.Module
    tokenizer: object
    train_prompts: list[Prompt]
    heldout_prompts: list[Prompt]
    prompts: PromptQueue
    reward_fn: object
    engine: object
    worker: RolloutWorker
    trainer: Trainer
    evaluator: Evaluator
    history: list[dict] = field(default_factory=list)
    # prompt uid -> times consumed (trained on, or generated and filtered out): in every checkpoint, so that a
    # resume serves each prompt of an epoch exactly once, as the Ray runtime's checkpoints do
    trained: dict[int, int] = field(default_factory=dict)

    @property
    def shares_weights(self) -> bool:
        """Whether the engine generates with the trainer's own model (loading weights is then free)."""
        return getattr(self.engine, "model", None) is self.model


def build_run(cfg: TrainConfig, share_weights: bool = True) -> RunParts:
    """Build policy, prompts, reward, engine, worker, trainer and evaluator. With `share_weights` the engine
    generates with the trainer's own model (lockstep on-policy: loading weights is free); otherwise the
    engine holds a copy that only `load_weights` updates."""
    build.setup_process(cfg, cfg.trainer.seed)
    check_output_dir(cfg.run.output_dir)
    policy_dir = build.resolve_policy_dir(cfg)
    model, tokenizer = build.build_policy(cfg, policy_dir)
    train_prompts, heldout = build.build_prompts(cfg, tokenizer)
    check_lengths(policy_dir, cfg, train_prompts + heldout)
    reward_fn = build.build_reward(cfg, tokenizer, build.build_stop_ids(cfg, tokenizer, policy_dir))
    engine_model = model if share_weights else copy.deepcopy(model)
    worker = build.build_rollout_worker(
        cfg, engine_model, tokenizer, policy_dir, build.rollout_seed(cfg, None), reward_fn=reward_fn
    )
    trainer = build.build_trainer(cfg, model, tokenizer, policy_dir)
    evaluator = build.build_evaluator(
        cfg, model, tokenizer, policy_dir, heldout, reward_fn=reward_fn, engine=worker.engine, env=worker.env
    )
    return RunParts(
        cfg,
        policy_dir,
        model,
        tokenizer,
        train_prompts,
        heldout,
        PromptQueue(train_prompts, cfg.data.seed),
        reward_fn,
        worker.engine,
        worker,
        trainer,
        evaluator,
    )


def evaluate_parts(parts: RunParts) -> dict:
    return parts.evaluator()


def warm_start(parts: RunParts, steps: int) -> dict:
    """The supervised format warm start (rlhf_core.warm_start) on the trainer's model, then its held-out
    accuracy as eval/accuracy_warm_start."""
    metrics = run_warm_start(parts.model, parts.tokenizer, parts.train_prompts, parts.cfg, steps)
    if not parts.shares_weights:
        parts.engine.load_weights(parts.trainer.state_dict_for_sync(), parts.trainer.version)
    return {**metrics, "eval/accuracy_warm_start": evaluate_parts(parts)["eval/accuracy"]}


def generate_step_batch(parts: RunParts) -> tuple[RolloutBatch, dict]:
    """prompts_per_step prompts, generated in chunks of prompts_per_batch, scored; returns (batch, reward stats).

    With algorithm.filter_groups (DAPO's dynamic sampling) groups whose rewards are all equal are dropped and
    the step is filled from further rounds of prompts_per_step groups, at most algorithm.filter_max_rounds
    rounds; a step still short trains on the groups it kept (on the last round's groups when none passed).
    The stats then include buffer/filtered_groups_frac (filtered groups over generated ones)."""
    cfg = parts.cfg
    need, G = cfg.trainer.prompts_per_step, cfg.rollout.samples_per_prompt
    comp_sums: dict = {}
    comp_rows: dict = {}
    rounds = cfg.algorithm.filter_max_rounds if cfg.algorithm.filter_groups else 1
    kept: list[RolloutBatch] = []
    n_kept = generated = filtered = 0
    batch = None
    for _ in range(rounds):
        batch = _generate(parts, need, comp_sums, comp_rows)
        if not cfg.algorithm.filter_groups:
            break
        rewards = batch.rewards.view(-1, G)
        informative = ~(rewards == rewards[:, :1]).all(dim=1)  # all-equal rewards: no signal under group advantages
        generated += rewards.shape[0]
        filtered += rewards.shape[0] - int(informative.sum())
        keep_rows = informative.repeat_interleave(G).nonzero().squeeze(1)
        take = min(int(informative.sum()), need - n_kept)
        if take:
            kept.append(batch.select(keep_rows[: take * G].to(batch.response_ids.device)))
            n_kept += take
        if n_kept >= need:
            break
    # a trajectory's env/* columns keep their names (env/turns_mean, ...); the others are reward/<column>
    stats = {
        (k if k.startswith("env/") else f"reward/{k}"): v / comp_rows[k] for k, v in comp_sums.items() if comp_rows[k]
    }
    if parts.worker.env is not None:
        stats["env/errors"] = float(parts.worker.env.errors)  # failed trajectories in the run so far
    if cfg.algorithm.filter_groups:
        stats["buffer/filtered_groups_frac"] = filtered / generated if generated else 0.0
        batch = cat_rollouts(kept, parts.tokenizer.pad_token_id) if kept else batch
    return batch, stats


def _generate(parts: RunParts, n_groups: int, comp_sums: dict, comp_rows: dict) -> RolloutBatch:
    """n_groups scored groups, generated in chunks of prompts_per_batch; adds each reward column's sum and row
    count (NaN: an external score that does not apply to the row; with an environment also its env/* columns)
    to comp_sums / comp_rows."""
    cfg = parts.cfg
    chunk = cfg.rollout.prompts_per_batch
    G = cfg.rollout.samples_per_prompt
    batches = []
    groups = 0
    # a multi-turn environment leaves out the groups with a failed trajectory: generate until the step has
    # its groups (env.max_consecutive_failures stops a run whose environment keeps failing)
    while groups < n_groups:
        prompts = parts.prompts.get(n_groups - groups)
        for p in prompts:  # nothing stays in flight past the step: every prompt served is consumed by it
            parts.trained[p.uid] = parts.trained.get(p.uid, 0) + 1
        if getattr(parts.engine, "continuous_batching", False) and parts.worker.env is None:
            # one call: the engine keeps rollout.max_active_rows rows decoding and starts waiting rows as rows end
            chunk = max(1, len(prompts))
        for s in range(0, len(prompts), chunk):
            batch, components = parts.worker.rollout(prompts[s : s + chunk])
            batches.append(batch)
            groups += len(batch) // G
            for k, v in components.items():  # NaN: an external score that does not apply to the row
                comp_sums[k] = comp_sums.get(k, 0.0) + float(v.float().nansum())
                comp_rows[k] = comp_rows.get(k, 0) + int((~v.float().isnan()).sum())
    return cat_rollouts([b for b in batches if len(b)], parts.tokenizer.pad_token_id)


def save_run_checkpoint(parts: RunParts, path: str | Path, run: Optional[dict] = None) -> Path:
    """The one checkpoint layout; the engine's sampling RNG is rollout engine 0's."""
    state = CheckpointState(
        trainer=parts.trainer.state_dict(),
        data={**parts.prompts.state_dict(), "trained": dict(parts.trained)},
        rng={
            "trainer": capture_rng(),
            "rollout": [parts.engine.generator.get_state()] if hasattr(parts.engine, "generator") else [],
        },
        run=dict(run or {}),
        config=parts.cfg.model_dump(mode="json"),
    )
    return save_checkpoint(path, parts.model, state)


def export_run(parts: RunParts, path: str | Path) -> Path:
    """The trained policy exported as the Ray runtime exports it (build.export_run_policy)."""
    return build.export_run_policy(parts.cfg, parts.model, parts.tokenizer, path)


def restore_run_checkpoint(parts: RunParts, path: str | Path) -> CheckpointState:
    """Validate the whole checkpoint first, then restore weights, optimizer, versions, data and RNG.

    A checkpoint from the Ray runtime restores here too: its first rollout worker's RNG seeds the engine,
    and prompts it had queued are served first."""
    state = load_checkpoint(path, parts.model, critic=parts.trainer.critic)
    parts.trainer.load_state_dict(state.trainer)
    parts.trained = parts.prompts.load_state_dict(state.data)
    if not parts.shares_weights:
        parts.engine.load_weights(parts.trainer.state_dict_for_sync(), parts.trainer.version)
    parts.engine.version = parts.trainer.version
    restore_rng(state.rng["trainer"])
    if state.rng.get("rollout") and state.rng["rollout"][0] is not None and hasattr(parts.engine, "generator"):
        parts.engine.generator.set_state(state.rng["rollout"][0])
    return state


def run_sync(
    cfg: TrainConfig,
    resume_from: Optional[str] = None,
    on_step: Optional[Callable[[dict], None]] = None,
    parts: Optional[RunParts] = None,
    checkpoint_dir: Optional[str | Path] = None,
) -> dict:
    """Train in lockstep for cfg.trainer.total_steps and return the final metrics.

    Returned keys include eval/accuracy_start (held-out accuracy before training; on resume, the value
    recorded at the start of the original run) and eval/accuracy (after training).
    """
    parts = parts or build_run(cfg, share_weights=True)
    ckpt_root = Path(checkpoint_dir) if checkpoint_dir else None  # None: <run_dir>/checkpoints
    run_facts: dict = {}
    if resume_from:
        run_facts.update(restore_run_checkpoint(parts, resume_from).run)
        if parts.trainer.step >= cfg.trainer.total_steps:
            raise CheckpointError(
                f"{resume_from} holds step {parts.trainer.step}, which already reaches trainer.total_steps="
                f"{cfg.trainer.total_steps}: nothing to train; raise trainer.total_steps to continue"
            )
    else:
        run_facts["eval_start"] = evaluate_parts(parts)["eval/accuracy"]
        if cfg.trainer.warm_start_steps:
            run_facts.update(warm_start(parts, cfg.trainer.warm_start_steps))
    start = time.perf_counter()
    trainer = parts.trainer
    saved_step = trainer.step
    while trainer.step < cfg.trainer.total_steps:
        t0 = time.perf_counter()
        batch, reward_stats = generate_step_batch(parts)
        t1 = time.perf_counter()
        metrics = trainer.train_step(batch)
        t2 = time.perf_counter()
        parts.worker.load_weights(None if parts.shares_weights else trainer.state_dict_for_sync(), trainer.version)
        metrics.update(reward_stats)
        metrics.update(
            {
                "time/rollout_s": t1 - t0,
                "time/train_s": t2 - t1,
                "throughput/samples_per_s": len(batch) / (t2 - t0),
                "throughput/tokens_per_s": batch.num_tokens / (t2 - t0),
                "step": trainer.step,
            }
        )
        if (
            cfg.tracking.eval_every
            and trainer.step % cfg.tracking.eval_every == 0
            and trainer.step < cfg.trainer.total_steps
        ):
            metrics.update(evaluate_parts(parts))
        parts.history.append(metrics)
        if on_step:
            on_step(metrics)
        if cfg.tracking.checkpoint_every and trainer.step % cfg.tracking.checkpoint_every == 0:
            save_run_checkpoint(parts, step_checkpoint_dir(cfg.run.run_dir, trainer.step, under=ckpt_root), run_facts)
            saved_step = trainer.step
        if trainer.consecutive_skips >= cfg.supervision.nonfinite_limit:
            raise RuntimeError(
                f"{trainer.consecutive_skips} consecutive non-finite trainer steps (limit "
                f"supervision.nonfinite_limit={cfg.supervision.nonfinite_limit}); stopping"
            )
    if trainer.step != saved_step:  # tracking.checkpoint_every=0 means "only at the end"
        save_run_checkpoint(parts, step_checkpoint_dir(cfg.run.run_dir, trainer.step, under=ckpt_root), run_facts)
    result = {k: v for k, v in run_facts.items() if k != "eval_start"}
    result["eval/accuracy_start"] = run_facts.get("eval_start")
    result.update(parts.history[-1] if parts.history else {})
    result.update(evaluate_parts(parts))
    result["time/train_wall_s"] = time.perf_counter() - start
    result["steps"] = trainer.step
    return result
