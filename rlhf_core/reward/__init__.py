"""Rewards: tensor-native components in token space, user Python functions, a learned reward model.

The modules:
  tensor_native   the matching primitives (pack_patterns, tensor_native_reward, window_matches, ...)
  components      the named reward components and their configured weighted sum (build_reward_fn,
                  ComposedReward, REWARD_COMPONENTS, prepare_patterns)
  answer_forms    an answer's spellings and their token ids, no torch (canonical_number, number_forms,
                  answer_variants)
  answers         those packed into tensors (patterns_from_texts), vocabulary-derived token sets
  text            the text matcher behind reward.match: text
  functions/      user Python reward functions (reward.functions): the process pool, math_verify
                  (no torch), and `external.PythonFunctionRewards`, the rollout worker's external reward
  model           the learned reward model (reward.model)
Scoring responses by hand with a run's whole reward is `rlhf_core.scoring` (it builds a run's parts).

This package imports nothing when it is imported, so that the reward-function pool's processes, which import
`rlhf_core.reward.functions`, stay free of torch. The public names below (docs/api.md) are re-exports that
load their module on first use: `from rlhf_core.reward import tensor_native_reward` imports
`rlhf_core.reward.tensor_native` (and torch) then, and `score_responses` / `Scorer` come from
`rlhf_core.scoring`, which sits above this package (it builds a run); loading it only on use keeps the
import layers one-way at import time.
"""

from __future__ import annotations

from rlhf_core.lazy import lazy_exports

# public name -> the module that defines it (loaded on first access, then cached in this module)
_LAZY = {
    "pack_patterns": "rlhf_core.reward.tensor_native",
    "tensor_native_reward": "rlhf_core.reward.tensor_native",
    "valid_lengths": "rlhf_core.reward.tensor_native",
    "window_matches": "rlhf_core.reward.tensor_native",
    "REWARD_COMPONENTS": "rlhf_core.reward.components",
    "ComposedReward": "rlhf_core.reward.components",
    "answer_after_marker_reward": "rlhf_core.reward.components",
    "build_reward_fn": "rlhf_core.reward.components",
    "exact_match_reward": "rlhf_core.reward.components",
    "format_reward": "rlhf_core.reward.components",
    "length_penalty": "rlhf_core.reward.components",
    "pack_shared": "rlhf_core.reward.components",
    "prepare_patterns": "rlhf_core.reward.components",
    "answer_variants": "rlhf_core.reward.answer_forms",
    "number_forms": "rlhf_core.reward.answer_forms",
    "canonical_number": "rlhf_core.reward.answer_forms",
    "text_variants": "rlhf_core.reward.answer_forms",
    "continuation_token_ids": "rlhf_core.reward.answers",
    "patterns_from_texts": "rlhf_core.reward.answers",
    "whitespace_token_ids": "rlhf_core.reward.answers",
    "Scorer": "rlhf_core.scoring",
    "score_responses": "rlhf_core.scoring",
}

__all__, __getattr__, __dir__ = lazy_exports(globals(), _LAZY)
