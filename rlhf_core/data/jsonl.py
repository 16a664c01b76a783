"""JSONL prompt datasets: one UTF-8 JSON object per line with `prompt` (or chat `messages`) and `answer`.

The key names are configurable (data.prompt_key, data.messages_key, data.answer_key), and with
data.answer_after_marker a whole worked solution ('... #### 72') is reduced to the text after its last
reward marker, so raw GSM8K lines ({"question", "answer"}) load as they are. The tokenizer's chat template
is applied when the model has one; answers become token-pattern variants (`rlhf_core.data.answer_patterns`)
so that matching in token space survives tokenizer quirks. Every refusal names `file:line` and what to do,
including answers the configured reward could never score (`rlhf_core.data.answers.prepare_answer`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from rlhf_core.data.answers import answer_patterns, prepare_answer
from rlhf_core.data.errors import DatasetError
from rlhf_core.data.prompts import Prompt

__all__ = ["DatasetError", "load_jsonl_prompts", "read_jsonl"]


def read_jsonl(path: str | Path) -> Iterator[tuple[int, str, dict]]:
    """(line number, 'file:line', object) for every non-blank line of a UTF-8 JSONL file.

    Raises DatasetError naming the file (missing) or `file:line` (not UTF-8, invalid JSON, not an object).
    A UTF-8 byte-order mark on the first line is accepted.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file {p} does not exist")
    with p.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at byte {exc.start + 1} of the line); "
                    f"datasets are read as UTF-8: re-encode the file, e.g. `iconv -f latin1 -t utf-8 {p} > "
                    f"{p.stem}.utf8{p.suffix}`"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield lineno, where, row


def _prompt_text(
    row: dict, where: str, tokenizer, system_prompt: str, prompt_key: str = "prompt", messages_key: str = "messages"
) -> str:
    if messages_key in row:
        messages = row[messages_key]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise DatasetError(f"{where}: {messages_key!r} must be a list of {{'role', 'content'}} objects")
    elif prompt_key in row:
        if not isinstance(row[prompt_key], str) or not row[prompt_key].strip():
            raise DatasetError(f"{where}: {prompt_key!r} must be a non-empty string")
        messages = [{"role": "user", "content": row[prompt_key]}]
    else:
        raise DatasetError(
            f"{where}: no prompt: needs a {prompt_key!r} string or a {messages_key!r} list, and the line has keys "
            f"{sorted(row)}; set data.prompt_key (or data.messages_key) to the key that holds it"
        )
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # No chat template: plain concatenation of the contents, the way base models are prompted.
    return "\n\n".join(m["content"] for m in messages)


def load_jsonl_prompts(
    path: str | Path,
    tokenizer,
    system_prompt: str = "",
    max_prompt_tokens: Optional[int] = None,
    *,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    answer_key: str = "answer",
    answer_after_marker: bool = False,
    reward_cfg=None,
) -> list[Prompt]:
    """Read and tokenize a JSONL dataset. A malformed line fails with `file:line` and the reason.

    prompt_key / messages_key / answer_key: where each line keeps its prompt text, its chat messages (used
    when present) and its answer; answer_after_marker and reward_cfg (the RewardConfig that will score the
    run; None = its defaults) are handed to `prepare_answer`, which refuses answers that cannot score.
    """
    prompts: list[Prompt] = []
    for lineno, where, row in read_jsonl(path):
        if answer_key not in row:
            raise DatasetError(
                f"{where}: no {answer_key!r} key (the line has keys {sorted(row)}); set data.answer_key to the key "
                "that holds the answer"
            )
        answer = prepare_answer(
            row[answer_key], where, key=answer_key, answer_after_marker=answer_after_marker, reward_cfg=reward_cfg
        )
        text = _prompt_text(row, where, tokenizer, system_prompt, prompt_key, messages_key)
        add_special = not getattr(tokenizer, "chat_template", None)
        ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
        if max_prompt_tokens:
            ids = ids[-max_prompt_tokens:]
        variants = answer_patterns(tokenizer, answer)
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
                    **{k: v for k, v in row.items() if k not in (prompt_key, messages_key, answer_key)},
                },
            )
        )
    if not prompts:
        raise DatasetError(f"dataset file {Path(path)} has no usable rows")
    return prompts
