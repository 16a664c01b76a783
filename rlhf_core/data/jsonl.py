"""JSONL prompt datasets: one UTF-8 JSON object per line with `prompt` (or chat `messages`) and `answer`.

The key names are configurable (data.prompt_key, data.answer_key), and with
data.answer_after_marker a whole worked solution ('... #### 72') is reduced to the text after its last
reward marker, so raw GSM8K lines ({"question", "answer"}) load as they are. The tokenizer's chat template
is applied when the model has one; answers become token-pattern variants (`rlhf_core.data.answer_patterns`)
so that matching in token space survives tokenizer quirks. Every refusal names `file:line` and what to do,
including answers the configured reward could never score (`rlhf_core.data.answers.prepare_answer`). The
row -> Prompt logic is shared with `data.task: dataset` (`rlhf_core.data.rows`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from rlhf_core.data.errors import DatasetError
from rlhf_core.data.prompts import Prompt
from rlhf_core.data.rows import RowKeys, prompts_from_rows

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
    when present) and its answer, dotted for nested keys; answer_after_marker and reward_cfg (the
    RewardConfig that will score the run; None = its defaults) are handed to `prepare_answer`, which
    refuses answers that cannot score. Rows become Prompts through `rlhf_core.data.rows.row_to_prompt`
    (meta: the line number and every key but the prompt's).
    """
    keys = RowKeys(prompt_key, messages_key, answer_key, answer_after_marker, reward_cfg)
    rows = ((where, row, {"line": lineno}) for lineno, where, row in read_jsonl(path))
    return prompts_from_rows(rows, f"file {Path(path)}", tokenizer, keys, system_prompt, max_prompt_tokens)
