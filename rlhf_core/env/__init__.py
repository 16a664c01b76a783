"""Multi-turn environments and tool calling (docs/environments.md).

An environment is a class loaded like a reward function (`env.path`, `env.name`, `env.kwargs`), one
instance per trajectory, run in the rollout worker's environment process pool, never in the trainer:

    class MyEnv:
        def __init__(self, **kwargs): ...
        def reset(self, row: dict) -> list[dict] | str: ...          # the opening messages or prompt
        def step(self, action: str) -> tuple[list[dict] | str | None, float, bool, dict]: ...
                                                                       # (observation, reward, done, info)
        def finish(self, reason: str) -> float | None: ...             # optional: cut short, a final reward
        def close(self) -> None: ...                                   # optional: once per episode

Every method may be a coroutine (awaited). Modules:
  checks.py      every value an environment returns, checked where it arrives; the failure kinds
  serve.py       a pool process: the instances, every call under the timeout, close() once per episode
  pool.py        EnvPool: spawned processes, many trajectories in flight per process, failure isolation
  chat.py        ChatFormat: messages -> ids through the model's chat template (observations by difference)
  tools.py       ToolEnv: Python functions as tools, Qwen2.5 / Hermes <tool_call> format
The runner of episodes (EnvRunner: token-in/token-out trajectories, how each ends, and their RolloutBatch) sits
beside the rollout engines, in rlhf_core/rollout/multiturn.py and multiturn_batch.py: it drives an engine and
this package's pool, so the environment package never imports the rollout package.
  protocol.py    Environment: the interface above as a typing.Protocol

This package's __init__ imports nothing: the pool's processes import serve.py and checks.py (and
rlhf_core.usercode, which finds and imports the class), no torch.
The public names (docs/api.md: `Environment`, `ToolEnv`) load their module on first use.
"""

from __future__ import annotations

from rlhf_core.lazy import lazy_exports

_LAZY = {
    "Environment": "rlhf_core.env.protocol",
    "ToolEnv": "rlhf_core.env.tools",
}

__all__, __getattr__, __dir__ = lazy_exports(globals(), _LAZY)
