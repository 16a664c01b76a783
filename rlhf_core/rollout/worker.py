"""RolloutWorker: prompts in, scored experience groups out, stamped with the policy version."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

import torch

from rlhf_core.data.prompts import Prompt
from rlhf_core.reward.batch import BatchReward
from rlhf_core.rollout import probe as sync_probe
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.rollout.episode_stream import stream
from rlhf_core.rollout.episodes import EPISODE_RETRIES, EnvEpisodes, EpisodeContext, SingleTurn, split_groups
from rlhf_core.rollout.probe import SyncCheck
from rlhf_core.types import Experience, RolloutBatch


class RolloutWorker:
    """Generates with an engine, scores with a tensor-native reward on the engine's device (plus any external
    rewards: Python reward functions in a process pool), splits by prompt.

    External rewards (a reward model, Python functions) each have `weights: dict[str, float]` and
    `score(prompts, batch) -> dict[str, FloatTensor[N]]` (prompts repeated per completion, row-aligned with
    the batch); Σ weight × score is added to the rewards and each name becomes an extra reward component,
    after the tensor-native ones. Keeps busy and idle seconds, samples and tokens generated (`stats()`).
    """

    def __init__(
        self,
        engine,
        reward_fn,
        sampling: SamplingParams,
        samples_per_prompt: int,
        pad_token_id: int,
        max_prompt_tokens: int | None = None,
        component_names: Sequence[str] | None = None,
        external: Sequence = (),
        env=None,
        agent=None,
        sync_check: Optional[SyncCheck] = None,
        name: str = "rollout worker",
    ):
        self.engine = engine
        # every sync checked against the trainer's probe log-probs (rlhf_core.rollout.probe); off: SyncCheck("off")
        self.sync_check = sync_check if sync_check is not None else SyncCheck("off")
        self.name = name
        self._unchecked_probe = None  # (probe, version) of a sync adopted between decode steps, checked after
        self.sampling = sampling
        self.samples_per_prompt = samples_per_prompt
        self.pad_token_id = pad_token_id
        self.max_prompt_tokens = max_prompt_tokens
        # column order of batch.reward_components (reward.components' order); None: the reward's own order
        self.component_names = list(component_names) if component_names is not None else None
        # external rewards (Python functions, a reward model): each has `weights` {name: weight} and
        # score(prompts, batch) -> {name: FloatTensor [N]}; NaN marks a row a score does not apply to
        self.score = BatchReward(reward_fn, external)  # what the episode runners score a batch with
        # what runs for a batch of prompts (rlhf_core.rollout.episodes): single-turn completions, a multi-turn
        # environment's trajectories (rlhf_core.rollout.multiturn.EnvRunner), or an agent's episodes on the
        # OpenAI-compatible endpoint (rlhf_core.agent.runner.AgentRunner)
        self.episodes = EnvEpisodes(env) if env is not None else agent if agent is not None else SingleTurn()
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.samples = 0
        self.tokens = 0
        self.batches = 0
        self.reward_sum = 0.0

    @property
    def reward_fn(self):
        """The tensor-native reward (the batch reward's; setting it replaces it there)."""
        return self.score.reward_fn

    @reward_fn.setter
    def reward_fn(self, reward_fn) -> None:
        self.score.reward_fn = reward_fn

    @property
    def external(self) -> list:
        return self.score.external

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def env(self):
        """The multi-turn environment's runner, None without one."""
        return self.episodes.env if isinstance(self.episodes, EnvEpisodes) else None

    @property
    def agent(self):
        """The agent's runner, None without one."""
        return None if isinstance(self.episodes, SingleTurn) else self.episodes

    @property
    def env_metrics(self) -> dict[str, float]:
        """The last environment batch's env/* means and the run's env/errors and env/process_restarts."""
        return self.episodes.metrics if isinstance(self.episodes, EnvEpisodes) else {}

    @property
    def last_trajectories(self) -> list:
        return self.episodes.last_trajectories if isinstance(self.episodes, EnvEpisodes) else []

    def context(self) -> EpisodeContext:
        """What the episode runner uses of this worker."""
        return EpisodeContext(
            self.engine,
            self.sampling,
            self.samples_per_prompt,
            self.pad_token_id,
            self.max_prompt_tokens,
            self.component_names,
            self.score,
        )

    def load_weights(self, state_dict, version: int) -> float:
        """Load weights between generation batches, then check them with the sync probe they carry; returns the
        seconds the load took."""
        weights, probe = sync_probe.split(state_dict)
        self.sync_check.before_load(self.engine, probe, version)
        start = time.perf_counter()
        self.engine.load_weights(weights, version)
        took = time.perf_counter() - start
        self.sync_check.check(self.engine, probe, version, self.name)
        return took

    def _probing(self, between_steps):
        """between_steps with the probe taken off what it hands the engine: it is checked after the batch (an
        engine in the middle of its requests cannot be asked for anything else)."""

        def hook():
            update = between_steps()
            if update is None:
                return None
            weights, probe = sync_probe.split(update[0])
            self._unchecked_probe = (probe, update[1]) if probe is not None else self._unchecked_probe
            return weights, update[1]

        return hook

    def rollout(self, prompts: Sequence[Prompt], between_steps=None) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
        """Generate `samples_per_prompt` completions per prompt and score them; returns (batch, reward components).

        between_steps (partial rollouts): returns None or (state_dict, version) to adopt mid-generation; called
        between decode steps where the engine supports it (HF, vLLM: `HFEngine.generate`) and, with an
        environment, also between a trajectory's turns (`EnvRunner.run`).

        The batch carries its rewards (the tensor-native reward plus each external reward's weighted scores)
        and, as `reward_components` [N, C], the per-row values of the components and external columns (NaN
        where an external score does not apply to the row)."""
        if between_steps is None:
            return self._rollout(prompts, None)
        try:
            return self._rollout(prompts, self._probing(between_steps))
        finally:
            self._check_adopted()

    def _rollout(self, prompts: Sequence[Prompt], between_steps):
        start = time.perf_counter()
        batch, rewards, components = self.episodes.collect(self.context(), prompts, between_steps)
        return self._finish(batch, rewards, components, start)

    def _finish(self, batch: RolloutBatch, rewards: torch.Tensor, components: dict, start: float):
        batch.rewards = rewards
        names = self.component_names if self.component_names is not None else list(components)
        if names and all(n in components for n in names):  # per row: they travel with the groups
            batch.reward_components = torch.stack([components[n].float() for n in names], dim=-1)
        self.busy_s += time.perf_counter() - start
        self.samples += len(batch)
        self.tokens += batch.num_tokens
        self.batches += 1
        self.reward_sum += float(rewards.sum())
        return batch, components

    def stream_env_groups(self, feed, emit, between_steps=None) -> None:
        """Multi-turn without a batch barrier (`EnvRunner.stream`): `feed(groups_in_flight)` gives prompts (a list,
        possibly empty; None: no more), and each prompt's group is scored and handed to `emit(prompt, groups)` (one
        Experience on CPU, or none when the group failed) as soon as its trajectories ended. Busy time: while
        any group is in flight; idle: while none is (the feed had nothing to give)."""
        mark = [time.perf_counter(), False]  # since when, and whether groups were in flight since then

        def account(in_flight: int) -> None:
            now = time.perf_counter()
            if mark[1]:
                self.busy_s += now - mark[0]
            else:
                self.idle_s += now - mark[0]
            mark[0], mark[1] = now, in_flight > 0

        def give(in_flight: int):
            account(in_flight)
            self._check_adopted()  # the engine is between requests here
            prompts = feed(in_flight)
            mark[1] = mark[1] or bool(prompts)
            return prompts

        def done(group) -> None:
            t0 = time.perf_counter()
            batch, _ = self._finish(*self.episodes.collected(self.context(), [group[0].prompt], group), t0)
            self.busy_s -= time.perf_counter() - t0  # on the stream's clock already (`account`)
            emit(group[0].prompt, split_groups(batch.to("cpu"), self.samples_per_prompt) if len(batch) else [])

        hook = self._probing(between_steps) if between_steps is not None else None
        try:
            stream(self.env, self.engine, self.samples_per_prompt, self.sampling, give, done, hook, EPISODE_RETRIES)
        finally:
            account(0)
            self._check_adopted()

    def _check_adopted(self) -> None:
        """The sync check of weights adopted between decode steps or turns, once the engine is between requests."""
        pending, self._unchecked_probe = self._unchecked_probe, None
        if pending is not None and int(self.engine.version) == int(pending[1]):
            self.sync_check.check(self.engine, pending[0], pending[1], self.name)

    def generate_groups(self, prompts: Sequence[Prompt], between_steps=None) -> list[Experience]:
        """`rollout`, then one Experience per prompt (its G completions), on CPU for transport."""
        batch, _ = self.rollout(prompts, between_steps=between_steps)
        return self.episodes.split(batch.to("cpu"), self.samples_per_prompt)

    def close(self) -> None:
        """Stop what the external rewards hold (the reward-function processes)."""
        for source in self.external:
            if hasattr(source, "close"):
                source.close()
        self.episodes.close()

    def add_idle(self, seconds: float) -> None:
        self.idle_s += seconds

    def stats(self) -> dict:
        total = self.busy_s + self.idle_s
        return {
            "busy_s": self.busy_s,
            "idle_s": self.idle_s,
            "busy_frac": self.busy_s / total if total else 0.0,
            "samples": self.samples,
            "tokens": self.tokens,
            "batches": self.batches,
            "version": self.version,
            "reward_mean": self.reward_sum / self.samples if self.samples else 0.0,
            "seed": sampling_seed(self.engine),
            **self.episodes.stats(),  # an environment's errors and restarts, an agent's failed episodes: so far
            **self.sync_check.stats(),
        }


def sampling_seed(engine) -> Optional[int]:
    """The engine's sampling seed (its torch.Generator's initial seed), None for an engine without a generator."""
    generator = getattr(engine, "generator", None)
    return int(generator.initial_seed()) if isinstance(generator, torch.Generator) else None
