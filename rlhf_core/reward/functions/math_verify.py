"""The built-in `math_verify` reward function: LaTeX / boxed / plain math answers, checked by the
`math-verify` package (an optional extra: pip install -e ".[math]").

Configured by name alone: `reward.functions: [{name: math_verify, weight: 1.0}]`. TRL signature: each
completion is parsed (its last \\boxed{...}, LaTeX or plain expression) and compared with the row's answer
text (`answer`; `ground_truth` or verl's `reward_model.ground_truth` when the dataset has them) by
symbolic and numeric equality: 1.0 equal, 0.0 not, None for a row whose answer cannot be parsed (the row is
then left out of reward/math_verify and adds 0 to the total). It runs in the reward-function pool, whose
per-call timeout replaces math-verify's own (both use SIGALRM).
"""

from __future__ import annotations

INSTALL_HINT = 'the built-in reward function math_verify needs the math-verify package: pip install -e ".[math]"'


def _gold_text(i: int, answer, columns: dict) -> str:
    for key in ("ground_truth", "answer"):
        values = columns.get(key) if key != "answer" else answer
        if values is not None and values[i] not in (None, ""):
            return str(values[i])
    reward_model = columns.get("reward_model")
    if reward_model is not None and isinstance(reward_model[i], dict):
        return str(reward_model[i].get("ground_truth", ""))
    return ""


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def math_verify(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float | None]:
    """1.0 where the completion's final answer equals the row's answer mathematically, else 0.0; None where the
    answer itself cannot be parsed."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc

    out: list[float | None] = []
    for i, completion in enumerate(completions):
        gold_text = _gold_text(i, answer, columns)
        if not gold_text.strip():
            out.append(None)
            continue
        if "$" not in gold_text and "\\boxed" not in gold_text:
            gold_text = f"${gold_text}$"  # bare answers ('72', '1/2', '\\sqrt{8}') parse as LaTeX math
        gold = parse(gold_text, parsing_timeout=None)
        if not gold:
            out.append(None)
            continue
        pred = parse(
            _text(completion),
            extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
            parsing_timeout=None,
        )
        out.append(1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0)
    return out
