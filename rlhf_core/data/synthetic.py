"""Synthetic tasks for the embedded default: rules a tiny transformer learns from reward alone.

- "max3": "max a b c =" -> the largest of three digits. All 1,000 digit triples are enumerated; a seeded
  `heldout_frac` of them never appear in training and measure generalisation. The rule is learnable
  from reward alone by a 2-layer model (see docs/benchmarks.md for the measured curves).
- "sum2": "sum a b =" -> a + b written as its digits ("sum 7 5 =" -> "1 2"): a multi-token answer and a
  harder second task (100 problems; held-out pairs test whether addition, not a lookup, was learned).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

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

    def render(problem: tuple[str, str]) -> tuple[str, list[int], str, str]:
        text, answer = problem
        return text, tokenizer(text)["input_ids"], answer, text

    return split_prompts(_problems(task), task, tokenizer, heldout_frac, seed, eval_size, render)


def split_prompts(
    problems: list, task: str, tokenizer, heldout_frac: float, seed: int, eval_size: int | None, render: Callable
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout) prompts of a task's `problems`, split by a seeded permutation: `heldout_frac` of them (at
    least one) held out, of which the first `eval_size` are kept. render(problem) -> (text, prompt_ids, answer,
    prompt_text); the answer's token patterns are answer_patterns'. Shared by the synthetic tasks, word-level and
    chat."""
    order = np.random.default_rng(seed).permutation(len(problems))
    n_heldout = max(1, int(round(heldout_frac * len(problems))))
    heldout_idx, train_idx = order[:n_heldout], order[n_heldout:]
    if eval_size is not None:
        heldout_idx = heldout_idx[:eval_size]

    def make(indices) -> list[Prompt]:
        out = []
        for uid, i in enumerate(indices):
            text, prompt_ids, answer, prompt_text = render(problems[int(i)])
            out.append(
                Prompt(
                    uid=uid,
                    prompt_ids=prompt_ids,
                    answers=answer_patterns(tokenizer, answer, task),
                    text=text,
                    answer_text=answer,
                    meta={"task": task, "problem": int(i)},
                    prompt_text=prompt_text,
                )
            )
        return out

    return make(train_idx), make(heldout_idx)
