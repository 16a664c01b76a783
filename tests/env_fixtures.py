"""Environments the multi-turn tests load by path (tests/test_env.py): not a test module."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path


class CountEnv:
    """Answers each model turn with 'turn <t>' (the role env.observation_role), reward 1 per step; done after
    `turns` steps; raises at step `fail_at`; sleeps `sleep` seconds per step (in its thread)."""

    def __init__(self, turns: int = 2, fail_at: int = 0, sleep: float = 0.0, reward: float = 1.0):
        self.turns, self.fail_at, self.sleep, self.reward = turns, fail_at, sleep, reward
        self.t = 0
        self.actions: list[str] = []

    def reset(self, row):
        return [{"role": "user", "content": f"count to {row.get('answer', 3)}"}]

    def step(self, action):
        self.t += 1
        self.actions.append(action)
        if self.t == self.fail_at:
            raise ValueError(f"boom at step {self.t}")
        if self.sleep:
            time.sleep(self.sleep)
        return f"turn {self.t}", self.reward, self.t >= self.turns, {"success": self.t >= self.turns}


class AsyncSleepEnv(CountEnv):
    """CountEnv whose step is a coroutine that sleeps `sleep` seconds."""

    async def reset(self, row):
        return row["prompt"]  # the row's own prompt

    async def step(self, action):
        await asyncio.sleep(self.sleep)
        self.t += 1
        return [{"role": "user", "content": f"turn {self.t}"}], self.reward, self.t >= self.turns, {}


class BlockingEnv(CountEnv):
    """A coroutine step that blocks its event loop (time.sleep): only killing the process stops it."""

    async def step(self, action):
        time.sleep(600)


class BadResultEnv(CountEnv):
    def step(self, action):
        return "obs", "not a number", False, {}


_made = 0


class MarkerEnv:
    """The first instance made in a process is slow: its first step waits until `fast` other trajectories
    have finished (marker files in `dir`). If the driver waited for it before generating the others' turns,
    it would never see them and fail at env.step_timeout_s."""

    def __init__(self, dir: str, fast: int, turns: int = 3):
        global _made
        self.slow = _made == 0
        _made += 1
        self.dir, self.fast, self.turns = Path(dir), fast, turns
        self.t = 0

    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    async def step(self, action):
        self.t += 1
        if self.slow:
            while len(list(self.dir.glob("done-*"))) < self.fast:
                await asyncio.sleep(0.05)
            return None, 1.0, True, {"fast_done_first": True}
        if self.t >= self.turns:
            (self.dir / f"done-{id(self)}").write_text("x")
            return None, 1.0, True, {}
        return "again", 0.0, False, {}


class NoStep:
    def reset(self, row):
        return "x"


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def slow(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "slept"


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def undocumented(x):
    return x
