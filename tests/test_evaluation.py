"""Sampled held-out evaluation: the unbiased pass@k estimator against brute-force enumeration, and
eval/pass@k, eval/mean@k from the evaluator beside greedy eval/accuracy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.run import build
from rlhf_core.run.evaluation import MEAN_AT_K, PASS_AT_K, pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of the k-subsets of n samples (c of them correct) holding at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_over_every_subset():
    for n in range(1, 8):
        for k in range(1, n + 1):
            c = torch.arange(n + 1)
            got = pass_at_k(n, c, k)
            want = torch.tensor([brute_force_pass_at_k(n, int(ci), k) for ci in c], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows float64; the product form does not need it
    n, k = 1000, 500
    got = pass_at_k(n, torch.tensor([0, 1, 2, 501, 1000]), k)
    assert got[0] == 0.0 and got[3] == 1.0 and got[4] == 1.0
    assert math.isclose(float(got[1]), 0.5, abs_tol=1e-12)  # one correct sample: in half of the subsets
    assert math.isclose(float(got[2]), 1 - (500 * 499) / (1000 * 999), abs_tol=1e-12)
    assert math.isclose(float(pass_at_k(200, torch.tensor([3]), 1)), 3 / 200, abs_tol=1e-15)  # pass@1 = c/n


def test_pass_at_k_refuses_impossible_arguments():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, torch.tensor([1]), 5)
    with pytest.raises(ValueError, match=r"correct counts must lie in \[0, 4\]"):
        pass_at_k(4, torch.tensor([5]), 2)


@pytest.fixture
def evaluator_parts(tiny_policy_dir, tiny_model, max3_prompts):
    def make(*overrides):
        cfg = load_config(None, ["rollout.max_new_tokens=2", *overrides])
        tok = build.build_tokenizer(cfg, tiny_policy_dir)
        return build.build_evaluator(cfg, tiny_model, tok, tiny_policy_dir, max3_prompts[1][:24])

    return make


def test_greedy_only_by_default(evaluator_parts):
    result = evaluator_parts()()
    assert set(result) == {"eval/accuracy", "eval/reward_mean"}


def test_near_greedy_sampling_agrees_with_greedy_accuracy(evaluator_parts):
    """At a temperature where sampling is argmax, every sample is the greedy answer: the correctness pass@k
    and mean@k count is exactly the one eval/accuracy counts."""
    result = evaluator_parts("eval.n_samples=3", "eval.k=2", "eval.temperature=1e-6")()
    assert result[PASS_AT_K] == pytest.approx(result["eval/accuracy"], abs=1e-12)
    assert result[MEAN_AT_K] == pytest.approx(result["eval/accuracy"], abs=1e-12)


def test_sampled_evaluation_keys_are_consistent_and_leave_the_engine_stream_alone(evaluator_parts):
    evaluator = evaluator_parts("eval.n_samples=6", "eval.k=1", "eval.temperature=1.5")
    before = evaluator.engine.generator.get_state()
    first = evaluator()
    assert torch.equal(evaluator.engine.generator.get_state(), before)  # the rollout stream is untouched
    assert first == evaluator()  # seeded: the same weights give the same figures
    assert 0.0 <= first[MEAN_AT_K] <= 1.0
    assert first[PASS_AT_K] == pytest.approx(first[MEAN_AT_K], abs=1e-12)  # pass@1 is the mean correctness
    wider = evaluator_parts("eval.n_samples=6", "eval.k=4", "eval.temperature=1.5")()
    assert wider[MEAN_AT_K] == first[MEAN_AT_K]  # same samples (same seed), other k
    assert wider[PASS_AT_K] >= first[PASS_AT_K]  # more tries can only help
    assert wider[PASS_AT_K] <= 1.0
