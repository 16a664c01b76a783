"""Prompt data: synthetic tasks, JSONL datasets, and the resumable prompt source."""

from rlhf_core.data.jsonl import DatasetError, load_jsonl_prompts
from rlhf_core.data.prompts import Prompt, PromptBatch, PromptSource, collate_prompts
from rlhf_core.data.synthetic import SYNTHETIC_TASKS, build_synthetic_task

__all__ = [
    "DatasetError",
    "Prompt",
    "PromptBatch",
    "PromptSource",
    "SYNTHETIC_TASKS",
    "build_synthetic_task",
    "collate_prompts",
    "load_jsonl_prompts",
    "build_prompt_splits",
]


def build_prompt_splits(data_cfg, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout) prompts for a DataConfig."""
    if data_cfg.task in SYNTHETIC_TASKS:
        return build_synthetic_task(data_cfg.task, tokenizer, data_cfg.heldout_frac, data_cfg.seed, data_cfg.eval_size)
    train = load_jsonl_prompts(data_cfg.train_path, tokenizer, data_cfg.system_prompt, data_cfg.max_prompt_tokens)
    if data_cfg.eval_path:
        heldout = load_jsonl_prompts(data_cfg.eval_path, tokenizer, data_cfg.system_prompt, data_cfg.max_prompt_tokens)[
            : data_cfg.eval_size
        ]
    else:
        if len(train) < 2:
            raise DatasetError(
                f"{data_cfg.train_path} has {len(train)} row(s); holding out eval prompts needs at least 2 "
                "(or set data.eval_path)"
            )
        n = min(data_cfg.eval_size, len(train) // 5 or 1)
        heldout, train = train[:n], train[n:]
    return train, heldout
