"""Tensor-native rewards in token space, and their composition.

Responses are scored where they were generated (same device, batched, no decode, no host round trip).
`tensor_native` holds the matching primitives, `components` the named reward components and the
configured weighted sum (`build_reward_fn`), `answers` the build-time tokenisation of answer texts.
User Python reward functions (`reward.functions`) are decoded and scored beside them, on the rollout side,
by `functions.PythonFunctionRewards` (imported where it is built, not here).
"""

from rlhf_core.reward.answers import (
    answer_variants,
    continuation_token_ids,
    number_forms,
    patterns_from_texts,
    text_variants,
    whitespace_token_ids,
)
from rlhf_core.reward.components import (
    REWARD_COMPONENTS,
    ComposedReward,
    answer_after_marker_reward,
    build_reward_fn,
    exact_match_reward,
    format_reward,
    length_penalty,
    pack_shared,
    prepare_patterns,
)
from rlhf_core.reward.scoring import Scorer, score_responses  # noqa: F401  (score by hand, as training does)
from rlhf_core.reward.tensor_native import pack_patterns, tensor_native_reward, valid_lengths, window_matches

__all__ = [
    "REWARD_COMPONENTS",
    "ComposedReward",
    "answer_after_marker_reward",
    "answer_variants",
    "build_reward_fn",
    "continuation_token_ids",
    "exact_match_reward",
    "format_reward",
    "length_penalty",
    "number_forms",
    "pack_patterns",
    "pack_shared",
    "patterns_from_texts",
    "prepare_patterns",
    "tensor_native_reward",
    "text_variants",
    "valid_lengths",
    "whitespace_token_ids",
    "window_matches",
]
