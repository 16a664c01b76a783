"""A two-turn environment where feedback matters: the question that scores is only in the observation.

Turn 1: the model answers the opening question (the row's own prompt, "max of a, b, c? ..."; no reward).
Turn 2: the environment asks the same kind of question about three new digits drawn at random for this
episode ("max of 4, 8, 1? Answer with #### n."); the model earns 1.0 for answering their maximum after the
'####' marker, and the episode ends.

A policy that ignores the observations never sees the new digits: its best is to always answer 9, right
with probability 1 - 0.9^3 = 0.271. The small chat model learns to read the observation on CPU in minutes
(configs/tiny-multiturn.yaml, docs/benchmarks.md).

    env: {path: examples/envs/reveal.py, name: RevealEnv, max_turns: 2}
"""

from __future__ import annotations

import random
import re

ANSWER = re.compile(r"####\s*(-?\d+)")


def blind_best(digits: int = 10, same: bool = False) -> float:
    """The best success rate of a policy that does not read the observation: always the largest digit."""
    return 1 / digits if same else 1 - ((digits - 1) / digits) ** 3


class RevealEnv:
    def __init__(self, digits: int = 10, seed: int | None = None, same: bool = False):
        self.digits = digits
        self.same = same  # one digit asked three times ("max of 7, 7, 7?"): reading it is the whole task
        self.rng = random.Random(seed)
        self.numbers = (0, 0, 0)
        self.turn = 0

    def reset(self, row: dict):
        self.numbers = tuple(self.rng.randrange(self.digits) for _ in range(3))
        if self.same:
            self.numbers = (self.numbers[0],) * 3
        self.turn = 0
        return row["prompt"]  # the row's own prompt: the ids the data pipeline made

    def step(self, action: str):
        self.turn += 1
        if self.turn == 1:
            a, b, c = self.numbers
            return f"max of {a}, {b}, {c}? Answer with #### n.", 0.0, False, {}
        found = ANSWER.findall(action)
        correct = bool(found) and int(found[-1]) == max(self.numbers)
        return None, float(correct), True, {"success": correct}
