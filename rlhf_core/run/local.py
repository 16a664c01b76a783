"""The in-process host: both roles' cycles (`rlhf_core.run.roles`) in one process, no Ray.

The peers are the plain control objects (`ExperienceBuffer`, `WeightStore`, `PromptQueue`), called directly;
the rollout engine generates with the trainer's own model (publishing is then only the version: loading
weights is free) unless `share_weights=False`. `run_sync` drives the cycles in lockstep in one thread: the
rollout role generates while admission lets it (at runtime.max_staleness 0, exactly one step's groups), the
trainer role takes and trains. DAPO filtering, the filter rounds, environment refills and the prompt
accounting are the buffer's and the roles', as on Ray; checkpoints are the trainer role's, so either host
resumes the other's.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.config import TrainConfig
from rlhf_core.data import Prompt
from rlhf_core.data.queue import PromptQueue, queue_options
from rlhf_core.reward.functions.external import PythonFunctionRewards
from rlhf_core.rollout import RolloutWorker
from rlhf_core.run import build
from rlhf_core.run.checkpoint import CheckpointState
from rlhf_core.run.control import ExperienceBuffer, buffer_options
from rlhf_core.run.evaluation import Evaluator
from rlhf_core.run.peers import LocalPeer, LocalWeights, shared_model_snapshot
from rlhf_core.run.preflight import check_lengths, check_output_dir
from rlhf_core.run.roles import RolloutRole, TrainerRole
from rlhf_core.run.warm_start import warm_start as run_warm_start
from rlhf_core.supervision import SupervisionError
from rlhf_core.trainer import Trainer
from rlhf_core.types import RolloutBatch, cat_rollouts

log = logging.getLogger("rlhf_core")


@dataclass
class RunParts:
    """Everything an in-process run is made of, built once from the config."""

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
    buffer: ExperienceBuffer = None
    trainer_role: TrainerRole = None
    rollout_role: RolloutRole = None
    history: list[dict] = field(default_factory=list)

    @property
    def shares_weights(self) -> bool:
        """Whether the engine generates with the trainer's own model (loading weights is then free)."""
        return getattr(self.engine, "model", None) is self.model

    @property
    def trained(self) -> dict[int, int]:
        """prompt uid -> times trained on (in every checkpoint: a resume serves each prompt of an epoch once)."""
        return self.trainer_role.trained

    def peer_state(self) -> tuple[dict, list]:
        """(prompt queue state, [the engine's sampling RNG]) for a checkpoint (rollout engine 0's, as on Ray)."""
        rng = [self.engine.generator.get_state()] if hasattr(self.engine, "generator") else []
        return self.prompts.state_dict(), rng


def build_run(cfg: TrainConfig, share_weights: bool = True, checkpoint_root: Optional[str | Path] = None) -> RunParts:
    """Build policy, prompts, reward, engine, worker, trainer, evaluator and the two roles around them. With
    `share_weights` the engine generates with the trainer's own model (lockstep on-policy: loading weights is
    free); otherwise the engine holds a copy that only published weights update."""
    build.setup_process(cfg, cfg.trainer.seed)
    check_output_dir(cfg.run.output_dir)
    policy_dir = build.resolve_policy_dir(cfg)
    model, tokenizer = build.build_policy(cfg, policy_dir)
    train_prompts, heldout = build.build_prompts(cfg, tokenizer)
    check_lengths(policy_dir, cfg, train_prompts + heldout)
    reward_fn = build.build_reward(cfg, tokenizer, build.build_stop_ids(cfg, tokenizer, policy_dir))
    share_weights = share_weights and not build.rollout_casts(
        cfg, model
    )  # rollout.engine_kwargs.dtype: the engine's own copy
    engine_model = model if share_weights else copy.deepcopy(model)
    worker = build.build_rollout_worker(
        cfg, engine_model, tokenizer, policy_dir, build.rollout_seed(cfg, None), reward_fn=reward_fn
    )
    trainer = build.build_trainer(cfg, model, tokenizer, policy_dir)
    evaluator = build.build_evaluator(
        cfg,
        model,
        tokenizer,
        policy_dir,
        heldout,
        reward_fn=reward_fn,
        engine=worker.engine,
        env=worker.env,
        functions=next((e for e in worker.external if isinstance(e, PythonFunctionRewards)), None),
    )
    buffer = ExperienceBuffer(**buffer_options(cfg))
    parts = RunParts(
        cfg, policy_dir, model, tokenizer, train_prompts, heldout, PromptQueue(train_prompts, **queue_options(cfg)),
        reward_fn, worker.engine, worker, trainer, evaluator, buffer,
    )  # fmt: skip
    store = LocalWeights()
    parts.trainer_role = TrainerRole(
        cfg,
        trainer,
        tokenizer,
        LocalPeer(buffer),
        store,
        snapshot=shared_model_snapshot if share_weights else None,
        peer_state=parts.peer_state,
        checkpoint_root=checkpoint_root,
    )
    parts.rollout_role = RolloutRole(cfg, worker, LocalPeer(buffer), LocalPeer(parts.prompts), store)
    return parts


def evaluate_parts(parts: RunParts) -> dict:
    return parts.evaluator()


def _publish_now(parts: RunParts) -> None:
    """The trainer's current weights to the store and the buffer (after a warm start or a restore)."""
    parts.buffer.start_at(parts.trainer.version)
    parts.trainer_role.publish()
    parts.rollout_role.adopt_weights()
    parts.engine.version = parts.trainer.version


def warm_start(parts: RunParts, steps: int) -> dict:
    """The supervised format warm start (rlhf_core.run.warm_start) on the trainer's model, then its held-out
    accuracy as eval/accuracy_warm_start."""
    metrics = run_warm_start(parts.model, parts.tokenizer, parts.train_prompts, parts.cfg, steps)
    _publish_now(parts)
    return {**metrics, "eval/accuracy_warm_start": evaluate_parts(parts)["eval/accuracy"]}


def lockstep_step(parts: RunParts, stall_s: Optional[float] = None) -> dict:
    """One trainer step in one thread: the rollout role generates while admission lets it and the step's batch
    is not complete, then the trainer role takes, trains, publishes and checkpoints when due. `stall_s`: batches
    generated for longer than this without a complete step stop the run (SupervisionError naming the buffer's
    counts: e.g. every group refused or evicted), as the supervision's stall check does on the other hosts."""
    t0 = time.perf_counter()
    role, total = parts.trainer_role, parts.cfg.trainer.total_steps
    while True:
        m = role.step(0.0, total)
        if m is not None:
            break
        if not parts.rollout_role.step():
            raise RuntimeError(
                f"the in-process host is stuck: admission refuses a batch (buffer {parts.buffer.stats()}) and the "
                "buffer holds no complete step; this is a bug in the admission rule"
            )
        if stall_s is not None and time.perf_counter() - t0 > stall_s:
            b = parts.buffer.stats()
            raise SupervisionError(
                f"no trainer step for {time.perf_counter() - t0:.0f} s (supervision.stall_timeout_s={stall_s:g}); "
                f"stuck: rollout (batches generated, none completes a step: of {b['pushed']} groups pushed, "
                f"{b['evicted_stale']} evicted as staler than max_staleness={b['max_staleness']}, "
                f"{b['filtered_groups']} filtered, {b['dropped_overflow']} dropped; the rollout's weights are "
                f"version {parts.worker.version}, the trainer's {parts.trainer.version})"
            )
    parts.rollout_role.adopt_weights()  # lockstep: the engine holds the new weights when the step ends (evaluation)
    elapsed = time.perf_counter() - t0
    samples, tokens = role.last_batch
    m["time/rollout_s"] = elapsed - m["time/train_s"]
    m["throughput/samples_per_s"] = samples / max(1e-9, elapsed)  # generation and training, as lockstep runs
    m["throughput/tokens_per_s"] = tokens / max(1e-9, elapsed)
    m.update(_rollout_metrics(parts))
    return m


def _rollout_metrics(parts: RunParts) -> dict:
    stats = parts.buffer.stats()
    out = {"buffer/filtered_groups_frac": stats["filtered_groups_frac"]}
    out["buffer/evicted_length_mean"] = stats["evicted_length_mean"]  # beside response/length_mean
    if parts.worker.env is not None:
        out.update(parts.worker.env.metrics())  # env/errors (by kind), env/process_restarts: the run's so far
    if parts.worker.agent is not None:
        out.update(parts.worker.agent.stats())  # agent/errors, agent/timeouts: failed episodes so far
    return out


def generate_step_batch(parts: RunParts) -> tuple[RolloutBatch, dict]:
    """A step's groups through the rollout role and the buffer (filtering, refills, admission as in a run), as
    one batch, without training on it; returns (batch, rollout stats). The groups are consumed: the next
    batch is a fresh one."""
    while True:
        groups, _ = parts.buffer.take(parts.cfg.trainer.prompts_per_step, 0.0)
        if groups:
            break
        if not parts.rollout_role.step():
            raise RuntimeError(f"admission refused a batch outside a run (buffer {parts.buffer.stats()})")
    parts.buffer.release(len(groups))  # generated outside a training step: their admission is free again
    batch = cat_rollouts([g.batch for g in groups], parts.tokenizer.pad_token_id)
    # reward/<column> means: the trainer's one computation, as a training step logs them
    return batch, {**parts.trainer.reward_component_means(batch), **_rollout_metrics(parts)}


def save_run_checkpoint(parts: RunParts, path: str | Path, run: Optional[dict] = None) -> Path:
    """The one checkpoint layout (the trainer role's writer); the engine's sampling RNG is rollout engine 0's."""
    data, rng = parts.peer_state()
    return Path(parts.trainer_role.checkpoint(path, data, rng, dict(run or {})))


def export_run(parts: RunParts, path: str | Path) -> Path:
    """The trained policy exported as the Ray runtime exports it (build.export_run_policy)."""
    return build.export_run_policy(parts.cfg, parts.model, parts.tokenizer, path)


def restore_run_checkpoint(parts: RunParts, path: str | Path) -> CheckpointState:
    """Validate the whole checkpoint first, then restore weights, optimizer, versions, data and RNG (the trainer
    role's reader). A checkpoint from the Ray runtime restores here too: its first rollout worker's RNG seeds
    the engine, and the prompts not trained on are served first."""
    state = parts.trainer_role.restore(path)
    parts.trainer_role.set_trained(parts.prompts.load_state_dict(state.data))
    if state.resumed_bound(parts.cfg) is not None:
        parts.buffer.set_max_staleness(state.resumed_bound(parts.cfg))
    _publish_now(parts)
    if state.rng.get("rollout") and state.rng["rollout"][0] is not None and hasattr(parts.engine, "generator"):
        parts.engine.generator.set_state(state.rng["rollout"][0])
    return state
