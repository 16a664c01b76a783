"""Turning environment messages into token ids through the model's own chat template (no torch).

A trajectory is kept as token ids. The model's turns are the ids the engine generated; everything else is
tokenized once, here:

- the opening messages (`reset`): the template's rendering with the generation prompt (and the tools);
- an observation: the text the template adds after the model's turn for the new message(s) and for the
  next assistant turn. It is the difference of two renderings of a fixed conversation: with and without
  the observation (the first a prefix of the second; checked), plus what the template writes after an
  assistant message's content that the model did not generate itself (ChatML: the newline after the
  `<|im_end|>` the model stopped on; the whole `<|im_end|>\\n` when it stopped another way).

The text is tokenized on its own and appended. The model's last token is always a special token (its stop)
or the end of a truncated turn, so the ids equal those of tokenizing the whole conversation at once where
the tokenizer does not merge across a special token (byte-level BPE, as Qwen's; tests check it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

_PLACEHOLDER = "\x00ATRLHF-ASSISTANT-TURN\x00"
_OPENING = [{"role": "user", "content": "\x00ATRLHF-USER\x00"}]


class ChatFormatError(ValueError):
    """The model's chat template cannot carry an environment's conversation (the message says why)."""


def has_tool_format(template: Optional[str]) -> bool:
    """Whether a chat template takes `tools` and renders calls in the Qwen2.5 / Hermes <tool_call> format."""
    return bool(template) and "tools" in template and "<tool_call>" in template


class ChatFormat:
    """The chat template of `tokenizer` (with `tools`, JSON schemas, when given) for trajectories."""

    def __init__(self, tokenizer, stop_ids: Sequence[int], tools: Optional[list[dict]] = None, where: str = "model"):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatFormatError(
                f"env: a multi-turn environment needs the model's chat template, and the tokenizer of {where} has "
                "none (its tokenizer_config.json has no chat_template)"
            )
        if tools and not has_tool_format(template):
            raise ChatFormatError(
                f"env.tools: the chat template of {where} has no tool format (it neither takes `tools` nor renders "
                "<tool_call> blocks, the Qwen2.5 / Hermes format ToolEnv parses); use a model whose template does"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.stop_ids = set(int(i) for i in stop_ids)
        base = _OPENING + [{"role": "assistant", "content": _PLACEHOLDER}]
        rendered = self.render(base, generation_prompt=False)
        at = rendered.rfind(_PLACEHOLDER)
        if at < 0:
            raise ChatFormatError(f"env: the chat template of {where} does not render an assistant message's content")
        self._base = base
        self._base_text = rendered
        self.turn_end = rendered[at + len(_PLACEHOLDER) :]  # what the template writes after an assistant message
        self._after_stop: dict[int, str] = {}
        for i in self.stop_ids:
            text = tokenizer.convert_ids_to_tokens(i)
            if isinstance(text, str) and self.turn_end.startswith(text):
                self._after_stop[i] = self.turn_end[len(text) :]

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The opening messages rendered with the generation prompt (and the tools), tokenized."""
        return self.encode(self.render(messages, generation_prompt=True))

    def observation_text(self, messages: list[dict], last_model_token: Optional[int]) -> str:
        """The text appended after the model's turn (which ended with `last_model_token`): the rest of the
        template's end of that turn, the new messages and the next assistant turn's opening."""
        full = self.render(self._base + list(messages), generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ChatFormatError(
                "env: the model's chat template renders a conversation differently once a message follows (the "
                "earlier turns are not a prefix), so an observation cannot be appended token-in/token-out"
            )
        close = self._after_stop.get(int(last_model_token), self.turn_end) if last_model_token is not None else ""
        return close + full[len(self._base_text) :]

    def observation_ids(self, messages: list[dict], last_model_token: Optional[int]) -> list[int]:
        return self.encode(self.observation_text(messages, last_model_token))

    def as_messages(self, observation, role: str) -> list[dict]:
        """An observation (a string: one message of `role`; or messages) as messages."""
        if isinstance(observation, str):
            return [{"role": role, "content": observation}]
        return list(observation)
