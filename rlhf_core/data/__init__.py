"""Prompt data: synthetic tasks, JSONL and `datasets` tables (parquet, JSON, saved directories, the hub), and the
resumable prompt source."""

from typing import Optional

from rlhf_core.data.answers import answer_patterns, prepare_answer
from rlhf_core.data.chat_tasks import CHAT_TASKS, build_chat_task
from rlhf_core.data.dataset import load_dataset_prompts, read_dataset
from rlhf_core.data.errors import DatasetError
from rlhf_core.data.jsonl import load_jsonl_prompts, read_jsonl
from rlhf_core.data.prompts import PrioritizedSource, Prompt, PromptBatch, PromptSource, collate_prompts, prompt_source
from rlhf_core.data.rows import RowKeys, get_field, row_to_prompt
from rlhf_core.data.synthetic import SYNTHETIC_TASKS, build_synthetic_task

__all__ = [
    "CHAT_TASKS",
    "DatasetError",
    "PrioritizedSource",
    "Prompt",
    "PromptBatch",
    "PromptSource",
    "RowKeys",
    "SYNTHETIC_TASKS",
    "answer_patterns",
    "build_chat_task",
    "build_synthetic_task",
    "collate_prompts",
    "get_field",
    "load_dataset_prompts",
    "load_jsonl_prompts",
    "build_prompt_splits",
    "prepare_answer",
    "prompt_source",
    "read_dataset",
    "read_jsonl",
    "row_to_prompt",
]


def build_prompt_splits(data_cfg, tokenizer, reward_cfg=None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout) prompts for a DataConfig.

    reward_cfg: the RewardConfig that will score the run (cfg.reward). File answers it could never score
    (a whole solution still holding reward.marker, a non-number for answer_after_marker) fail at load time
    naming the file and row; None checks against the RewardConfig defaults.
    """
    if data_cfg.task in CHAT_TASKS:
        return build_chat_task(
            data_cfg.task, tokenizer, data_cfg.heldout_frac, data_cfg.seed, data_cfg.eval_size, data_cfg.system_prompt
        )
    if data_cfg.task in SYNTHETIC_TASKS:
        return build_synthetic_task(data_cfg.task, tokenizer, data_cfg.heldout_frac, data_cfg.seed, data_cfg.eval_size)
    keys = RowKeys.from_config(data_cfg, reward_cfg)
    common = (tokenizer, data_cfg.system_prompt, data_cfg.max_prompt_tokens)

    def load(path: str, split: str, limit: Optional[int] = None) -> list[Prompt]:
        if data_cfg.task == "dataset":
            return load_dataset_prompts(path, common[0], keys, *common[1:], split=split, limit=limit)
        options = {k: getattr(keys, k) for k in ("prompt_key", "messages_key", "answer_key", "answer_after_marker")}
        return load_jsonl_prompts(path, *common, **options, reward_cfg=reward_cfg)[:limit]

    train = load(data_cfg.train_path, data_cfg.train_split)
    if data_cfg.eval_path:
        heldout = load(data_cfg.eval_path, data_cfg.eval_split, data_cfg.eval_size)
    else:
        if len(train) < 2:
            raise DatasetError(
                f"{data_cfg.train_path} has {len(train)} row(s); holding out eval prompts needs at least 2 "
                "(or set data.eval_path)"
            )
        n = min(data_cfg.eval_size, len(train) // 5 or 1)
        heldout, train = train[:n], train[n:]
    return train, heldout
