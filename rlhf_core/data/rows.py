"""One dataset row -> one `Prompt`: key mapping, chat-template rendering and answer checks.

Every file-backed prompt source (JSONL lines, `datasets` rows from parquet / JSON / a saved directory / the
hub) goes through `row_to_prompt`, so a row means the same thing whatever file it came from:

- the prompt is `prompt_key` (data.prompt_key), which may hold a string (one user turn) or a chat message list
  (verl's schema: `prompt: [{role, content}, ...]`); with the default ('prompt'), a row that has `messages` (TRL's
  conversational schema) uses them;
- the answer is `answer_key`; keys may be dotted to reach into nested objects (`reward_model.ground_truth`),
  and with the default `answer_key` ('answer') a row without it falls back to verl's
  `reward_model.ground_truth`, so verl parquet files load with no key settings;
- every column except the prompt lands in `Prompt.meta` under its own name (the reward functions see them);
- answers are checked against the reward that will score them (`rlhf_core.data.answers.prepare_answer`).

Errors name the row (`file:line` or `file, row i`), the key that was missing and the keys that were found.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from rlhf_core.data.answers import answer_patterns, prepare_answer
from rlhf_core.data.errors import DatasetError
from rlhf_core.data.prompts import Prompt

DEFAULT_ANSWER_KEY = "answer"
VERL_ANSWER_KEY = "reward_model.ground_truth"
"""Where verl's parquet schema keeps the ground truth; used when the default answer key is absent."""

_MISSING = object()


@dataclass(frozen=True)
class RowKeys:
    """Where a row keeps its prompt, its chat messages and its answer (dotted for nested keys), and how the
    answer is prepared (`prepare_answer`'s answer_after_marker and the RewardConfig that will score it).
    messages_key, when set and present in a row, is used before prompt_key: from a config it is 'messages' with
    the default prompt_key and unset ('') with another."""

    prompt_key: str = "prompt"
    messages_key: str = "messages"
    answer_key: str = DEFAULT_ANSWER_KEY
    answer_after_marker: bool = False
    reward_cfg: Any = None

    @classmethod
    def from_config(cls, data_cfg, reward_cfg=None) -> RowKeys:
        messages_key = "messages" if data_cfg.prompt_key == "prompt" else ""
        return cls(data_cfg.prompt_key, messages_key, data_cfg.answer_key, data_cfg.answer_after_marker, reward_cfg)


def get_field(row: dict, key: str, default=_MISSING):
    """row[key], where a dotted key ('reward_model.ground_truth') descends into nested dicts; a column whose
    own name contains the dot wins. Returns `default` when absent (a None value counts as absent)."""
    if key in row:
        return default if row[key] is None else row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return default
        node = node[part]
    return node


def _keys(node: dict) -> str:
    """'[keys with a value]' and, when some are None (a parquet struct's absent field), '(empty: [...])'."""
    empty = sorted(k for k, v in node.items() if v is None)
    return f"{sorted(k for k, v in node.items() if v is not None)}" + (f" (empty: {empty})" if empty else "")


def _found_keys(row: dict, key: str) -> str:
    """The keys a row has, and for a dotted key the keys of the deepest object reached ('reward_model' has
    keys [...]), for error messages."""
    text = f"the row has keys {_keys(row)}"
    parts, node = key.split("."), row
    for i, part in enumerate(parts[:-1]):
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            break
        text += f"; {'.'.join(parts[: i + 1])!r} has keys {_keys(node)}"
    return text


def _answer(row: dict, where: str, keys: RowKeys) -> tuple[str, Any]:
    """(the key the answer was found under, its raw value), or DatasetError listing the keys found."""
    value = get_field(row, keys.answer_key)
    if value is not _MISSING:
        return keys.answer_key, value
    if keys.answer_key == DEFAULT_ANSWER_KEY:
        value = get_field(row, VERL_ANSWER_KEY)
        if value is not _MISSING:
            return VERL_ANSWER_KEY, value
        also, found = f" (nor verl's {VERL_ANSWER_KEY!r})", _found_keys(row, VERL_ANSWER_KEY)
    else:
        also, found = "", _found_keys(row, keys.answer_key)
    raise DatasetError(
        f"{where}: no {keys.answer_key!r} key{also}: {found}; set data.answer_key to "
        "the key that holds the answer (dotted for a nested one, e.g. reward_model.ground_truth)"
    )


def _messages(value, where: str, key: str) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} objects")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            found = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise DatasetError(
                f"{where}: {key!r} message {i} must be an object with string 'role' and 'content' (got {found})"
            )
        # parquet stores a list of structs with every field of every message: drop the absent (None) ones
        messages.append({k: v for k, v in m.items() if v is not None})
    return messages


def prompt_messages(row: dict, where: str, keys: RowKeys) -> tuple[str, list[dict], bool]:
    """(the key the prompt came from, its chat messages, whether the row was conversational).

    A plain-text prompt becomes one user message (not conversational)."""
    value = get_field(row, keys.messages_key) if keys.messages_key else _MISSING
    if value is not _MISSING:
        return keys.messages_key, _messages(value, where, keys.messages_key), True
    value = get_field(row, keys.prompt_key)
    if value is _MISSING:
        raise DatasetError(
            f"{where}: no prompt: needs a {keys.prompt_key!r} string or chat list"
            + (f", or a {keys.messages_key!r} list" if keys.messages_key else "")
            + f"; {_found_keys(row, keys.prompt_key)}; set data.prompt_key to the key that holds it"
        )
    if isinstance(value, (list, tuple)):
        return keys.prompt_key, _messages(value, where, keys.prompt_key), True
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: {keys.prompt_key!r} must be a non-empty string or a list of chat messages")
    return keys.prompt_key, [{"role": "user", "content": value}], False


def render_prompt(messages: list[dict], tokenizer, system_prompt: str = "") -> tuple[str, list[dict]]:
    """(prompt text, the messages rendered): the tokenizer's chat template with the generation prompt, or
    the contents joined by blank lines for a model without one. `system_prompt` is put first unless the
    messages already hold a system turn."""
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), messages
    # No chat template: plain concatenation of the contents, the way base models are prompted.
    return "\n\n".join(m["content"] for m in messages), messages


def row_to_prompt(
    row: dict,
    where: str,
    uid: int,
    tokenizer,
    keys: RowKeys,
    system_prompt: str = "",
    max_prompt_tokens: Optional[int] = None,
    extra_meta: Optional[dict] = None,
) -> Prompt:
    """One row as a tokenized `Prompt`; DatasetError naming `where` for anything unusable.

    meta: `extra_meta` (e.g. the JSONL line number), then every column but the prompt's, by column name.
    """
    answer_key, raw = _answer(row, where, keys)
    answer = prepare_answer(
        raw, where, key=answer_key, answer_after_marker=keys.answer_after_marker, reward_cfg=keys.reward_cfg
    )
    prompt_key, messages, conversational = prompt_messages(row, where, keys)
    text, rendered = render_prompt(messages, tokenizer, system_prompt)
    ids = tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
    if max_prompt_tokens:
        ids = ids[-max_prompt_tokens:]
    variants = answer_patterns(tokenizer, answer)
    if not variants:
        raise DatasetError(f"{where}: answer {answer!r} tokenizes to nothing")
    top = prompt_key.split(".")[0] if prompt_key not in row else prompt_key
    return Prompt(
        uid=uid,
        prompt_ids=ids,
        answers=variants,
        text=text,
        answer_text=answer,
        meta={**(extra_meta or {}), **{k: v for k, v in row.items() if k != top}},
        messages=rendered if conversational else None,
        prompt_text="" if conversational else messages[0]["content"],
    )


def prompts_from_rows(
    rows: Iterable[tuple[str, dict, dict]],
    source: str,
    tokenizer,
    keys: RowKeys,
    system_prompt: str = "",
    max_prompt_tokens: Optional[int] = None,
) -> list[Prompt]:
    """`row_to_prompt` over (where, row, extra_meta) triples; DatasetError when `source` yields no row."""
    prompts = [
        row_to_prompt(row, where, i, tokenizer, keys, system_prompt, max_prompt_tokens, extra)
        for i, (where, row, extra) in enumerate(rows)
    ]
    if not prompts:
        raise DatasetError(f"dataset {source} has no usable rows")
    return prompts
