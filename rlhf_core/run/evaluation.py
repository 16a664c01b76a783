"""Held-out evaluation: greedy decoding on prompts never trained on, scored by the run's own reward, and
optionally n sampled answers per prompt (eval.n_samples) for pass@k and mean@k.

`eval/accuracy` is the fraction of held-out prompts whose greedy answer the reward calls correct: the
first answer-checking component configured (exact_match, answer_after_marker, contains), else a total
reward above 0. `eval/reward_mean` is the mean total reward of those answers. With `eval.metric` naming a
reward column (a component, or a reward function's label: `TrainConfig.eval_metric_names`), eval/accuracy
and eval/<metric> are instead that column's mean over the greedy answers (rows where a function returns
None left out), and a sampled answer counts as correct where the column is above 0. The reward functions
(`external`, their process pool) score the held-out answers when the metric is one of theirs or when the
reward has no component; they add to the total by weight, as in training.

With eval.n_samples = n > 0, every held-out prompt is also answered n times by sampling (eval.temperature,
eval.top_p), each answer judged by the same correctness; with c correct out of n, `eval/pass@k` is the mean
over prompts of the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021: the chance that at least
one of k answers drawn from the n is correct) and `eval/mean@k` the mean of c / n (the expected fraction of
k sampled answers that are correct; unbiased for any k <= n). The literal keys are `eval/pass@k` and
`eval/mean@k`; k is eval.k (a run parameter). Sampling draws from its own seeded random stream, so it
neither perturbs nor depends on the rollout engine's sampling (HF engine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from rlhf_core.data import Prompt, collate_prompts
from rlhf_core.reward.batch import BatchReward
from rlhf_core.reward.components import prepare_patterns
from rlhf_core.rollout import SamplingParams

# Reward components that say whether the answer is right, in order of preference, for eval/accuracy.
ACCURACY_COMPONENTS = ("exact_match", "answer_after_marker", "contains")


def accuracy_from_components(
    total: torch.Tensor, components: dict[str, torch.Tensor], metric: str = "accuracy"
) -> torch.Tensor:
    """1/0 correctness per row [N]: the first answer-checking component configured, else total reward > 0; with
    a `metric` column, where that column is above 0 (NaN: not correct)."""
    if metric != "accuracy":
        return (components[metric] > 0).float()
    for name in ACCURACY_COMPONENTS:
        if name in components:
            return (components[name] > 0).float()
    return (total > 0).float()


PASS_AT_K = "eval/pass@k"
MEAN_AT_K = "eval/mean@k"


def pass_at_k(n: int, correct: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased pass@k per prompt (Chen et al., 2021): 1 - C(n - c, k) / C(n, k), float64 [P].

    n: samples per prompt; correct: correct samples per prompt c, integer-valued [P], 0 <= c <= n; k <= n.
    Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms a binomial coefficient (no overflow
    for large n); when n - c < k one factor is 1 - k/k = 0, so pass@k is exactly 1.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = correct.to(torch.float64).reshape(-1, 1)
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError(f"correct counts must lie in [0, {n}], got {correct.tolist()}")
    i = torch.arange(1, n + 1, dtype=torch.float64, device=c.device)  # [n]
    factors = torch.where(i > n - c, 1.0 - k / i, torch.ones((), dtype=torch.float64, device=c.device))  # [P, n]
    return 1.0 - factors.prod(dim=1)


@contextlib.contextmanager
def _own_random_stream(engine, seed: int):
    """Sample from a generator seeded with `seed`, then give the engine back its own stream untouched (engines
    without a `generator`, e.g. vLLM, sample from theirs)."""
    generator = getattr(engine, "generator", None)
    if not isinstance(generator, torch.Generator):
        yield
        return
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)


@torch.no_grad()
def evaluate(
    engine,
    prompts: Sequence[Prompt],
    reward_fn,
    pad_token_id: int,
    max_new_tokens: int,
    batch_size: int = 256,
    max_prompt_tokens: Optional[int] = None,
    eval_cfg=None,
    seed: int = 0,
    external: Sequence = (),
) -> dict:
    """Greedy decoding on `prompts` with `engine`: eval/accuracy and eval/reward_mean; with an EvalConfig
    whose n_samples > 0 also eval/pass@k and eval/mean@k from n_samples sampled answers per prompt; with
    eval_cfg.metric a reward column, eval/accuracy = eval/<metric> = its mean over the greedy answers.
    external: rewards scored beside the tensor-native one (`RolloutWorker`'s contract: `weights`,
    `score(rows, batch)`), e.g. the reward functions."""
    metric = getattr(eval_cfg, "metric", "accuracy") if eval_cfg is not None else "accuracy"
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    n_samples = eval_cfg.n_samples if eval_cfg is not None else 0
    sampled = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=eval_cfg.temperature if n_samples else 1.0,
        top_p=eval_cfg.top_p if n_samples else 1.0,
    )
    correct, reward_sum, n = 0.0, 0.0, 0
    metric_sum, metric_rows = 0.0, 0
    per_prompt: list[torch.Tensor] = []  # correct samples per prompt [P] per batch
    scorer = BatchReward(reward_fn, external)  # as a rollout worker scores
    for s in range(0, len(prompts), batch_size):
        chunk = list(prompts[s : s + batch_size])
        pb = collate_prompts(chunk, pad_token_id, max_prompt_tokens)
        batch = engine.generate(pb, 1, greedy)
        prepared = prepare_patterns(reward_fn, pb.patterns)  # on the host, once per prompt batch
        total, components = scorer.scored(chunk, batch, prepared.to(batch.response_ids.device))
        if metric == "accuracy":
            correct += float(accuracy_from_components(total, components).sum())
        else:
            values = components[metric].float()
            known = ~torch.isnan(values)
            metric_sum += float(values[known].sum())
            metric_rows += int(known.sum())
        reward_sum += float(total.sum())
        n += len(pb)
        if n_samples:
            with _own_random_stream(engine, seed + s):
                batch = engine.generate(pb, n_samples, sampled)  # rows grouped by prompt: [P * n]
            patterns = prepared.to(batch.response_ids.device).repeat_interleave(n_samples)
            rows = [p for p in chunk for _ in range(n_samples)]
            total, components = scorer.scored(rows, batch, patterns)
            right = accuracy_from_components(total, components, metric)
            per_prompt.append(right.view(len(pb), n_samples).sum(1).cpu())
    # with a metric column: its mean over the rows it applies to (0 when none does)
    accuracy = correct / max(1, n) if metric == "accuracy" else metric_sum / max(1, metric_rows)
    result = {"eval/accuracy": accuracy, "eval/reward_mean": reward_sum / max(1, n)}
    if metric != "accuracy":
        result[f"eval/{metric}"] = result["eval/accuracy"]
    if n_samples and per_prompt:
        c = torch.cat(per_prompt)
        result[PASS_AT_K] = float(pass_at_k(n_samples, c, eval_cfg.k).mean())
        result[MEAN_AT_K] = float((c.double() / n_samples).mean())
    return result


@torch.no_grad()
def evaluate_env(env, engine, prompts: Sequence[Prompt], reward_fn, pad_token_id: int, max_new_tokens: int) -> dict:
    """Multi-turn held-out evaluation: each prompt's episode run once, greedily. eval/accuracy: the fraction
    whose last step's info["success"] is true (or, where the environment gives no success, whose reward is
    positive: env rewards x env.reward_weight + the configured reward of the last model turn); a failed
    episode counts as not solved. Also eval/reward_mean, eval/turns_mean and eval/env_errors, and under
    "eval/trajectories" the first TRACED_TRAJECTORIES episodes as trajectory-file records (rlhf_core.env.score),
    which the flow logs as MLflow traces. All episodes are kept on `env.last_eval`."""
    from rlhf_core.env.score import EVAL_TRAJECTORIES, TRACED_TRAJECTORIES, trajectory_record
    from rlhf_core.rollout.episode_stream import run_episodes
    from rlhf_core.rollout.multiturn_batch import last_turn_batch

    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    trajs = run_episodes(env, engine, prompts, 1, greedy)
    ok = [t for t in trajs if t.error is None and t.turns]
    totals = {id(t): 0.0 for t in trajs}
    if ok:
        batch = last_turn_batch(ok, pad_token_id, engine.version, getattr(engine, "device", "cpu"))
        pb = collate_prompts([t.prompt for t in ok], pad_token_id)
        prepared = prepare_patterns(reward_fn, pb.patterns).to(batch.response_ids.device)
        total, _ = reward_fn(batch.response_ids, prepared)
        for t, r in zip(ok, total.tolist()):
            t.reward = r + env.cfg.reward_weight * t.env_reward
            totals[id(t)] = t.reward
    solved = [t.error is None and (t.success if t.success is not None else totals[id(t)] > 0) for t in trajs]
    env.last_eval = trajs
    n = max(1, len(trajs))
    return {
        "eval/accuracy": sum(solved) / n,
        "eval/reward_mean": sum(totals.values()) / n,
        "eval/turns_mean": sum(t.turns for t in trajs) / n,
        "eval/env_errors": float(sum(t.error is not None for t in trajs)),
        # the first few episodes as trajectory-file records (not a metric): logged as MLflow traces
        EVAL_TRAJECTORIES: [trajectory_record(t) for t in trajs[:TRACED_TRAJECTORIES]],
    }


@dataclass
class Evaluator:
    """Everything held-out evaluation needs, bound once: `evaluator()` scores the engine's current weights."""

    engine: object
    prompts: list[Prompt]
    reward_fn: object
    pad_token_id: int
    max_new_tokens: int
    max_prompt_tokens: Optional[int] = None
    eval_cfg: object = None  # EvalConfig: sampled pass@k / mean@k when its n_samples > 0
    seed: int = 0  # seed of the sampled evaluation's random stream
    env: object = None  # a multi-turn environment's runner (rlhf_core.rollout.multiturn.EnvRunner): episodes
    external: Sequence = ()  # rewards scored beside reward_fn (the reward functions), see `evaluate`
    owns_external: bool = False  # close() closes them (built for this evaluator, not shared)

    def close(self) -> None:
        """Stop the reward-function processes this evaluator started (shared ones stay with their owner)."""
        if self.owns_external:
            for source in self.external:
                if hasattr(source, "close"):
                    source.close()
        self.external = ()

    def __call__(self) -> dict:
        if self.env is not None:
            return evaluate_env(
                self.env, self.engine, self.prompts, self.reward_fn, self.pad_token_id, self.max_new_tokens
            )
        return evaluate(
            self.engine,
            self.prompts,
            self.reward_fn,
            self.pad_token_id,
            self.max_new_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            eval_cfg=self.eval_cfg,
            seed=self.seed,
            external=self.external,
        )


def failed_episodes(result: dict) -> str:
    """What an evaluation line adds when episodes failed (an agent's or an environment's errors): how many; the
    errors themselves were printed once each where they happened."""
    failed = int(result.get("eval/agent_errors", 0) + result.get("eval/env_errors", 0))
    return f"; {failed} episode(s) failed (their errors above), counted as not solved" if failed else ""
