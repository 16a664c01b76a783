"""JSONL prompt datasets: one object per line with `prompt` (or chat `messages`) and `answer`.

The tokenizer's chat template is applied when the model has one; answers become token-pattern variants
(`rlhf_core.reward.answer_variants`) so that matching in token space survives tokenizer quirks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rlhf_core.data.prompts import Prompt


class DatasetError(ValueError):
    """A dataset file is missing, malformed (error names file:line) or has no usable rows."""


def _prompt_text(row: dict, where: str, tokenizer, system_prompt: str) -> str:
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise DatasetError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise DatasetError(f"{where}: needs a 'prompt' string or a 'messages' list")
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # No chat template: plain concatenation of the contents, the way base models are prompted.
    return "\n\n".join(m["content"] for m in messages)


def load_jsonl_prompts(
    path: str | Path, tokenizer, system_prompt: str = "", max_prompt_tokens: Optional[int] = None
) -> list[Prompt]:
    """Read and tokenize a JSONL dataset. A malformed line fails with `file:line` and the reason."""
    from rlhf_core.reward import answer_variants

    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file {p} does not exist")
    prompts: list[Prompt] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if (
                "answer" not in row
                or not isinstance(row["answer"], (str, int, float))
                or str(row["answer"]).strip() == ""
            ):
                raise DatasetError(f"{where}: needs a non-empty 'answer' (string or number)")
            text = _prompt_text(row, where, tokenizer, system_prompt)
            add_special = not getattr(tokenizer, "chat_template", None)
            ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
            if max_prompt_tokens:
                ids = ids[-max_prompt_tokens:]
            answer = str(row["answer"]).strip()
            variants = answer_variants(tokenizer, answer)
            if not variants:
                raise DatasetError(f"{where}: answer {answer!r} tokenizes to nothing")
            prompts.append(
                Prompt(
                    uid=len(prompts),
                    prompt_ids=ids,
                    answers=variants,
                    text=text,
                    answer_text=answer,
                    meta={
                        "line": lineno,
                        **{k: v for k, v in row.items() if k not in ("prompt", "messages", "answer")},
                    },
                )
            )
    if not prompts:
        raise DatasetError(f"dataset file {p} has no usable rows")
    return prompts
