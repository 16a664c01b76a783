"""TrainConfig: every section of a run, and the rules across sections."""

from __future__ import annotations

from pydantic import model_validator

from rlhf_core.config.agent import AgentConfig
from rlhf_core.config.algorithm import AlgorithmConfig
from rlhf_core.config.base import MAX_SEQUENCE_TOKENS, _Section, section
from rlhf_core.config.data import BufferConfig, DataConfig, EvalConfig, ModelConfig, RolloutConfig
from rlhf_core.config.env import EnvConfig
from rlhf_core.config.reward import RewardConfig
from rlhf_core.config.run import (
    CheckpointConfig,
    ClusterConfig,
    CriticConfig,
    RunConfig,
    RuntimeConfig,
    SupervisionConfig,
    TrackingConfig,
    TrainerConfig,
)


class TrainConfig(_Section):
    """Everything a run needs. Load with `load_config`."""

    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Policy loss and advantages.")
    reward: RewardConfig = section(
        RewardConfig, "Rewards: tensor-native components, Python reward functions and a learned reward model."
    )
    buffer: BufferConfig = section(BufferConfig, "Replay buffer.")
    model: ModelConfig = section(ModelConfig, "Policy model.")
    data: DataConfig = section(DataConfig, "Prompt source.")
    rollout: RolloutConfig = section(RolloutConfig, "Generation.")
    trainer: TrainerConfig = section(TrainerConfig, "Optimisation.")
    runtime: RuntimeConfig = section(RuntimeConfig, "Staleness (0: lockstep), weight syncs and waits.")
    cluster: ClusterConfig = section(ClusterConfig, "Where the roles run: Ray placement, or threads of one process.")
    tracking: TrackingConfig = section(TrackingConfig, "MLflow experiment and run.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpoint cadence and retention {every, keep}.")
    eval: EvalConfig = section(EvalConfig, "Held-out evaluation: cadence, sampled pass@k and mean@k.")
    critic: CriticConfig = section(CriticConfig, "The critic of algorithm.advantage 'gae' (unused otherwise).")
    supervision: SupervisionConfig = section(SupervisionConfig, "Flow health checks.")
    env: EnvConfig = section(EnvConfig, "Multi-turn environment and tools (empty: single-turn prompts).")
    agent: AgentConfig = section(AgentConfig, "An agent on the OpenAI-compatible endpoint (empty: none).")
    run: RunConfig = section(RunConfig, "Outputs.")

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
    def _fleet(self) -> TrainConfig:
        a = self.cluster.autoscale
        if a.enabled and self.cluster.host == "threads":
            raise ValueError(
                "cluster.autoscale needs the Ray host (cluster.host: ray): the threads host runs its rollout in one "
                "process, its fleet fixed"
            )
        if a.enabled and not a.min_workers <= self.rollout.num_workers <= a.max_workers:
            raise ValueError(
                f"rollout.num_workers={self.rollout.num_workers} (the fleet the run starts with) is outside "
                f"cluster.autoscale's [min_workers={a.min_workers}, max_workers={a.max_workers}]"
            )
        return self

    @model_validator(mode="after")
    def _cross_field(self) -> TrainConfig:
        if self.data.task in ("jsonl", "dataset") and not self.data.train_path:
            raise ValueError(f"data.train_path is required when data.task is '{self.data.task}'")
        if self.data.task in ("jsonl", "dataset") and not self.model.path and self.model.tiny.kind != "chat":
            raise ValueError(
                f"data.task '{self.data.task}' needs a model that reads text: set model.path to a Hugging Face "
                "model directory, or model.preset=tiny-chat (the small chat model built locally; the word-level "
                f"model.preset {self.model.preset!r} only speaks the synthetic tasks)"
            )
        if not (
            self.reward.components
            or self.reward.functions
            or self.reward.model.path
            or self.env.enabled
            or self.agent.enabled
        ):
            raise ValueError(
                "the reward is empty: reward.components is {} and there are no reward.functions, reward.model or "
                "environment; name a component (e.g. {exact_match: 1.0}) or add a function"
            )
        metrics = self.eval_metric_names()
        if self.env.enabled and self.eval.metric != "accuracy":
            raise ValueError(
                f"eval.metric {self.eval.metric!r} applies to single-turn evaluation; with an environment "
                "eval/accuracy is the fraction of solved episodes (docs/environments.md): leave eval.metric unset"
            )
        if self.eval.metric not in metrics:
            raise ValueError(
                f"eval.metric {self.eval.metric!r} is not a reward column; choose one of {metrics} ('accuracy': "
                "the first answer-checking component, else a total reward above 0)"
            )
        keys = {f"data.{k}": getattr(self.data, k) for k in ("prompt_key", "answer_key")}
        if len(set(keys.values())) < len(keys):
            raise ValueError(f"{', '.join(keys)} must name different keys (got {list(keys.values())})")
        if self.eval.n_samples and self.eval.k > self.eval.n_samples:
            raise ValueError(
                f"eval.k={self.eval.k} is more than eval.n_samples={self.eval.n_samples}: pass@k needs at least k "
                f"samples per prompt. Set eval.n_samples to {self.eval.k} or more, or lower eval.k"
            )
        if self.data.answer_after_marker and not self.reward.marker.strip():
            raise ValueError("data.answer_after_marker needs a non-empty reward.marker to split the answer at")
        if self.data.task == "max3_chat" and not self.model.path and self.model.tiny.kind != "chat":
            raise ValueError(
                "data.task 'max3_chat' needs a chat model: set model.preset=tiny-chat (the small local chat model) "
                "or model.path to a chat model"
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
        if self.algorithm.advantage_spec.grouped and self.rollout.samples_per_prompt < 2:
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
        if self.cluster.host == "threads" and ranks > 1:
            raise ValueError(
                f"cluster.host='threads' hosts one trainer in this process; cluster.trainer_workers={ranks} needs "
                "cluster.host='ray' (a sharded trainer group is one Ray actor per rank)"
            )
        # each rank trains on its rows (trainer.sharding.rank_rows, sizes differing by at most 1) in as many
        # micro-batches as the widest rank needs: every rank must have a row for each of them (the critic's too,
        # sharded on the same ranks in the same micro-batches)
        fewest, widest = self.batch_size // ranks, -(-self.batch_size // ranks)
        field_name, micro = "trainer.micro_batch_size", self.trainer.micro_batch_size
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

    def eval_metric_names(self) -> list[str]:
        """What eval.metric may name: 'accuracy', each reward component and each reward function's columns
        (its label, <label>/failed, <label>/<key> of its declared verl metrics)."""
        return ["accuracy", *self.reward.components, *self.reward.function_column_names()]

    @property
    def batch_size(self) -> int:
        """Samples per trainer step."""
        return self.trainer.prompts_per_step * self.rollout.samples_per_prompt
