"""Score responses by hand with a run's whole reward, through exactly the code path training runs.

    score_responses("configs/qwen2.5-0.5b-gsm8k.yaml", [ids_of("so #### 72<|im_end|>")], ["72"])
    # -> {'total': [1.1], 'answer_after_marker': [1.0], 'format': [1.0]}   (total = weighted sum, float32)

`Scorer` builds, from a `TrainConfig`, what a rollout worker builds (`rlhf_core.run.build`): the tokenizer of
`model.path` (or of the tiny default policy), the one stop set (tokenizer EOS, generation_config.json,
rollout.stop_token_ids), the `ComposedReward` and the external rewards: `reward.functions` (in their
process pool) and the reward model when `reward.model.path` is set. The responses are then scored by a
`RolloutWorker` whose engine hands back the given responses instead of generating, so the total is the
training total (components, functions and reward model by weight; a function's None or NaN adds 0) and
every reward column is returned on its own.

Answers go through the prompt builder's own steps (`prepare_answer`, with data.answer_after_marker and its
checks, then `answer_patterns` for data.task); a row's prompt, when given (a text or chat messages, as a
dataset row's prompt), is rendered with the model's chat template and data.system_prompt as in training;
responses are right-padded with the pad token, as the engines return them. A response without a stop token
is scored as a truncated one (in training those fill the whole batch width, so each is scored in a batch of
its own length; padding never follows it).

This module sits above `rlhf_core.run.build` (it builds a run's parts), beside `evaluation` and the loop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf_core.config import TrainConfig, load_config
from rlhf_core.data import DatasetError, Prompt, PromptBatch, answer_patterns, get_field, prepare_answer, read_jsonl
from rlhf_core.data.rows import RowKeys, prompt_messages, render_prompt
from rlhf_core.rollout import RolloutWorker, SamplingParams, response_mask_from_eos
from rlhf_core.run import build
from rlhf_core.types import RolloutBatch


class _GivenResponses:
    """A rollout engine that returns the responses it was given (one per prompt) instead of generating."""

    version = 0

    def __init__(self, responses: torch.Tensor, stop_ids: Sequence[int]):
        self.responses = responses
        self.stop_ids = list(stop_ids)

    def generate(
        self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams, between_steps=None
    ) -> RolloutBatch:
        n, width = self.responses.shape
        mask = response_mask_from_eos(self.responses, self.stop_ids)
        zeros = torch.zeros(n, dtype=torch.long)
        return RolloutBatch(
            prompt_ids=prompts.prompt_ids,
            prompt_mask=prompts.prompt_mask,
            response_ids=self.responses,
            response_mask=mask,
            behavior_logprobs=torch.zeros((n, width)),
            response_lengths=mask.sum(-1),
            group_ids=torch.arange(n),
            policy_version=zeros,
        )


class Scorer:
    """The configured reward of a run (components, functions, reward model), built once; `score` many batches
    with it; `close()` (or `with Scorer(...) as s:`) stops the reward-function processes.

    config: a TrainConfig, or the path of a YAML config (with `overrides`, 'dotted.key=value' strings).
    """

    def __init__(self, config: TrainConfig | str | os.PathLike, overrides: Sequence[str] = ()):
        self.cfg = config if isinstance(config, TrainConfig) else load_config(config, overrides)
        self.policy_dir = build.resolve_policy_dir(self.cfg)
        self.tokenizer = build.build_tokenizer(self.cfg, self.policy_dir)
        self.stop_ids = build.build_stop_ids(self.cfg, self.tokenizer, self.policy_dir)
        self.reward = build.build_reward(self.cfg, self.tokenizer, self.stop_ids)
        self.external = build.build_external_rewards(self.cfg, self.tokenizer, self.stop_ids)
        self.columns = self.cfg.reward.column_names()
        self.components = list(self.cfg.reward.components)

    def close(self) -> None:
        for source in self.external:
            if hasattr(source, "close"):
                source.close()
        self.external = []

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a response text: the tokenizer with no special tokens added (special-token text in it,
        such as '<|im_end|>', becomes that token)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _checked_ids(self, ids, where: str) -> list[int]:
        vocab = len(self.tokenizer)
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"{where}: response ids must be a list of token ids, got {type(ids).__name__}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(
                    f"{where}: token id {t!r} is not an id of the vocabulary of {self.policy_dir} (0..{vocab - 1})"
                )
        return list(ids)

    def _prompt(self, i: int, text: str, prompt: Any, meta: Optional[dict], label: str) -> Prompt:
        """Row i's Prompt, as a prompt builder makes it: answer patterns of data.task, the prompt rendered with
        the chat template and data.system_prompt (a chat message list keeps its messages for the functions)."""
        patterns = answer_patterns(self.tokenizer, text, self.cfg.data.task)
        if not patterns:
            raise DatasetError(f"{label}: answer {text!r} tokenizes to nothing")
        ids, rendered, messages = [], "", None
        if prompt is not None:
            if isinstance(prompt, str):
                turns, conversational = [{"role": "user", "content": prompt}], False
            elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt) and prompt:
                turns, conversational = [dict(m) for m in prompt], True
            else:
                raise DatasetError(f"{label}: the prompt must be a string or a list of chat messages")
            rendered, turns = render_prompt(turns, self.tokenizer, self.cfg.data.system_prompt)
            chat = bool(getattr(self.tokenizer, "chat_template", None))
            ids = self.tokenizer(rendered, add_special_tokens=not chat)["input_ids"]
            messages = turns if conversational else None
        meta = dict(meta or {})
        return Prompt(i, ids, patterns, text=rendered, answer_text=text, meta=meta, messages=messages)

    def score(
        self,
        response_ids: Sequence[Sequence[int]],
        answers: Sequence[str],
        where: Optional[Sequence[str]] = None,
        prompts: Optional[Sequence[Any]] = None,
        meta: Optional[Sequence[dict]] = None,
    ) -> dict[str, list[float]]:
        """{'total': [N], column name: [N] (unweighted)} for N responses and their answer texts, in the order
        of `RewardConfig.column_names()` (components, functions' columns, reward_model); NaN where a function
        does not apply to a row (its None or NaN).

        where: a label per row for error messages (e.g. 'file.jsonl:3'); default 'row i'.
        prompts: per row, its prompt (a text or a chat message list, as a dataset row's), or None: the reward
            functions get it as `prompts` and the reward model scores prompt + response. Default: no prompt.
        meta: per row, the dataset columns the reward functions get as keyword arguments (verl's data_source,
            reward_model, extra_info, ...).
        """
        n = len(answers)
        if len(response_ids) != n:
            raise ValueError(f"{len(response_ids)} responses but {n} answers: give one answer per response")
        labels = list(where) if where is not None else [f"row {i}" for i in range(n)]
        for name, given in (("labels in `where`", labels), ("prompts", prompts), ("meta", meta)):
            if given is not None and len(given) != n:
                raise ValueError(f"{len(given)} {name} for {n} rows")
        data_cfg = self.cfg.data
        rows, items = [], []
        for i, (ids, raw, label) in enumerate(zip(response_ids, answers, labels)):
            rows.append(self._checked_ids(ids, label))
            text = prepare_answer(
                raw, label, answer_after_marker=data_cfg.answer_after_marker, reward_cfg=self.cfg.reward
            )
            prompt = prompts[i] if prompts is not None else None
            items.append(self._prompt(i, text, prompt, meta[i] if meta is not None else None, label))

        out = {name: [0.0] * n for name in ["total", *self.columns]}
        stops, pad = set(self.stop_ids), self.tokenizer.pad_token_id
        groups: dict[Optional[int], list[int]] = {}
        for i, ids in enumerate(rows):
            groups.setdefault(None if stops.intersection(ids) else len(ids), []).append(i)
        for idx in groups.values():
            width = max(1, max(len(rows[i]) for i in idx))
            responses = torch.full((len(idx), width), pad, dtype=torch.long)
            for j, i in enumerate(idx):
                responses[j, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
            worker = RolloutWorker(
                _GivenResponses(responses, self.stop_ids),
                self.reward,
                SamplingParams(max_new_tokens=width),
                1,
                pad,
                data_cfg.max_prompt_tokens,
                component_names=self.columns,
                external=self.external,
            )
            batch, parts = worker.rollout([items[i] for i in idx])
            for name, values in [("total", batch.rewards), *((c, parts[c]) for c in self.columns)]:
                for j, v in zip(idx, values.tolist()):
                    out[name][j] = v + 0.0  # no -0.0
        return out


def score_responses(
    config: TrainConfig | str | os.PathLike,
    response_ids: Sequence[Sequence[int]],
    answers: Sequence[str],
    *,
    prompts: Optional[Sequence[Any]] = None,
    meta: Optional[Sequence[dict]] = None,
    overrides: Sequence[str] = (),
) -> dict[str, list[float]]:
    """Score responses with the run's whole configured reward, as training scores them.

    config: a TrainConfig or a YAML config path (`overrides`: 'dotted.key=value' strings, as `--set`);
    response_ids: N lists of token ids (generated tokens only, no prompt; a row is read up to its first stop
        token); answers: N answer texts (as the dataset's answer field: data.answer_after_marker applies);
    prompts, meta: optional, per row (see `Scorer.score`).
    Returns {'total': [N floats], then per reward column (`RewardConfig.column_names()`: components, each
    function's score and <label>/failed, reward_model): [N floats] (unweighted; NaN where a function does
    not apply)}. Raises DatasetError (a ValueError) naming the row for an answer the reward could never
    score, and ValueError for a token id outside the vocabulary.
    """
    with Scorer(config, overrides) as scorer:
        return scorer.score(response_ids, answers, prompts=prompts, meta=meta)


RESPONSE_KEYS = ("response", "response_ids")
DEFAULT_KEYS = RowKeys()


def read_score_input(path: str | Path, keys: RowKeys = DEFAULT_KEYS) -> list[dict]:
    """The rows of a score input file (JSONL): [{'line', 'where', 'answer', 'response' or 'response_ids',
    'prompt', 'meta'}]. Each line holds the answer (under keys.answer_key, dotted for a nested one), exactly one
    of 'response' (text) or 'response_ids' (token ids), and optionally the prompt as a dataset row holds it
    (keys.messages_key or keys.prompt_key: a text or chat messages; 'prompt' is None without one); every other
    key is a column the reward functions get ('meta'). DatasetError names file:line (not UTF-8, invalid JSON, a
    missing key with the keys found, both or neither response form)."""
    rows = []
    for lineno, where, row in read_jsonl(path):
        answer = get_field(row, keys.answer_key, None)  # dotted keys reach nested objects, as in the datasets
        if answer is None and row.get(keys.answer_key, 0) is None:
            raise DatasetError(f"{where}: {keys.answer_key!r} is null; write the answer (text or a number) there")
        if answer is None:
            raise DatasetError(
                f"{where}: no {keys.answer_key!r} key (the line has keys {sorted(row)}); write the answer under "
                f"{keys.answer_key!r} or set data.answer_key"
            )
        given = [k for k in RESPONSE_KEYS if k in row]
        if len(given) != 1:
            raise DatasetError(
                f"{where}: needs exactly one of 'response' (text) or 'response_ids' (token ids); the line has keys "
                f"{sorted(row)}"
            )
        value = row[given[0]]
        if given[0] == "response" and not isinstance(value, str):
            raise DatasetError(f"{where}: 'response' must be a string, got {type(value).__name__}")
        if given[0] == "response_ids" and not isinstance(value, list):
            raise DatasetError(f"{where}: 'response_ids' must be a list of token ids, got {type(value).__name__}")
        prompt, prompt_key = None, None
        if get_field(row, keys.messages_key, None) is not None or get_field(row, keys.prompt_key, None) is not None:
            prompt_key, messages, conversational = prompt_messages(row, where, keys)
            prompt = messages if conversational else messages[0]["content"]
        top = None if prompt_key is None else prompt_key if prompt_key in row else prompt_key.split(".")[0]
        meta = {k: v for k, v in row.items() if k not in RESPONSE_KEYS and k != top}
        rows.append({"line": lineno, "where": where, "answer": answer, given[0]: value, "prompt": prompt, "meta": meta})
    if not rows:
        raise DatasetError(f"{path} has no lines to score")
    return rows


def score_file(scorer: Scorer, path: str | Path) -> tuple[list[dict], list[list[int]], dict[str, list[float]]]:
    """(the rows of a score input file, their response token ids, their scores) with `scorer`'s whole reward;
    a 'response' text is tokenized with NO special tokens added (`Scorer.tokenize`)."""
    rows = read_score_input(path, RowKeys.from_config(scorer.cfg.data, scorer.cfg.reward))
    ids = [scorer.tokenize(r["response"]) if "response" in r else r["response_ids"] for r in rows]
    scores = scorer.score(
        ids,
        [r["answer"] for r in rows],
        where=[r["where"] for r in rows],
        prompts=[r["prompt"] for r in rows],
        meta=[r["meta"] for r in rows],
    )
    return rows, ids, scores


def column_means(scores: dict[str, list[float]]) -> dict[str, float]:
    """Each column's mean over the rows it applies to (NaN rows left out, as the trainer logs reward/<name>);
    NaN for a column that applies to no row."""
    means = {}
    for name, values in scores.items():
        applied = [v for v in values if not math.isnan(v)]
        means[name] = sum(applied) / len(applied) if applied else math.nan
    return means


def reward_terms(cfg: TrainConfig) -> list[tuple[str, float]]:
    """(name, weight) of every term of the run's total reward: components, functions, the reward model, the
    overlong penalty."""
    terms = list(cfg.reward.components.items()) + [(f.metric_name, f.weight) for f in cfg.reward.functions]
    terms += [("reward_model", cfg.reward.model.weight)] if cfg.reward.model.path else []
    return terms + ([("overlong", 1.0)] if cfg.reward.overlong is not None else [])
