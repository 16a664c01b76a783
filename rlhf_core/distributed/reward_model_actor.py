"""The reward-model actor: the learned reward model (`rlhf_core.reward.model.RewardModelScorer`) in its own
process, and the rollout worker's side of it (`RemoteRewardModel`)."""

from __future__ import annotations

import torch

from rlhf_core.distributed.calls import get_or_fail
from rlhf_core.run import build


class RewardModelActor:
    """The reward model (`rlhf_core.reward.model.RewardModelScorer`) in its own process, with its own
    resources (cluster.resources.reward); rollout workers find it by name and send it their rows.
    Calls run one at a time (the actor's default concurrency): one model, one set of running moments."""

    def __init__(self, cfg, policy_dir: str):
        from rlhf_core.reward.model import RewardModelScorer

        build.setup_process(cfg, cfg.trainer.seed)
        tokenizer = build.build_tokenizer(cfg, policy_dir)
        self.scorer = RewardModelScorer(
            cfg.reward.model,
            tokenizer,
            build.build_stop_ids(cfg, tokenizer, policy_dir),
            trust_remote_code=cfg.model.trust_remote_code,
        )

    def shares_tokenizer(self) -> bool:
        return self.scorer.shares_tokenizer

    def score(self, inputs: dict):
        """Scores (a numpy float32 [N]) of rows sent as numpy arrays (`RemoteRewardModel.score`)."""
        # arrays from Ray's object store are read-only: copy them (a few KB) rather than alias them
        tensors = {k: torch.from_numpy(v.copy()) if k != "messages" else v for k, v in inputs.items()}
        return self.scorer.score(**tensors).numpy()

    def stats(self) -> dict:
        return self.scorer.stats()


class RemoteRewardModel:
    """An external reward of a rollout worker (RolloutWorker's contract) scored by the RewardModelActor."""

    def __init__(self, actor, cfg, policy_tokenizer):
        from rlhf_core.reward.model import REWARD_MODEL_NAME

        self.actor, self.name = actor, REWARD_MODEL_NAME
        self.weights = {REWARD_MODEL_NAME: cfg.reward.model.weight}
        self.policy_tokenizer = policy_tokenizer
        self.timeout = cfg.runtime.wait_timeout_s
        self.shares_tokenizer = get_or_fail(actor.shares_tokenizer.remote(), self.timeout, "the reward model actor")

    def score(self, prompts, batch) -> dict[str, torch.Tensor]:
        from rlhf_core.reward.model import reward_model_inputs

        inputs = reward_model_inputs(prompts, batch, self.policy_tokenizer, not self.shares_tokenizer)
        payload = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        scores = get_or_fail(self.actor.score.remote(payload), self.timeout, "the reward model to score a batch")
        return {self.name: torch.from_numpy(scores.copy())}
