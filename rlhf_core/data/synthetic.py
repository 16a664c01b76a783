"""Synthetic tasks for the embedded default: rules a tiny transformer learns from reward alone.

- "max3": "max a b c =" -> the largest of three digits. All 1,000 digit triples are enumerated; a seeded
  `heldout_frac` of them never appear in training and measure generalisation. The rule is learnable
  from reward alone by a 2-layer model (see docs/benchmarks.md for the measured curves).
- "sum2": "sum a b =" -> a + b written as its digits ("sum 7 5 =" -> "1 2"): a multi-token answer and a
  harder second task (100 problems; held-out pairs test whether addition, not a lookup, was learned).
"""

from __future__ import annotations

import itertools

import numpy as np

from rlhf_core.data.answers import answer_patterns
from rlhf_core.data.prompts import Prompt
from rlhf_core.data.tasks import SYNTHETIC_TASKS


def _problems(task: str) -> list[tuple[str, str]]:
    if task == "max3":
        return [(f"max {a} {b} {c} =", str(max(a, b, c))) for a, b, c in itertools.product(range(10), repeat=3)]
    if task == "sum2":
        return [(f"sum {a} {b} =", " ".join(str(a + b))) for a, b in itertools.product(range(10), repeat=2)]
    raise ValueError(f"unknown synthetic task {task!r}; known: {list(SYNTHETIC_TASKS)}")


def build_synthetic_task(
    task: str, tokenizer, heldout_frac: float = 0.2, seed: int = 0, eval_size: int | None = None
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout) prompts of a synthetic task, split by a seeded permutation of all problems."""
    problems = _problems(task)
    order = np.random.default_rng(seed).permutation(len(problems))
    n_heldout = max(1, int(round(heldout_frac * len(problems))))
    heldout_idx, train_idx = order[:n_heldout], order[n_heldout:]
    if eval_size is not None:
        heldout_idx = heldout_idx[:eval_size]

    def make(indices) -> list[Prompt]:
        out = []
        for uid, i in enumerate(indices):
            text, answer = problems[int(i)]
            prompt_ids = tokenizer(text)["input_ids"]
            out.append(
                Prompt(
                    uid=uid,
                    prompt_ids=prompt_ids,
                    answers=answer_patterns(tokenizer, answer, task),
                    text=text,
                    answer_text=answer,
                    meta={"task": task, "problem": int(i)},
                    prompt_text=text,
                )
            )
        return out

    return make(train_idx), make(heldout_idx)
