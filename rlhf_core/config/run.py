"""The sections of how a run goes: trainer, critic, staleness (runtime, autopilot), cluster, checkpoints,
tracking, supervision, outputs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, field_validator, model_validator

from rlhf_core.config.base import MAX_CONSECUTIVE_FAILURES, MAX_LR, Count, PositiveFraction, _Section, section


class WarmStartConfig(_Section):
    """Supervised steps that teach the answer format (not the task) before RL, on both runtimes."""

    steps: NonNegativeInt = Field(
        0,
        description="Supervised steps before RL (reported as eval/accuracy_warm_start; 0 = none).",
    )
    lr: Optional[float] = Field(
        None, gt=0, le=1.0, description="AdamW learning rate of the warm start; None uses trainer.lr."
    )
    targets: Literal["any_answer", "prompt_number"] = Field(
        "any_answer",
        description="What the warm start imitates, in the reward's format: any_answer, a training answer drawn "
        "uniformly regardless of the prompt; prompt_number, a number quoted in the prompt's own question "
        "(drawn uniformly among them; the right one only by chance), so that the policy learns to answer "
        "with a number from the question, as an instruct model does, and RL learns which.",
    )


class TrainerConfig(_Section):
    """Optimisation."""

    total_steps: Count = Field(400, description="Trainer steps (policy versions) in the run.")
    prompts_per_step: Count = Field(
        16, description="Prompt groups consumed per trainer step (batch = prompts_per_step x samples_per_prompt)."
    )
    micro_batch_size: Count = Field(
        64,
        description="Sequences per forward/backward, the policy's and the critic's; gradients accumulate over "
        "micro-batches.",
    )
    lr: PositiveFloat = Field(3e-4, description=f"AdamW peak learning rate (at most {MAX_LR:g}).")
    weight_decay: NonNegativeFloat = Field(0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: PositiveFloat = Field(1.0, description="Global gradient-norm clip.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule after warmup.")
    warmup_steps: NonNegativeInt = Field(0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine schedule floor as a fraction of lr.")
    warm_start: WarmStartConfig = section(
        WarmStartConfig, "Supervised format warm start before RL {steps, lr, targets} (steps 0 = none)."
    )
    seed: int = Field(0, description="Seed for torch, sampling and initialisation.")

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
    value_clip: Optional[PositiveFloat] = Field(
        0.5, description="Clip range of new values around the step's old values in the value loss; null = none."
    )
    warmup_steps: NonNegativeInt = Field(
        0, description="First trainer steps in which only the critic trains (the policy's weights stay)."
    )


class AutopilotConfig(_Section):
    """The staleness autopilot: the supervisor moves runtime.max_staleness within [min_staleness, max_staleness]."""

    enabled: bool = Field(
        False, description="Let the supervisor raise and lower the staleness bound (the one policy over it)."
    )
    min_staleness: NonNegativeInt = Field(0, description="Lowest bound the autopilot sets.")
    max_staleness: NonNegativeInt = Field(
        8, description="Highest bound the autopilot sets (also the trainer's hard check)."
    )
    target_m2: PositiveFloat = Field(
        0.04,
        description="Mismatch target: the mean squared behaviour/current log-ratio (async/mismatch_m2) above it "
        "lowers the bound; below it, with the trainer waiting (time/wait_s above rlhf_core.autopilot.WAIT_FRAC, "
        "0.2, of its step time) and its data at the bound (async/staleness_max), the bound rises.",
    )
    cooldown_steps: Count = Field(
        4, description="Trainer steps after a change before the next one (the new bound takes effect first)."
    )


class RuntimeConfig(_Section):
    """How rollout and training are interleaved."""

    max_staleness: NonNegativeInt = Field(
        2,
        description="tau_max: every consumed sample has trainer_version - sample_version <= this; 0 is lockstep "
        "(generate -> train -> load weights, every sample on-policy). The bound in force unless the autopilot is on.",
    )
    sync_every: Count = Field(1, description="Publish weights to rollout workers every this many trainer versions.")
    wait_timeout_s: PositiveFloat = Field(
        120.0,
        description="Longest any blocking wait may last before failing with a message naming what it waited for.",
    )
    autopilot: AutopilotConfig = section(
        AutopilotConfig,
        "Staleness autopilot {enabled, min_staleness, max_staleness, target_m2, ...}: the supervisor "
        "moves max_staleness at runtime.",
    )


class AutoscaleConfig(_Section):
    """The elastic rollout fleet: the supervisor adds a rollout worker while the trainer waits for data and the
    cluster has room for one, and removes one while the trainer is the bottleneck."""

    enabled: bool = Field(
        False,
        description="Let the supervisor move the number of rollout workers within [min_workers, max_workers] (the "
        "one policy over it while enabled; `atrlhf scale` is refused then).",
    )
    min_workers: Count = Field(1, description="Fewest rollout workers the autoscaler keeps.")
    max_workers: Count = Field(2, description="Most rollout workers the autoscaler starts.")
    cooldown_steps: Count = Field(
        5, description="Trainer steps after a change before the next one (the new fleet shows in the metrics)."
    )

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"cluster.autoscale.min_workers={self.min_workers} is above max_workers={self.max_workers}"
            )
        return self


ROLE_RESOURCE_DEFAULTS = {
    "rollout": {"CPU": 1.0, "GPU": 0.0},
    "trainer": {"CPU": 1.0, "GPU": 0.0},
    "reward": {"CPU": 0.0, "GPU": 0.0},
    "eval": {"CPU": 0.0, "GPU": 0.0},
}
_NOT_CUSTOM = ("memory", "object_store_memory")  # Ray's own resources that are no actor's `resources=` key


def _role_default(role: str):
    return lambda: dict(ROLE_RESOURCE_DEFAULTS[role])


class RoleResources(_Section):
    """cluster.resources: what each role's actors ask Ray for, in Ray's vocabulary. CPU and GPU (fractions allowed)
    become the actor's num_cpus / num_gpus, a key left out keeps its default; any other key is a custom resource
    (the actor's resources=), which pins the role to the nodes started with it (ray start --resources=...)."""

    rollout: dict[str, float] = Field(
        default_factory=_role_default("rollout"),
        description="Ray resources of each rollout worker (default {CPU: 1, GPU: 0}).",
    )
    trainer: dict[str, float] = Field(
        default_factory=_role_default("trainer"),
        description="Ray resources of the trainer (default {CPU: 1, GPU: 0}): CPU is the whole role's, split "
        "evenly across its cluster.trainer_workers ranks (Ray's logical CPUs: a 2-core machine runs one rollout "
        "worker and 2 trainer ranks as they are); GPU and custom resources are each rank's.",
    )
    reward: dict[str, float] = Field(
        default_factory=_role_default("reward"),
        description="Ray resources of the reward-model actor, when reward.model.path is set (default {CPU: 0, "
        "GPU: 0}): the rollout workers wait while it scores their rows, so a small RM runs in their share (a "
        "2-core machine fits the default roles); reserve CPUs or GPUs for a large RM.",
    )

    eval: dict[str, float] = Field(
        default_factory=_role_default("eval"),
        description="Ray resources of the evaluation actor, when eval.every > 0 (default {CPU: 0, GPU: 0}): the "
        "pinned evaluations run there, off the trainer's and the fleet's critical path; give it a GPU share (e.g. "
        "{GPU: 0.2}) when the policy runs on GPUs.",
    )

    @field_validator("rollout", "trainer", "reward", "eval")
    @classmethod
    def _amounts(cls, v: dict[str, float], info) -> dict[str, float]:
        field = f"cluster.resources.{info.field_name}"
        for name, amount in v.items():
            if name.upper() in ("CPU", "GPU") and name not in ("CPU", "GPU"):
                raise ValueError(f"{field}.{name}: Ray spells it {name.upper()} (a custom {name!r} pins to no node)")
            if name in _NOT_CUSTOM:
                raise ValueError(f"{field}.{name}: Ray's {name} is not asked for per role; CPU, GPU or custom keys")
            if name in ("CPU", "GPU") and not amount >= 0:
                raise ValueError(f"{field}.{name}: the amount must be 0 or more, got {amount}")
            if name not in ("CPU", "GPU") and not amount > 0:
                raise ValueError(f"{field}.{name}: a custom resource's amount must be above 0, got {amount}")
        default = ROLE_RESOURCE_DEFAULTS[info.field_name]
        return {"CPU": v.get("CPU", default["CPU"]), "GPU": v.get("GPU", default["GPU"]), **v}


class ClusterConfig(_Section):
    """Where the roles run: Ray placement, or one process (cluster.host threads)."""

    host: Literal["ray", "threads"] = Field(
        "ray",
        description="What hosts the trainer and rollout roles: 'ray' runs each in its own Ray actor process (one "
        "machine or a cluster); 'threads' runs them on threads of this one process (rlhf_core.hosts.threads: no "
        "Ray, no copies between roles, one machine only: cluster.address and the Ray resources are not used, and "
        "cluster.trainer_workers must be 1). Both run the same cycles, staleness bound, checkpoints and metrics; "
        "each role's thread runs cluster.torch_threads torch intra-op threads.",
    )
    address: str = Field(
        "",
        description="'' starts a local Ray instance; 'auto' or 'ray://host:port' joins a cluster. Defaults from RAY_ADDRESS.",
    )
    num_cpus: Optional[Count] = Field(None, description="CPUs of a local Ray instance (None = all).")
    num_gpus: Optional[NonNegativeInt] = Field(None, description="GPUs of a local Ray instance (None = detected).")
    trainer_workers: Count = Field(
        1,
        description="Trainer ranks: N > 1 starts N trainer actors in one placement group that form a torch.distributed "
        "group (gloo on CPU, NCCL on GPU), shard the policy with FSDP2 and each train on a slice of every step's "
        "batch, with the update of one process; 1 keeps the single trainer actor.",
    )
    resources: RoleResources = section(
        RoleResources,
        "Ray resources of each role, in Ray's vocabulary: {rollout: {CPU: 1, GPU: 0}, trainer: {CPU: 1, "
        "GPU: 0}, reward: {CPU: 0, GPU: 0}}; any other key is a custom resource, e.g. "
        "{rollout: {rollout_node: 1}} to place the rollout workers on the nodes started with it.",
    )
    autoscale: AutoscaleConfig = section(
        AutoscaleConfig, "The elastic rollout fleet {enabled, min_workers, max_workers, cooldown_steps}."
    )
    torch_threads: Count = Field(1, description="torch intra-op threads per worker.")
    max_restarts: NonNegativeInt = Field(
        5,
        description="The run's one restart budget: rollout-worker restarts it survives, all workers together (Ray "
        "restarts a worker that died; one restart more fails the run, naming this field).",
    )
    dashboard: bool = Field(
        False,
        description="Local Ray instance only: start the Ray dashboard (on 127.0.0.1:8265). A local instance binds "
        "every port to 127.0.0.1 either way; joining a cluster (address set) is unaffected.",
    )

    def per_actor(self, role: str) -> dict[str, float]:
        """What one actor of `role` ('rollout', 'trainer', 'reward' or 'eval') asks Ray for ({CPU, GPU, custom...}): a
        trainer rank gets cluster.resources.trainer.CPU / cluster.trainer_workers, the rest as given."""
        need = dict(getattr(self.resources, role))
        if role == "trainer":
            need["CPU"] = need["CPU"] / self.trainer_workers
        return need

    def actor_options(self, role: str) -> dict:
        """The Ray actor options of one actor of `role`: num_cpus, num_gpus and, where it asks for custom
        resources, resources={...}."""
        need = self.per_actor(role)
        options: dict = {"num_cpus": need.pop("CPU"), "num_gpus": need.pop("GPU")}
        if need:
            options["resources"] = need
        return options


class CheckpointConfig(_Section):
    """When the trainer writes a resumable checkpoint, and how many a run keeps."""

    every: NonNegativeInt = Field(20, description="Checkpoint every this many trainer steps (0 = only at the end).")
    keep: NonNegativeInt = Field(
        3,
        description="Checkpoints a run keeps, newest first, on disk and in MLflow's artifacts (older ones are "
        "deleted; the newest complete one and the final one are always kept); 0 keeps every checkpoint.",
    )


class TrackingConfig(_Section):
    """MLflow tracking."""

    experiment: str = Field("asynctensorrlhf", description="MLflow experiment name.")
    tracking_uri: str = Field(
        "",
        description="MLflow tracking URI; empty uses MLFLOW_TRACKING_URI or sqlite:///mlflow.db in the working directory.",
    )
    run_name: str = Field(
        "", description="MLflow run name; empty takes the Prefect flow run's name (MLflow picks one outside a flow)."
    )
    log_system_metrics: bool = Field(True, description="Let MLflow sample CPU/GPU/memory during the run.")
    log_model: bool = Field(True, description="Log the final policy as an MLflow artifact that loads back.")


class EngineMismatchConfig(_Section):
    """The engine-mismatch warning: the rollout engine does not compute what the trainer does."""

    kl: PositiveFloat = Field(
        0.05,
        description="Health event engine_mismatch when mismatch/engine_kl (KL rollout || trainer on tokens of the "
        "trainer's own version) stays above this for supervision.engine_mismatch.polls polls.",
    )
    polls: Count = Field(3, description="Consecutive polls above supervision.engine_mismatch.kl.")


class SyncCheckConfig(_Section):
    """The sync probe: after every weight sync the engine samples a token after each of a few fixed prefixes, and
    its log-probs are compared with the trainer's for the version it published (rlhf_core.rollout.probe); their k3
    KL is the run's mismatch/engine_kl where a step has no fresh token."""

    action: Literal["fail", "warn", "off"] = Field(
        "fail",
        description="A sync whose engine log-probs differ from the trainer's beyond tolerance: fail the run (naming "
        "the cause: the update did not land, or landed wrongly), warn, or do not check.",
    )
    tolerance: Optional[PositiveFloat] = Field(
        None,
        description="Largest mean absolute log-prob difference per probe token that is numerical noise (null: 1e-3 "
        "with a float32 engine, 0.05 with a bfloat16 one).",
    )

    @field_validator("action", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        # YAML reads a bare `off` (the file's `action: off`, `--set supervision.sync_check.action=off`) as false
        return "off" if value is False else value


class SupervisionConfig(_Section):
    """The Prefect flow's health checks and their limits."""

    supervise_interval_s: PositiveFloat = Field(2.0, description="Seconds between polls of the actors' stats.")
    staleness_warn: PositiveFraction = Field(
        0.8,
        description="Above this fraction of max_staleness, mean staleness is reported and weights are published "
        "sooner where runtime.sync_every leaves workers behind; it never changes the staleness bound (only the "
        "autopilot does, when enabled).",
    )
    nonfinite_limit: Count = Field(
        5, description="Fail after this many consecutive non-finite (skipped) trainer steps."
    )
    max_consecutive_failures: Count = Field(
        MAX_CONSECUTIVE_FAILURES,
        description="The limit on user code's failures: the run stops when this many calls in a row of one piece of "
        "it fail (a Python reward function's calls: raise or time out; an environment's calls: raise, time out, "
        "return something malformed, or die with their process; an agent's episodes). Below it a failure is that "
        "row's or episode's alone, and its message is printed. A success clears the count (for an environment a "
        "successful step; a reset does not).",
    )
    stall_timeout_s: PositiveFloat = Field(
        180.0, description="Fail when no trainer step completes for this long, naming the stuck role."
    )
    engine_mismatch: EngineMismatchConfig = section(
        EngineMismatchConfig, "The engine-mismatch warning {kl, polls}: mismatch/engine_kl above kl for polls polls."
    )
    audit: Literal["warn", "fail", "off"] = Field(
        "warn",
        description="The run audit (rlhf_core.supervision.audit): for each mechanism the config turns on, a verdict "
        "with its evidence, in <run dir>/audit.json and `atrlhf audit`. An inactive or failed verdict is a health "
        "event; 'fail' also ends the run with it, 'off' keeps no audit.",
    )
    sync_check: SyncCheckConfig = section(
        SyncCheckConfig,
        "The check of every weight sync {action: fail | warn | off, tolerance}: the engine's log-probs "
        "on a fixed probe against the trainer's for the version it published.",
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
    log_every: Count = Field(5, description="Print a progress line every this many trainer steps.")

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
