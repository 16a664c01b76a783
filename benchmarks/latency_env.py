"""A latency-bound multi-turn environment for benchmarks/equal_cores.py: every step waits a heavy-tailed time that
costs no CPU (a remote tool, a judge, a simulator elsewhere), for 2-4 turns.

Each step sleeps a lognormal time, mean 200 ms and p99 2 s (sigma 1.429, mu ln 0.2 - sigma^2 / 2: the median is
72 ms, one step in a hundred waits 2 s or more). `step` is a coroutine, so the environment pool's process runs every
episode's wait concurrently on its event loop. An episode lasts 2, 3 or 4 turns (drawn at reset); the last turn is
rewarded 1.0 when the answer has the '####' marker followed by a digit, so the task has something to learn.

    env: {path: benchmarks/latency_env.py, name: LatencyEnv, max_turns: 4}
"""

from __future__ import annotations

import asyncio
import math
import random
import re

SIGMA = 1.429
MU = math.log(0.2) - SIGMA**2 / 2  # mean exp(MU + SIGMA^2 / 2) = 0.2 s
ANSWER = re.compile(r"####\s*\d")


def latency_s(rng: random.Random, scale: float = 1.0) -> float:
    """One step's wait: lognormal, mean 0.2 s x scale, p99 2 s x scale."""
    return scale * rng.lognormvariate(MU, SIGMA)


class LatencyEnv:
    def __init__(self, seed: int | None = None, scale: float = 1.0, min_turns: int = 2, max_turns: int = 4):
        self.rng = random.Random(seed)
        self.scale, self.min_turns, self.max_turns = scale, min_turns, max_turns
        self.turns = min_turns
        self.turn = 0

    def reset(self, row: dict):
        self.turns = self.rng.randint(self.min_turns, self.max_turns)
        self.turn = 0
        return row["prompt"]

    async def step(self, action: str):
        await asyncio.sleep(latency_s(self.rng, self.scale))
        self.turn += 1
        if self.turn >= self.turns:
            return None, float(bool(ANSWER.search(action))), True, {"success": bool(ANSWER.search(action))}
        return "Go on. Answer with #### n.", 0.0, False, {}
