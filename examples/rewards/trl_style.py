"""A TRL-style reward function for `reward.functions` (see docs/rewards.md).

TRL's signature: called once per chunk of rows with lists (prompts, completions, completion_ids) and every
dataset column as a keyword list (`answer` is the row's answer text); returns one float per row, or None
for a row the function does not apply to. Conversational prompts arrive as message lists, and completions
then as [{"role": "assistant", "content": ...}].

    reward.functions: [{path: examples/rewards/trl_style.py, name: last_number_matches, weight: 1.0}]
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_matches(prompts, completions, completion_ids, answer, **columns):
    """1.0 when the last number in the completion equals the answer, 0.0 when it differs, None when the
    answer is not a number (the row is then left out of reward/last_number_matches)."""
    scores = []
    for completion, truth in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        if not NUMBER.fullmatch(str(truth).strip()):
            scores.append(None)
            continue
        numbers = NUMBER.findall(text)
        scores.append(1.0 if numbers and float(numbers[-1]) == float(truth) else 0.0)
    return scores
