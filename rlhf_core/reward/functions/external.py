"""Python reward functions as an external reward of the rollout worker (`reward.functions`).

`PythonFunctionRewards.score(prompts, batch)` decodes each response up to the run's stop set with the policy
tokenizer, calls every configured function in the worker's process pool (`pool.FunctionPool`: TRL
functions once per chunk of rows, verl functions once per row, each call with its own deadline from
reward.function_timeout_s) and returns per-row tensors, one per reward column (`RewardConfig.column_names`):

  <label>          the function's score; NaN where it returned None or NaN ("does not apply", as TRL reads
                   both): the rollout worker adds 0 for such a row to the total, and the logged mean
                   reward/<label> leaves it out (a NaN-ignoring mean); a failed call scores 0 (not NaN) and
                   counts in the mean
  <label>/failed   1.0 where the call raised or timed out, else 0.0 (its mean: the failure rate)
  <label>/<key>    a verl dict's extra value for each key in the function's `metrics`; NaN where absent

A failing call (it raised, timed out, or its process was killed past its deadline) is counted once, however
many rows it covered, and reported (a warning with the batch's and the run's failure counts and the first
error); after supervision.max_consecutive_failures failed calls in a row, `score` raises RewardFunctionError with
the error, which fails the run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from rlhf_core.config import RewardConfig
from rlhf_core.config.base import MAX_CONSECUTIVE_FAILURES
from rlhf_core.reward.functions.pool import Call, FunctionPool

log = logging.getLogger("rlhf_core.reward")


class RewardFunctionError(RuntimeError):
    """A Python reward function failed supervision.max_consecutive_failures calls in a row."""


def completion_ids(response_ids: torch.Tensor, response_mask: torch.Tensor, stop_ids: Sequence[int]) -> list[list[int]]:
    """Each row's generated ids before its first stop token (batched: one isin, one argmax, one transfer)."""
    stops = torch.isin(response_ids, torch.tensor(list(stop_ids), dtype=response_ids.dtype, device=response_ids.device))
    stops &= response_mask.bool()
    has_stop = stops.any(-1)
    lengths = torch.where(has_stop, stops.int().argmax(-1), response_mask.sum(-1))
    rows = response_ids.tolist()
    return [row[:n] for row, n in zip(rows, lengths.tolist())]


def _chunks(n: int, parts: int) -> list[range]:
    size = max(1, math.ceil(n / parts))
    return [range(s, min(n, s + size)) for s in range(0, n, size)]


class PythonFunctionRewards:
    """The configured `reward.functions` of one rollout worker, with their long-lived process pool.

    weights: {label: weight} (the external-reward contract: the worker adds sum(weight x score) to the
    rewards); columns: every name `score` returns, in order."""

    def __init__(
        self, reward_cfg: RewardConfig, tokenizer, stop_ids: Sequence[int], max_failures: int = MAX_CONSECUTIVE_FAILURES
    ):
        """max_failures: failed calls of one function in a row that stop the run
        (supervision.max_consecutive_failures)."""
        self.cfg = reward_cfg
        self.max_failures = max_failures
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids)
        self.specs = list(reward_cfg.functions)
        self.labels = [f.metric_name for f in self.specs]
        self.weights = {f.metric_name: float(f.weight) for f in self.specs}
        self.columns = reward_cfg.function_column_names()
        self.workers = reward_cfg.function_workers
        self.pool = FunctionPool(
            [(f.path, f.name, f"reward.functions[{i}] ({f.metric_name})") for i, f in enumerate(self.specs)],
            self.workers,
            reward_cfg.function_timeout_s,
        )
        self.kinds = self.pool.kinds
        n = len(self.specs)
        self.calls = [0] * n
        self.failures = [0] * n
        self.consecutive = [0] * n
        self.first_error: list[str | None] = [None] * n
        self.warned_keys: set[tuple[int, str]] = set()

    def close(self) -> None:
        self.pool.close()

    # ------------------------------------------------------------------ inputs
    def _inputs(self, prompts: Sequence, batch) -> tuple[dict, list[dict]]:
        """TRL keyword arguments over all rows, and verl's per-row arguments."""
        ids = completion_ids(batch.response_ids, batch.response_mask, self.stop_ids)
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        messages = [getattr(p, "messages", None) or p.meta.get("messages") for p in prompts]
        trl = {
            "prompts": [m if m else p.text for p, m in zip(prompts, messages)],
            "completions": [[{"role": "assistant", "content": t}] if m else t for t, m in zip(texts, messages)],
            "completion_ids": ids,
            "answer": [p.answer_text for p in prompts],
        }
        keys = dict.fromkeys(k for p in prompts for k in p.meta if k not in trl and k != "messages")
        trl.update({k: [p.meta.get(k) for p in prompts] for k in keys})
        verl = []
        for p, text in zip(prompts, texts):
            reward_model = p.meta.get("reward_model")
            truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
            verl.append(
                {
                    "data_source": p.meta.get("data_source", p.meta.get("task", "")),
                    "solution_str": text,
                    "ground_truth": truth if truth is not None else p.answer_text,
                    "extra_info": p.meta.get("extra_info"),
                }
            )
        return trl, verl

    # ------------------------------------------------------------------ scoring
    def score(self, prompts: Sequence, batch) -> dict[str, torch.Tensor]:
        """{column: FloatTensor [N]} for N rows; `prompts` row-aligned with the batch (repeated per completion)."""
        n = len(batch)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for a batch of {n} rows: repeat each prompt per completion")
        trl, verl = self._inputs(prompts, batch)
        calls, owners = [], []
        for f, kind in enumerate(self.kinds):
            for rows in _chunks(n, self.workers):
                if kind == "trl":
                    payload = {k: v[rows.start : rows.stop] for k, v in trl.items()}
                else:
                    payload = verl[rows.start : rows.stop]
                calls.append(Call(f, kind, payload, len(rows)))
                owners.append((f, rows))
        results = self.pool.run(calls)

        nan = float("nan")
        values = [[nan] * n for _ in self.specs]
        failed = [[0.0] * n for _ in self.specs]
        extras = [{k: [nan] * n for k in spec.metrics} for spec in self.specs]
        batch_failures = [0] * len(self.specs)
        for (f, rows), out, call in zip(owners, results, calls):
            errors = [e for _, _, e in out]
            call_results = [errors[0]] if call.kind == "trl" else errors  # TRL: one call for the chunk; verl: per row
            for error in call_results:
                self.calls[f] += 1
                if error is None:
                    self.consecutive[f] = 0
                    continue
                self.failures[f] += 1
                batch_failures[f] += 1
                self.consecutive[f] += 1
                self.first_error[f] = self.first_error[f] or error
                if self.consecutive[f] >= self.max_failures:
                    raise RewardFunctionError(
                        f"reward function {self.labels[f]} (reward.functions[{f}], {self.specs[f].name} in "
                        f"{self.specs[f].path or 'built-ins'}) failed {self.consecutive[f]} calls in a row "
                        f"(supervision.max_consecutive_failures={self.max_failures}): {error}"
                    )
            for i, (value, extra, error) in zip(rows, out):
                if error is not None:
                    values[f][i], failed[f][i] = 0.0, 1.0
                    continue
                values[f][i] = nan if value is None else value
                for key, v in extra.items():
                    if key in extras[f]:
                        extras[f][key][i] = v
                    elif (f, key) not in self.warned_keys:
                        self.warned_keys.add((f, key))
                        log.warning(
                            "reward function %s returned metric %r, not logged: add it to reward.functions[%d].metrics",
                            self.labels[f],
                            key,
                            f,
                        )
        for f, count in enumerate(batch_failures):
            if count:
                log.warning(
                    "reward function %s: %d failed call(s) in this batch, scored 0 (%d of %d calls in the run); "
                    "first error: %s",
                    self.labels[f],
                    count,
                    self.failures[f],
                    self.calls[f],
                    self.first_error[f],
                )

        device = batch.response_ids.device
        out: dict[str, torch.Tensor] = {}
        for f, label in enumerate(self.labels):
            out[label] = torch.tensor(values[f], dtype=torch.float32, device=device)
            out[f"{label}/failed"] = torch.tensor(failed[f], dtype=torch.float32, device=device)
            for key, column in extras[f].items():
                out[f"{label}/{key}"] = torch.tensor(column, dtype=torch.float32, device=device)
        return out

    def stats(self) -> dict:
        """Per function: calls, failures and the first error, over the run so far."""
        return {
            label: {"calls": self.calls[f], "failures": self.failures[f], "first_error": self.first_error[f]}
            for f, label in enumerate(self.labels)
        }
