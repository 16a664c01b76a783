"""The environment interface (docs/environments.md): what `env.path` / `env.name` names must provide.

A structural type (`typing.Protocol`): an environment need not inherit from it, only have the methods; it
is for type checkers and `isinstance` / `issubclass` (which check that the methods exist, not their
signatures). Imports nothing beyond typing: the environment pool's processes may import it.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Optional, Protocol, Union, runtime_checkable

Messages = list[dict[str, Any]]
Opening = Union[Messages, str]  # what reset returns: the opening messages (chat format) or a prompt string
Observation = Optional[Union[Messages, str]]  # the next turn's messages, a string (one message), None when done
StepResult = tuple[Observation, float, bool, dict[str, Any]]  # (observation, reward, done, info)


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment, gym-style; the run makes one instance per trajectory with `env.kwargs`
    (`cls(**kwargs)`) in the rollout worker's environment process pool.

    reset(row): row is the dataset row (prompt or messages, answer, every other column); returns the opening
        messages or a prompt string (return `row["prompt"]` to keep the prompt the data pipeline made).
    step(action): action is the model's turn as text; returns (observation, reward, done, info), info may
        hold "success" (bool), read by evaluation.
    Either may be `async def` (awaited). An optional `close()` is called when the trajectory ends.
    """

    def reset(self, row: dict[str, Any]) -> Union[Opening, Awaitable[Opening]]: ...

    def step(self, action: str) -> Union[StepResult, Awaitable[StepResult]]: ...
