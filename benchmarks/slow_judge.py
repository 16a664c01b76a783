"""A reward function that waits like a remote judge (an LLM judge, a sandbox, a verifier service): each call
sleeps JUDGE_S seconds without using the CPU and adds nothing to the reward (weight 0 in the benchmark config).
It makes a run rollout-bound by latency, the setting where more rollout workers help even on a small machine
(benchmarks/autoscale.py)."""

import os
import time

JUDGE_S = float(os.environ.get("ATRLHF_JUDGE_S", "0.3"))


def slow_judge(prompts, completions, completion_ids, answer, **columns):
    time.sleep(JUDGE_S)
    return [0.0] * len(completions)
