"""Synthetic tasks in chat format, for chat models (a local one built by rlhf_core.model.chat, or a real one).

- "max3_chat": the user asks for the maximum of three digits and to end with '#### <number>'; the prompt
  is the model's chat template with the generation prompt added. Answers are scored after the marker
  (reward component answer_after_marker), the way GSM8K is. All 1,000 digit triples are enumerated and a
  seeded `heldout_frac` of them is held out, as for the word-level "max3".
"""

from __future__ import annotations

import itertools

from rlhf_core.data.prompts import Prompt
from rlhf_core.data.synthetic import split_prompts
from rlhf_core.model.chat import max3_question

CHAT_TASKS = ("max3_chat",)


def build_chat_task(
    task: str,
    tokenizer,
    heldout_frac: float = 0.2,
    seed: int = 0,
    eval_size: int | None = None,
    system_prompt: str = "",
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout) prompts of a chat-format synthetic task, split by a seeded permutation."""
    if task not in CHAT_TASKS:
        raise ValueError(f"unknown chat task {task!r}; known: {list(CHAT_TASKS)}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"data.task {task!r} needs a model with a chat template (model.preset: tiny-chat, or a chat "
            "model in model.path)"
        )

    def render(problem: tuple[int, int, int]) -> tuple[str, list[int], str, str]:
        question = max3_question(*problem)
        messages = [{"role": "user", "content": question}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"], str(max(problem)), question

    problems = list(itertools.product(range(10), repeat=3))
    return split_prompts(problems, task, tokenizer, heldout_frac, seed, eval_size, render)
