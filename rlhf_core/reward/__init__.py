"""Rewards: tensor-native components in token space, user Python functions, a learned reward model.

Import from the modules (this package imports nothing, so that the reward-function pool's processes, which
import `rlhf_core.reward.functions`, stay free of torch):
  tensor_native   the matching primitives (pack_patterns, tensor_native_reward, window_matches, ...)
  components      the named reward components and their configured weighted sum (build_reward_fn,
                  ComposedReward, REWARD_COMPONENTS, prepare_patterns)
  answer_forms    an answer's spellings and their token ids, no torch (number_forms, answer_variants)
  answers         those packed into tensors (patterns_from_texts), vocabulary-derived token sets
  text            the text matcher behind reward.match: text
  functions/      user Python reward functions (reward.functions): spec, the process pool, math_verify
                  (no torch), and `external.PythonFunctionRewards`, the rollout worker's external reward
  model           the learned reward model (reward.model)
Scoring responses by hand with a run's whole reward is `rlhf_core.scoring` (it builds a run's parts).
"""
