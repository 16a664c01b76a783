"""One configuration object for a whole run.

`TrainConfig` is loaded once (`load_config(path, overrides)`) and handed down. Every field carries a
one-line description; the defaults run the embedded tiny demo on a laptop CPU. Prefect renders the model
as the flow's parameter form and MLflow logs it flattened as params (`flatten_config`).

Bad input fails with `ConfigError`, whose message names the dotted field path and the offending value.
A renamed key still loads under its new name, with one line saying so (`migrations.MIGRATIONS`); a YAML file may
start from another (`base: other.yaml`). Importing this package imports neither torch nor transformers.

    base.py       ConfigError, the section base class, limits that need no model
    algorithm.py  the policy loss and advantage estimator (registered names, their options)
    reward.py     components, Python reward functions, the reward model, overlong shaping
    env.py        a multi-turn environment or ToolEnv tools
    agent.py      an agent on the OpenAI-compatible endpoint
    data.py       buffer, model (its preset, LoRA), data, held-out evaluation, rollout (engine_kwargs per engine)
    run.py        trainer (its warm start), critic, runtime (staleness, autopilot), cluster, checkpoint, tracking, supervision, run
    train.py      TrainConfig and its rules across sections
    load.py       YAML (base:), overrides, migrations of renamed keys, validation, flatten_config
"""

from rlhf_core.config.agent import AGENT_COLUMNS, AgentConfig
from rlhf_core.config.algorithm import AlgorithmConfig
from rlhf_core.config.base import MAX_LR, MAX_SEQUENCE_TOKENS, RUN_CONFIG_FILE, ConfigError, _Section
from rlhf_core.config.data import BufferConfig, DataConfig, EvalConfig, LoraConfig, ModelConfig, RolloutConfig
from rlhf_core.config.env import ENV_COLUMNS, EnvConfig, EnvToolConfig
from rlhf_core.config.load import (
    _format_validation_error,
    apply_overrides,
    flatten_config,
    load_config,
    parse_grid_item,
    read_config_file,
    validate_config,
)
from rlhf_core.config.migrations import MIGRATIONS, migrate_config
from rlhf_core.config.reward import (
    REWARD_COMPONENT_NAMES,
    OverlongConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
)
from rlhf_core.config.run import (
    AutopilotConfig,
    CheckpointConfig,
    ClusterConfig,
    CriticConfig,
    EngineMismatchConfig,
    RunConfig,
    RuntimeConfig,
    SupervisionConfig,
    TrackingConfig,
    TrainerConfig,
    WarmStartConfig,
)
from rlhf_core.config.train import TrainConfig

__all__ = [
    "AGENT_COLUMNS",
    "AgentConfig",
    "AlgorithmConfig",
    "AutopilotConfig",
    "BufferConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "ENV_COLUMNS",
    "EngineMismatchConfig",
    "EnvConfig",
    "EnvToolConfig",
    "EvalConfig",
    "LoraConfig",
    "MAX_LR",
    "MAX_SEQUENCE_TOKENS",
    "MIGRATIONS",
    "ModelConfig",
    "OverlongConfig",
    "REWARD_COMPONENT_NAMES",
    "RUN_CONFIG_FILE",
    "RewardConfig",
    "RewardFunctionConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "RuntimeConfig",
    "SupervisionConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "_Section",
    "_format_validation_error",
    "apply_overrides",
    "flatten_config",
    "load_config",
    "migrate_config",
    "parse_grid_item",
    "read_config_file",
    "validate_config",
]
