"""The rollout actor: the rollout role (`rlhf_core.run.roles.RolloutRole`) hosted in its own process.

Hosting only: the role's cycle is a long-running actor method; the actor is threaded (`max_concurrency`), so
control calls (stats, stop, RNG state) stay answerable while it runs. The prompt queue, the experience buffer
and the weight store are actors found by name, behind `peers.py`'s adapters (which pack what crosses).
"""

from __future__ import annotations

import logging
import time
import uuid
import warnings

import ray
import torch

from rlhf_core.distributed.calls import die
from rlhf_core.distributed.peers import RemoteBuffer, RemotePeer, RemoteWeights
from rlhf_core.distributed.reward_model_actor import RemoteRewardModel
from rlhf_core.run import build
from rlhf_core.run.roles import RolloutRole

log = logging.getLogger("rlhf_core.distributed")


class RolloutActor:
    """The rollout role in its own process; restarted by Ray if it dies."""

    def __init__(self, cfg, policy_dir: str, index: int, peers: dict[str, str]):
        # The buffer, prompt queue and weight store come by name, looked up here: a restartable actor whose
        # constructor takes actor handles cannot be restarted safely by Ray (and Ray says so at creation).
        seed = build.rollout_seed(cfg, index)
        build.setup_process(cfg, seed)
        self.cfg, self.index = cfg, index
        self.holder = f"{index}-{uuid.uuid4().hex[:8]}"  # this loop's lease name (a new one per run_loop)
        timeout = cfg.runtime.wait_timeout_s
        buffer, queue, store = (ray.get_actor(peers[k]) for k in ("buffer", "queue", "store"))
        model, tokenizer = build.build_policy(cfg, policy_dir)
        remote = None  # the reward model, when there is one, is scored by its own actor
        if "reward_model" in peers:
            remote = RemoteRewardModel(ray.get_actor(peers["reward_model"]), cfg, tokenizer)
        self.worker = build.build_rollout_worker(cfg, model, tokenizer, policy_dir, seed, reward_model=remote)
        self.role = RolloutRole(
            cfg,
            self.worker,
            RemoteBuffer(buffer, timeout),
            RemotePeer(queue, timeout, "the prompt queue"),
            RemoteWeights(store, timeout),
            index,
            holder=self.holder,
        )
        with warnings.catch_warnings():  # Ray's own property reads a deprecated one internally
            warnings.simplefilter("ignore")
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    def ping(self) -> dict:
        return {
            "index": self.index,
            "restarted": self.restarted,
            "version": self.worker.version,
            "holder": self.holder,
            "node": ray.get_runtime_context().get_node_id(),
        }

    def maybe_load_weights(self) -> bool:
        """Between batches only: adopt the newest published weights if they are newer than ours."""
        return self.role.adopt_weights()

    def run_loop(self) -> dict:
        """The role's cycle, under a lease name of its own: a loop the driver declared lost had its name revoked
        (its prompts went back to the queue), and a loop started again in this same process (Ray did not
        restart it) must not carry the revoked name, or every admission would be refused and it would never
        generate again."""
        self.holder = self.role.holder = f"{self.index}-{uuid.uuid4().hex[:8]}"
        return self.role.run()

    def stop(self) -> None:
        self.role.stop()

    def close(self) -> None:
        """Close what the worker holds (environment processes: each closes the instances it holds first; reward
        processes; the agent runner) before the actor is killed; called once its loop has been stopped."""
        self.worker.close()

    def stats(self) -> dict:
        return {**self.role.stats(), "restarted": self.restarted}

    def rng_state(self) -> torch.Tensor:
        return self.worker.engine.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.worker.engine.generator.set_state(state)

    def crash(self) -> None:
        """Fault-injection hook: die the way a segfault or an OOM kill would."""
        die()


def rollout_rng_states(workers: list, retry_s: float = 10.0) -> list:
    """Each rollout worker's sampling RNG state, or None for a worker that stays unavailable (Ray is
    restarting it) for `retry_s`: calls to a restarting worker are retried with a bound, never fatal."""
    states: list = []
    for i, worker in enumerate(workers):
        deadline = time.monotonic() + retry_s
        while True:
            try:
                states.append(ray.get(worker.rng_state.remote(), timeout=max(1.0, deadline - time.monotonic())))
                break
            except (
                ray.exceptions.ActorUnavailableError,
                ray.exceptions.RayActorError,
                ray.exceptions.GetTimeoutError,
            ) as exc:
                if time.monotonic() >= deadline:
                    log.warning("rollout worker %d did not give its RNG state (%s)", i, type(exc).__name__)
                    states.append(None)
                    break
                time.sleep(0.5)
    return states
