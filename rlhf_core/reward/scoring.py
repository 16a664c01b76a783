"""Score responses by hand with a run's configured reward, through exactly the code path training runs.

    score_responses("configs/qwen2.5-0.5b-gsm8k.yaml", [ids_of("so #### 72<|im_end|>")], ["72"])
    # -> {'total': [1.1], 'answer_after_marker': [1.0], 'format': [1.0]}   (total = weighted sum, float32)

`Scorer` builds, from a `TrainConfig`, what a rollout worker builds (`rlhf_core.build`): the tokenizer of
`model.path` (or of the tiny default policy), the one stop set (tokenizer EOS, generation_config.json,
rollout.stop_token_ids) and the `ComposedReward`. Answers go through the prompt builder's own steps
(`rlhf_core.data.prepare_answer`, with data.answer_after_marker and its checks, then `answer_patterns` for
data.task) and are packed by `collate_prompts`; responses are right-padded with the pad token, as the
engines return them. A response without a stop token is scored as a truncated one (in training those fill
the whole batch width, so each is scored in a batch of its own length; padding never follows it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from rlhf_core.config import TrainConfig


class Scorer:
    """The configured reward of a run, built once; `score` many batches with it.

    config: a TrainConfig, or the path of a YAML config (with `overrides`, 'dotted.key=value' strings).
    """

    def __init__(self, config: TrainConfig | str | os.PathLike, overrides: Sequence[str] = ()):
        from rlhf_core import build
        from rlhf_core.config import TrainConfig, load_config

        self.cfg = config if isinstance(config, TrainConfig) else load_config(config, overrides)
        self.policy_dir = build.resolve_policy_dir(self.cfg)
        self.tokenizer = build.build_tokenizer(self.cfg, self.policy_dir)
        self.stop_ids = build.build_stop_ids(self.cfg, self.tokenizer, self.policy_dir)
        self.reward = build.build_reward(self.cfg, self.tokenizer, self.stop_ids)
        self.components = list(self.cfg.reward.components)

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

    def score(
        self,
        response_ids: Sequence[Sequence[int]],
        answers: Sequence[str],
        where: Optional[Sequence[str]] = None,
    ) -> dict[str, list[float]]:
        """{'total': [N], component name: [N] (unweighted)} for N responses and their answer texts.

        where: a label per row for error messages (e.g. 'file.jsonl:3'); default 'row i'.
        """
        from rlhf_core.data import DatasetError, Prompt, answer_patterns, collate_prompts, prepare_answer
        from rlhf_core.reward.components import prepare_patterns

        if len(response_ids) != len(answers):
            raise ValueError(f"{len(response_ids)} responses but {len(answers)} answers: give one answer per response")
        labels = list(where) if where is not None else [f"row {i}" for i in range(len(answers))]
        if len(labels) != len(answers):
            raise ValueError(f"{len(labels)} labels in `where` for {len(answers)} rows")
        data_cfg = self.cfg.data
        rows, prompts = [], []
        for i, (ids, raw, label) in enumerate(zip(response_ids, answers, labels)):
            rows.append(self._checked_ids(ids, label))
            text = prepare_answer(
                raw, label, answer_after_marker=data_cfg.answer_after_marker, reward_cfg=self.cfg.reward
            )
            patterns = answer_patterns(self.tokenizer, text, data_cfg.task)
            if not patterns:
                raise DatasetError(f"{label}: answer {text!r} tokenizes to nothing")
            prompts.append(Prompt(uid=i, prompt_ids=[], answers=patterns, answer_text=text))

        out = {name: [0.0] * len(rows) for name in ["total", *self.components]}
        stops, pad = set(self.stop_ids), self.tokenizer.pad_token_id
        groups: dict[Optional[int], list[int]] = {}
        for i, ids in enumerate(rows):
            groups.setdefault(None if stops.intersection(ids) else len(ids), []).append(i)
        for idx in groups.values():
            width = max(len(rows[i]) for i in idx)
            responses = torch.full((len(idx), width), pad, dtype=torch.long)
            for j, i in enumerate(idx):
                responses[j, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
            patterns = prepare_patterns(self.reward, collate_prompts([prompts[i] for i in idx], pad).patterns)
            total, parts = self.reward(responses, patterns)
            for name, values in [("total", total), *parts.items()]:
                for j, v in zip(idx, values.tolist()):
                    out[name][j] = v + 0.0  # no -0.0
        return out


def score_responses(
    config: TrainConfig | str | os.PathLike,
    response_ids: Sequence[Sequence[int]],
    answers: Sequence[str],
    *,
    overrides: Sequence[str] = (),
) -> dict[str, list[float]]:
    """Score responses with the configured reward, as training scores them.

    config: a TrainConfig or a YAML config path (`overrides`: 'dotted.key=value' strings, as `--set`);
    response_ids: N lists of token ids (generated tokens only, no prompt; a row is read up to its first stop
        token); answers: N answer texts (as the dataset's answer field: data.answer_after_marker applies).
    Returns {'total': [N floats], and per configured component: [N floats] (unweighted)}.
    Raises DatasetError (a ValueError) naming the row for an answer the reward could never score, and
    ValueError for a token id outside the vocabulary.
    """
    return Scorer(config, overrides).score(response_ids, answers)
