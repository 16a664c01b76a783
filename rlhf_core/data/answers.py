"""Answer texts of a dataset row, checked against the reward that will score them, and their token patterns.

Every prompt builder (JSONL datasets, synthetic and chat tasks) and `rlhf_core.scoring.score_responses` turn
an answer text into `Prompt.answers` through `answer_patterns`, so a response is scored by hand exactly as it
is in training. `prepare_answer` refuses, at load time and with `file:line`, answers that no response could
ever match: a whole worked solution ('... #### 72') where the final answer belongs. Numbers ('$50', '5,000',
'50.00') are read by the one grammar of `rlhf_core.reward.answer_forms.canonical_number`; any other text is a
text answer, which every answer-checking component matches as text (docs/rewards.md).
"""

from __future__ import annotations

from rlhf_core.data.errors import DatasetError
from rlhf_core.data.tasks import SYNTHETIC_TASKS
from rlhf_core.reward.answer_forms import answer_variants

DEFAULT_MARKER = "####"


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else "..." + text[-(limit - 3) :])


def prepare_answer(
    raw,
    where: str,
    *,
    key: str = "answer",
    answer_after_marker: bool = False,
    reward_cfg=None,
) -> str:
    """The answer text a row's raw answer value is scored against, or DatasetError naming `where`.

    raw: the value under `key` (a non-empty string or number); where: 'file:line' (or another location);
    answer_after_marker: take the text after the LAST reward marker (raw GSM8K answers '... #### 72');
    reward_cfg: the RewardConfig that will score it (None: the defaults, marker '####').
    Refused: an answer that still contains the marker (a whole solution: no response could match it). A text
    answer ('Paris', '72 clips') is kept: answer_after_marker matches it as text after the marker.
    """
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)) or str(raw).strip() == "":
        raise DatasetError(f"{where}: {key!r} must be a non-empty string or number (got {raw!r:.60})")
    text = str(raw).strip()
    marker = reward_cfg.marker if reward_cfg is not None else DEFAULT_MARKER
    if marker.strip() and marker in text:
        if not answer_after_marker:
            raise DatasetError(
                f"{where}: the answer {_short(text)} contains the reward marker {marker!r}: it looks like a whole "
                "solution, which no response would reproduce. Set data.answer_after_marker=true to score the "
                f"text after the last {marker!r} (raw GSM8K), or write only the final answer (e.g. '72')"
            )
        text = text.rsplit(marker, 1)[1].strip()
        if not text:
            raise DatasetError(f"{where}: nothing follows the last {marker!r} in the answer {_short(str(raw))}")
    return text


def answer_patterns(tokenizer, text: str, task: str = "jsonl") -> list[list[int]]:
    """`Prompt.answers` of an answer text, as the prompt builder of data.task makes them.

    The word-level synthetic tasks ('max3', 'sum2') match the answer's one tokenization; every other task
    (JSONL datasets, chat tasks) matches all `rlhf_core.reward.answer_forms.answer_variants` (as is, stripped, with a
    leading space, number spellings). Returns a list of token-id lists; [] when the text tokenizes to nothing.
    """
    if task in SYNTHETIC_TASKS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return [ids] if ids else []
    return answer_variants(tokenizer, text)
