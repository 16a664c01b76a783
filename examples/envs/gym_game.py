"""The gym adapter (docs/environments.md, "Adapters"): a gymnasium-style text game runs as it is, no wrapper.

Any object with `reset(seed=...) -> (observation, info)` and `step(action) -> (observation, reward, terminated,
truncated, info)` whose observations are text: a gem-llm game, a gymnasium
text environment, or this one.

    env:
      adapter: gym
      path: examples/envs/gym_game.py   # gem-llm: path: gem
      name: CountdownGame               # gem-llm: name: make
      kwargs: {start: 3}                # gem-llm: kwargs: {env_id: game:GuessTheNumber-v0-easy}
      max_turns: 4

The factory (env.path:env.name) is called with env.kwargs once per episode; reset gets the row's seed (else its index).
"""

from __future__ import annotations

import random


class CountdownGame:
    """Say the numbers from a start (drawn from the seed, at most `start`) down to 1, one per turn."""

    def __init__(self, start: int = 3):
        self.top = start
        self.expected = start

    def reset(self, seed=None, options=None):
        self.expected = random.Random(seed).randint(1, self.top)
        return f"Count down from {self.expected}, one number per turn. Say {self.expected}.", {}

    def step(self, action: str):
        said = action.strip().split()[:1]
        if said != [str(self.expected)]:
            return f"No: say {self.expected}.", 0.0, True, False, {"success": False}
        self.expected -= 1
        if self.expected == 0:
            return "", 1.0, True, False, {"success": True}
        return f"Say {self.expected}.", 0.0, False, False, {}
