"""Porting a gym-style environment (skyrl-gym, OpenEnv, OpenRLHF agents) by a thin wrapper.

Those frameworks share the shape `reset(...) -> observation` / `step(action) -> (observation, reward, done,
info)` (gymnasium-style ones return `terminated, truncated` separately). This project's environment
contract (docs/environments.md) is the same shape with text in and text out: `reset(row)` returns the
opening messages, `step(action: str)` returns `(observation, reward, done, info)` with the observation a
string or messages, None when done. A wrapper maps one onto the other:

    env:
      path: examples/envs/gym_wrapper.py
      name: GymTextWrapper
      kwargs: {env_path: examples/envs/gym_wrapper.py, env_name: CountdownGame, env_kwargs: {start: 5}}

`CountdownGame` below stands in for a ported environment: its API is gymnasium's (`reset(seed, options)`
returns (observation, info); `step` returns five values), so the wrapper shows every conversion.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path


def _load(path: str, name: str):
    if path.endswith(".py"):
        module_name = f"gym_wrapped_{abs(hash(str(Path(path).resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, Path(path).resolve())
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    return getattr(module, name)


class GymTextWrapper:
    """Wraps a gym-style text environment (class `env_name` in `env_path`, made with `env_kwargs`)."""

    def __init__(self, env_path: str, env_name: str, env_kwargs: dict | None = None, system: str = ""):
        self.env = _load(env_path, env_name)(**(env_kwargs or {}))
        self.system = system

    async def reset(self, row: dict):
        result = self.env.reset(options={"row": row})
        if inspect.isawaitable(result):
            result = await result
        observation = result[0] if isinstance(result, tuple) else result  # gymnasium: (observation, info)
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return messages + [{"role": "user", "content": str(observation)}]

    async def step(self, action: str):
        result = self.env.step(action)
        if inspect.isawaitable(result):
            result = await result
        if len(result) == 5:  # gymnasium: terminated and truncated
            observation, reward, terminated, truncated, info = result
            done = bool(terminated or truncated)
        else:  # classic gym / skyrl-gym / OpenRLHF: done
            observation, reward, done, info = result
        return (None if done else str(observation)), float(reward), bool(done), dict(info or {})


class CountdownGame:
    """A gymnasium-style toy: the model must say the numbers from `start` down to 1, one per turn."""

    def __init__(self, start: int = 5):
        self.start = start
        self.expected = start

    def reset(self, seed=None, options=None):
        self.expected = self.start
        return f"Count down from {self.start}, one number per turn. Say {self.start}.", {}

    def step(self, action: str):
        said = action.strip().split()[:1]
        if said != [str(self.expected)]:
            return f"No: say {self.expected}.", 0.0, True, False, {"success": False}
        self.expected -= 1
        if self.expected == 0:
            return "", 1.0, True, False, {"success": True}
        return f"Say {self.expected}.", 0.0, False, False, {}
