"""The environments users already have, run as this project's environments (docs/environments.md, "Adapters").

`env.adapter: gym` wraps any object with gymnasium-style `reset(seed=...) -> (observation, info)` and
`step(action) -> (observation, reward, terminated, truncated, info)` whose observations are text (gem-llm
games, gymnasium text environments); `env.adapter: textarena` wraps a TextArena game (`reset(num_players, seed)`,
`get_observation() -> (player, observation)`, `step(action) -> (done, info)`, `close() -> (rewards, info)`),
single- or multi-player, the policy at one seat and an opponent callable at the others; `env.adapter: openenv`
wraps an OpenEnv
`EnvClient` (async `reset` / `step` returning a `StepResult`), one session of its server per episode. Either is
made by the callable `env.name` of the module or file `env.path` ("module:callable", "file.py:callable" here) called
with `env.kwargs`, once per episode, in
the environment process (as any environment is). The row's `seed` (else its `index`) seeds the episode, so
the samples of one group play the same game.

No torch; the wrapped library is imported only in the environment processes (and by preflight).
"""

from __future__ import annotations

import inspect
import threading
import typing
from typing import Any, Optional

from rlhf_core.usercode import import_path

_SEEDING = threading.Lock()  # gym-style resets often seed the process-wide RNGs: one at a time per process


def load_factory(factory: str, where: str = "env.path/env.name"):
    """The callable `factory` names: 'module:callable' or 'path/to/file.py:callable'."""
    path, _, name = factory.rpartition(":")
    if not path or not name:
        raise ValueError(f"{where}: {factory!r} is not 'module:callable' (or 'file.py:callable')")
    obj = import_path(path, where)
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{where}: {path} defines no {name!r}")
    if not callable(obj):
        raise ValueError(f"{where}: {name} in {path} is a {type(obj).__name__}, not callable")
    return obj


def row_seed(row: dict) -> Optional[int]:
    """The episode's seed: the row's `seed` column when it is a whole number, else its `index` in its split."""
    for key in ("seed", "index"):
        value = row.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def as_text(value: Any, field: str = "", what: str = "observation") -> str:
    """The text of an observation: a string as it is; `field` of a dict or object (an OpenEnv Observation); else
    the one string field it has (the observation's `done`, `reward` and `metadata` aside)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        fields = value
    elif hasattr(value, "model_dump"):
        fields = value.model_dump()
    elif hasattr(value, "__dict__"):
        fields = vars(value)
    else:
        raise TypeError(f"{what} is a {type(value).__name__}, not text")
    if field:
        if field not in fields:
            raise TypeError(f"{what} has no field {field!r} (env.observation_field); it has {sorted(fields)}")
        return str(fields[field])
    texts = [k for k, v in fields.items() if isinstance(v, str) and k not in ("done", "reward", "metadata")]
    if len(texts) != 1:
        raise TypeError(
            f"{what} ({type(value).__name__}) has {len(texts)} string fields {texts}: name the one that holds its text "
            "with env.observation_field"
        )
    return fields[texts[0]]


class GymAdapter:
    """A gymnasium-style text environment (`env.adapter: gym`) as this project's environment."""

    def __init__(self, factory: str, kwargs: Optional[dict] = None, observation_field: str = "", **_):
        self.env = load_factory(factory)(**(kwargs or {}))
        self.observation_field = observation_field
        self.name = factory

    def reset(self, row: dict):
        seed = row_seed(row)
        with _SEEDING:
            result = self.env.reset(seed=seed)
        if inspect.isawaitable(result):
            raise TypeError(f"{self.name}: reset returned a coroutine; use env.adapter: openenv for async clients")
        observation = result[0] if isinstance(result, tuple) else result  # gymnasium: (observation, info)
        return [{"role": "user", "content": as_text(observation, self.observation_field, "reset's observation")}]

    def step(self, action: str):
        result = self.env.step(action)
        if not isinstance(result, tuple) or len(result) not in (4, 5):
            raise TypeError(
                f"{self.name}: step returned {type(result).__name__}, not (observation, reward, terminated, truncated, "
                "info)"
            )
        if len(result) == 5:
            observation, reward, terminated, truncated, info = result
            done = bool(terminated) or bool(truncated)
        else:  # classic gym: (observation, reward, done, info)
            observation, reward, done, info = result
            done = bool(done)
        info = dict(info or {}) if isinstance(info, dict) else {}
        text = None if done else as_text(observation, self.observation_field, "step's observation")
        return text, float(reward), done, info

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def _action_class(client) -> Any:
    """The Action type of a typed OpenEnv client (EnvClient[Action, Observation, State]), or None (generic)."""
    for klass in type(client).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and inspect.isclass(args[0]) and hasattr(args[0], "model_fields"):
                return args[0]
    return None


def _string_field(action_cls) -> str:
    fields = getattr(action_cls, "model_fields", {})
    texts = [name for name, f in fields.items() if f.annotation is str and name != "metadata"]
    if len(texts) != 1:
        raise TypeError(
            f"{action_cls.__name__} has {len(texts)} string fields {texts}: name the one the model's text goes to "
            "with env.action_field"
        )
    return texts[0]


class OpenEnvAdapter:
    """An OpenEnv `EnvClient` (`env.adapter: openenv`): each episode opens its own session on the server (its
    own client, one WebSocket), closed when the episode ends. The model's text is the action's `action_field`
    (default: the Action class's one string field; a dict for a generic client); the observation's text is its
    `observation_field` (default: its one string field)."""

    def __init__(
        self, factory: str, kwargs: Optional[dict] = None, action_field: str = "", observation_field: str = "", **_
    ):
        self.client = load_factory(factory)(**(kwargs or {}))
        self.name = factory
        self.observation_field = observation_field
        self.action_cls = _action_class(self.client)
        if self.action_cls is None and not action_field:
            raise TypeError(
                f"{factory}: a generic OpenEnv client takes dict actions: name their text field with env.action_field"
            )
        self.action_field = action_field or _string_field(self.action_cls)

    def _action(self, text: str):
        if self.action_cls is None:
            return {self.action_field: text}
        return self.action_cls(**{self.action_field: text})

    async def _session_call(self, coro):
        try:
            return await coro
        except RuntimeError as exc:
            if "CAPACITY_REACHED" in str(exc):
                raise RuntimeError(
                    f"{exc}: the server is at its session limit; raise max_concurrent_envs in the server's app (see "
                    "docs/environments.md) or lower env.max_sessions"
                ) from None
            raise

    def _text(self, result, what: str) -> str:
        return as_text(result.observation, self.observation_field, what)

    async def reset(self, row: dict):
        seed = row_seed(row)
        result = await self._session_call(self.client.reset(**({} if seed is None else {"seed": seed})))
        return [{"role": "user", "content": self._text(result, "reset's observation")}]

    async def step(self, action: str):
        result = await self._session_call(self.client.step(self._action(action)))
        done = bool(result.done)
        reward = 0.0 if result.reward is None else float(result.reward)
        metadata = getattr(result, "metadata", None)  # StepResult has it from openenv 0.4; 0.3 has none
        info = dict(metadata) if isinstance(metadata, dict) else {}
        return (None if done else self._text(result, "step's observation")), reward, done, info

    async def close(self) -> None:
        await self.client.close()


class TextArenaAdapter:
    """A TextArena game (`env.adapter: textarena`; e.g. env.path textarena, env.name make, env.kwargs {env_id:
    GuessTheNumber-v0-raw}) as this project's environment. Adapter keys of env.kwargs (the rest go to the factory):
    `num_players` (default 1), `player` (the policy's seat, default 0) and `opponent` ('module:callable', a
    callable(observation text) -> action text that plays every other seat; required for more than one player).
    Each turn the policy sees what reached its seat since its last turn (a raw game's messages, one line each
    with their sender, or the new part of a wrapped game's observation text); the reward is its seat's, from the
    game's close() at the end."""

    def __init__(self, factory: str, kwargs: Optional[dict] = None, **_):
        kwargs = dict(kwargs or {})
        self.num_players = int(kwargs.pop("num_players", 1))
        self.player = int(kwargs.pop("player", 0))
        opponent = kwargs.pop("opponent", None)
        if not 0 <= self.player < self.num_players:
            raise ValueError(f"env.kwargs.player {self.player} is not a seat of {self.num_players} player(s)")
        if self.num_players > 1 and not opponent:
            raise ValueError(
                f"{factory}: {self.num_players} players need env.kwargs.opponent ('module:callable', observation "
                "text -> action text) to play the seats the policy does not"
            )
        self.opponent = load_factory(opponent, "env.kwargs.opponent") if opponent else None
        self.env = load_factory(factory)(**kwargs)
        self.name, self.seen = factory, {}

    def _text(self, pid: int, observation: Any) -> str:
        if isinstance(observation, str):  # a wrapped game's whole history so far: the part this seat has not seen
            seen, self.seen[pid] = self.seen.get(pid, ""), observation
            return observation[len(seen) :].strip() if observation.startswith(seen) else observation
        lines = []
        for entry in observation or ():
            sender, message = entry[0], entry[1]
            who = "GAME" if isinstance(sender, int) and sender < 0 else f"Player {sender}"
            lines.append(f"[{who}] {message}")
        return "\n".join(lines)

    def _to_policy(self) -> Optional[str]:
        """Play the other seats until it is the policy's turn: its observation, or None when the game ended."""
        while True:
            pid, observation = self.env.get_observation()
            text = self._text(pid, observation)
            if pid == self.player:
                return text
            done, _ = self.env.step(str(self.opponent(text)))
            if done:
                return None

    def reset(self, row: dict):
        with _SEEDING:
            self.env.reset(num_players=self.num_players, seed=row_seed(row))
        text = self._to_policy()
        if text is None:
            raise RuntimeError(f"{self.name}: the game ended before the policy's first turn")
        return [{"role": "user", "content": text}]

    def step(self, action: str):
        done, info = self.env.step(action)
        text = None if done else self._to_policy()
        info = dict(info) if isinstance(info, dict) else {}
        if not done and text is not None:
            return text, 0.0, False, info
        result = self.env.close()
        rewards = result[0] if isinstance(result, tuple) else result
        reward = rewards.get(self.player, 0.0) if isinstance(rewards, dict) else float(rewards or 0.0)
        return None, float(reward), True, info

    def close(self) -> None:
        pass  # the game is closed when it ends (its close() gives the rewards); nothing holds a resource before


ADAPTERS = {"gym": "GymAdapter", "openenv": "OpenEnvAdapter", "textarena": "TextArenaAdapter"}
"""env.adapter -> the class of this module that runs it."""
