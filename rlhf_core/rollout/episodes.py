"""Episode runners: what a rollout worker runs for a batch of prompts, behind one interface (AReaL's
`arun_episode` is the model).

    SingleTurn        one completion per sample: the engine's generate()
    EnvEpisodes       multi-turn trajectories of an environment (rlhf_core.rollout.multiturn.EnvRunner)
    AgentRunner       an agent's episodes on the OpenAI-compatible endpoint (rlhf_core.agent.runner)

`collect(context, prompts, between_steps)` runs the prompts' episodes and returns them `Collected`: one batch, its
rewards and its reward components, scored with the context's `score` where the runner's rows are model turns.
The worker finishes every collection the same way (rewards and component columns on the batch, its counters) and
splits it into groups with the runner's `split`. A runner knows nothing of the worker: the `EpisodeContext` carries
what it uses (the engine, the sampling, the group size, the padding, the scoring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol

import torch

from rlhf_core.data.prompts import Prompt, collate_prompts
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.rollout.episode_stream import run_episodes
from rlhf_core.rollout.generate import generate
from rlhf_core.types import Experience, RolloutBatch

# a failed training episode is started again in its group's slot up to this many times (a crash, hang or bad result
# costs the episode, not its group of G); the group fails when one slot fails every try
EPISODE_RETRIES = 3


class Collected(NamedTuple):
    batch: RolloutBatch
    rewards: torch.Tensor  # [N], one per row
    components: dict  # name -> [N]: the reward's components and the runner's own columns


@dataclass
class EpisodeContext:
    """What a runner uses of its rollout worker. `score(rows, patterns, repeats, batch)`: the tensor-native reward
    plus the external rewards of `batch`, whose rows are completions of `rows` (prompts, row-aligned; patterns: the
    prompts' answer patterns, each repeated `repeats` times) -> (rewards [N], components)."""

    engine: object
    sampling: SamplingParams
    samples_per_prompt: int
    pad_token_id: int
    max_prompt_tokens: Optional[int]
    component_names: Optional[list[str]]
    score: Callable


class EpisodeRunner(Protocol):
    def collect(self, context: EpisodeContext, prompts: Sequence[Prompt], between_steps=None) -> Collected: ...

    def split(self, batch: RolloutBatch, samples_per_prompt: int) -> list[Experience]: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def split_groups(batch: RolloutBatch, group_size: int) -> list[Experience]:
    """Split a batch whose completions of each prompt are contiguous into per-prompt Experiences (views)."""
    n = len(batch) // group_size
    index = torch.arange(len(batch)).view(n, group_size)
    # a group is as old as its oldest token (partial rollouts: rows may span several versions)
    versions = batch.policy_version.view(n, group_size).amin(1).tolist()
    uids = batch.prompt_uids.view(n, group_size)[:, 0].tolist() if batch.prompt_uids is not None else list(range(n))
    groups = []
    for g in range(n):
        sub = batch.select(index[g])
        sub.group_ids = torch.zeros(group_size, dtype=torch.long)
        groups.append(Experience(batch=sub, prompt_id=int(uids[g]), policy_version=int(versions[g])))
    return groups


class SingleTurn:
    """One completion per sample, G per prompt, scored on the engine's device."""

    def collect(self, context: EpisodeContext, prompts: Sequence[Prompt], between_steps=None) -> Collected:
        G = context.samples_per_prompt
        pb = collate_prompts(prompts, context.pad_token_id, context.max_prompt_tokens)
        batch = generate(context.engine, pb, G, context.sampling, between_steps)
        rows = [p for p in prompts for _ in range(G)]  # row-aligned with the batch
        rewards, components = context.score(rows, pb.patterns, G, batch)
        return Collected(batch, rewards, components)

    def split(self, batch: RolloutBatch, samples_per_prompt: int) -> list[Experience]:
        return split_groups(batch, samples_per_prompt)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class EnvEpisodes(SingleTurn):
    """Multi-turn: trajectories of an environment, scored as the environment's summed rewards x env.reward_weight
    plus the configured rewards of the last model turn. A group with a failed trajectory (an environment error or
    timeout) is left out; the batch may then have fewer groups, or none (an empty batch). With between_steps
    (partial rollouts) trajectories adopt newer weights between turns and within them; each token keeps its version
    (`trajectory_batch`). `metrics`: the last batch's env/* means and the run's env/errors (by kind) and
    env/process_restarts; `last_trajectories`: the last batch's."""

    def __init__(self, env):
        self.env = env
        self.metrics: dict[str, float] = {}
        self.last_trajectories: list = []

    def collect(self, context: EpisodeContext, prompts: Sequence[Prompt], between_steps=None) -> Collected:
        G = context.samples_per_prompt
        trajs = run_episodes(self.env, context.engine, prompts, G, context.sampling, between_steps, EPISODE_RETRIES)
        return self.collected(context, prompts, trajs)

    def collected(self, context: EpisodeContext, prompts: Sequence[Prompt], trajs: list) -> Collected:
        """The batch of `prompts`' trajectories (contiguous per prompt): failed groups left out, scored."""
        from rlhf_core.rollout.multiturn_batch import last_turn_batch, trajectory_batch, trajectory_metrics

        G, pad = context.samples_per_prompt, context.pad_token_id
        keep = [g for g in range(len(prompts)) if not any(t.error for t in trajs[g * G : (g + 1) * G])]
        kept = [t for g in keep for t in trajs[g * G : (g + 1) * G]]
        self.last_trajectories = kept
        self.metrics = {**trajectory_metrics(kept), **self.env.metrics()}
        version = int(context.engine.version)
        device = getattr(context.engine, "device", "cpu")
        if not kept:  # every group failed: an empty batch, on the engine's device as any other
            batch = trajectory_batch(trajs[:1], pad, version, device)
            batch = batch.select(torch.arange(0, device=batch.response_ids.device))
            return Collected(batch, torch.zeros(0, device=batch.response_ids.device), {})
        batch = trajectory_batch(kept, pad, version, device)
        last = last_turn_batch(kept, pad, version, device)
        pb = collate_prompts([prompts[g] for g in keep], pad, context.max_prompt_tokens)
        rewards, components = context.score([t.prompt for t in kept], pb.patterns, G, last)
        env_reward = torch.tensor([t.env_reward for t in kept], dtype=torch.float32, device=rewards.device)
        rewards = rewards + self.env.cfg.reward_weight * env_reward
        for t, r in zip(kept, rewards.tolist()):
            t.reward = r
        per_row = {
            "env/turns_mean": [t.turns for t in kept],
            "env/tool_calls_mean": [t.tool_calls for t in kept],
            "env/truncated_frac": [float(t.truncated) for t in kept],
        }
        components = {**components, "env": env_reward}
        components.update({k: torch.tensor(v, dtype=torch.float32, device=rewards.device) for k, v in per_row.items()})
        batch.group_ids = torch.arange(len(keep), device=batch.group_ids.device).repeat_interleave(G)
        return Collected(batch, rewards, components)

    def stats(self) -> dict:
        # env/errors, env/errors/<kind>, env/process_restarts: the run's so far
        return {"env_errors": self.env.errors, **self.env.metrics()}

    def close(self) -> None:
        self.env.close()
