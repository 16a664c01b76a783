"""Prompt data: synthetic tasks, JSONL datasets, and the resumable prompt source."""

from rlhf_core.data.answers import answer_patterns, prepare_answer
from rlhf_core.data.chat_tasks import CHAT_TASKS, build_chat_task
from rlhf_core.data.errors import DatasetError
from rlhf_core.data.jsonl import load_jsonl_prompts, read_jsonl
from rlhf_core.data.prompts import Prompt, PromptBatch, PromptSource, collate_prompts
from rlhf_core.data.synthetic import SYNTHETIC_TASKS, build_synthetic_task

__all__ = [
    "CHAT_TASKS",
    "DatasetError",
    "Prompt",
    "PromptBatch",
    "PromptSource",
    "SYNTHETIC_TASKS",
    "answer_patterns",
    "build_chat_task",
    "build_synthetic_task",
    "collate_prompts",
    "load_jsonl_prompts",
    "build_prompt_splits",
    "prepare_answer",
    "read_jsonl",
]


def build_prompt_splits(data_cfg, tokenizer, reward_cfg=None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout) prompts for a DataConfig.

    reward_cfg: the RewardConfig that will score the run (cfg.reward). JSONL answers it could never score
    (a whole solution still holding reward.marker, a non-number for answer_after_marker) fail at load time
    with file:line; None checks against the RewardConfig defaults.
    """
    if data_cfg.task in CHAT_TASKS:
        return build_chat_task(
            data_cfg.task, tokenizer, data_cfg.heldout_frac, data_cfg.seed, data_cfg.eval_size, data_cfg.system_prompt
        )
    if data_cfg.task in SYNTHETIC_TASKS:
        return build_synthetic_task(data_cfg.task, tokenizer, data_cfg.heldout_frac, data_cfg.seed, data_cfg.eval_size)
    options = dict(
        prompt_key=data_cfg.prompt_key,
        messages_key=data_cfg.messages_key,
        answer_key=data_cfg.answer_key,
        answer_after_marker=data_cfg.answer_after_marker,
        reward_cfg=reward_cfg,
    )
    args = (tokenizer, data_cfg.system_prompt, data_cfg.max_prompt_tokens)
    train = load_jsonl_prompts(data_cfg.train_path, *args, **options)
    if data_cfg.eval_path:
        heldout = load_jsonl_prompts(data_cfg.eval_path, *args, **options)[: data_cfg.eval_size]
    else:
        if len(train) < 2:
            raise DatasetError(
                f"{data_cfg.train_path} has {len(train)} row(s); holding out eval prompts needs at least 2 "
                "(or set data.eval_path)"
            )
        n = min(data_cfg.eval_size, len(train) // 5 or 1)
        heldout, train = train[:n], train[n:]
    return train, heldout
