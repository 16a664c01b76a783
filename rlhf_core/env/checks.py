"""Every value an environment hands back is checked where it arrives (in its pool process), before it is sent
to the runner: a bad one fails that trajectory with `BadResult`, a named error, and never the rollout call.
No torch.

  reset   a string, or a non-empty list of messages
  step    (observation, reward, done, info): observation None, a string or a list of messages; reward a
          finite number (not a bool); done a bool (numpy's too, or 0 / 1); info None or a dict whose
          "tool_calls" (if any) is a count or a list and whose "success" (if any) is a bool, 0 / 1 or None
  finish  None or a finite number
  message a dict with a non-empty string "role" and a string "content"; the contents of one reset or
          observation hold at most env.max_observation_chars characters together
"""

from __future__ import annotations

import math
from numbers import Real

ERROR_KINDS = ("raised", "timeout", "bad_result", "process_died")
"""How an environment call fails (env/errors/<kind>): it raised; it overran env.step_timeout_s (or blocked
its process past it); it returned something malformed; its process died while running it."""


class BadResult(TypeError):
    """An environment returned something malformed (the message says what and where)."""


def _short(value) -> str:
    return repr(value)[:80]


def _flag(value, what: str) -> bool:
    """A bool, numpy's bool_, or the ints 0 / 1; BadResult otherwise (a string 'False' is true in Python)."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_" or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise BadResult(f"{what} is {_short(value)} ({type(value).__name__}), not a bool")


def check_messages(value, what: str, max_chars: int, allow_empty: bool = True):
    """A string, or a list of {'role': str, 'content': str, ...} messages (copied), within max_chars."""
    if isinstance(value, str):
        if len(value) > max_chars:
            raise BadResult(f"{what} has {len(value)} characters, more than env.max_observation_chars={max_chars}")
        return value
    if not isinstance(value, (list, tuple)):
        raise BadResult(f"{what} is {_short(value)} ({type(value).__name__}): expected a string or a list of messages")
    if not value and not allow_empty:
        raise BadResult(f"{what} is an empty list: expected a string or at least one message")
    out, size = [], 0
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise BadResult(
                f"{what}: message {i} is {_short(m)} ({type(m).__name__}), not a {{'role', 'content'}} dict"
            )
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise BadResult(f"{what}: message {i} has role {_short(role)}: expected a non-empty string")
        if not isinstance(content, str):
            raise BadResult(
                f"{what}: message {i} ({role}) has content {_short(content)} ({type(content).__name__}): expected a "
                "string"
            )
        size += len(content)
        out.append(dict(m))
    if size > max_chars:
        raise BadResult(f"{what} has {size} characters, more than env.max_observation_chars={max_chars}")
    return out


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not (isinstance(value, Real) or callable(getattr(value, "item", None))):
        raise BadResult(f"{what} is {_short(value)} ({type(value).__name__}), not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadResult(f"{what} is {_short(value)} ({type(value).__name__}), not a number") from None
    if not math.isfinite(number):
        raise BadResult(f"{what} is {number!r}, not a finite number")
    return number


def check_opening(value, max_chars: int):
    """reset's result: a string or a non-empty list of messages."""
    return check_messages(value, "reset's result", max_chars, allow_empty=False)


def check_step_result(result, max_chars: int = 100_000) -> tuple:
    """(observation, reward, done, info) with observation None/str/messages, reward a finite float, done a
    bool, info a dict; BadResult naming what is wrong otherwise."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise BadResult(
            f"step returned {type(result).__name__} {_short(result)}: expected a tuple (observation, reward, done, "
            "info)"
        )
    observation, reward, done, info = result
    if observation is not None:
        observation = check_messages(observation, "step's observation", max_chars)
    reward = _number(reward, "step's reward")
    done = _flag(done, "step's done")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise BadResult(f"step's info is {type(info).__name__}, not a dict")
    calls = info.get("tool_calls")
    if (
        calls is not None
        and not isinstance(calls, (list, tuple))
        and (isinstance(calls, bool) or not isinstance(calls, int))
    ):
        raise BadResult(f"step's info['tool_calls'] is {_short(calls)}: expected a count or a list of calls")
    if info.get("success") is not None:
        info = {**info, "success": _flag(info["success"], "step's info['success']")}
    return observation, reward, done, info


def check_finish_result(value):
    """finish's result: None or a finite number."""
    return None if value is None else _number(value, "finish's result")
