"""Python reward functions timed by `benchmarks/reward.py --functions`: the GSM8K answer check of
`decode_gsm8k_reward` written as a TRL-style and a verl-style function, and a TRL function that does
nothing (the cost of the pool and the decode alone)."""

import re

GSM8K_NUMBER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]*)?)")


def _canonical(s: str) -> str:
    s = s.replace(",", "").rstrip(".")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def _correct(text: str, answer: str) -> float:
    found = GSM8K_NUMBER.findall(text)
    return 1.0 if found and _canonical(found[-1]) == _canonical(answer) else 0.0


def gsm8k_trl(prompts, completions, completion_ids, answer, **columns):
    return [_correct(c, a) for c, a in zip(completions, answer)]


def gsm8k_verl(data_source, solution_str, ground_truth, extra_info=None):
    return _correct(solution_str, ground_truth)


def nothing_trl(prompts, completions, **columns):
    return [0.0] * len(completions)
