"""The rollout actor: a RolloutWorker in its own process, talking through Ray.

Its parts are built by `rlhf_core.build` (as the single-process loop's are); the prompt queue, the experience
buffer and the weight store are the plain control objects (`rlhf_core.data.queue`, `control.py`), each
wrapped in a Ray actor by the runtime; experience and weights cross processes packed by `transport.py`.
The loop is a long-running actor method; the actor is threaded (`max_concurrency`), so control calls (stats,
stop, RNG state) stay answerable while it runs. Every blocking wait has a timeout and a message naming
what it waited for.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import ray
import torch

from rlhf_core import build
from rlhf_core.distributed.calls import die, get_or_fail
from rlhf_core.distributed.control import busy_fraction
from rlhf_core.distributed.reward_model_actor import RemoteRewardModel
from rlhf_core.distributed.transport import pack_groups, unpack_state_dict
from rlhf_core.types import Experience

log = logging.getLogger("rlhf_core.distributed")


class RolloutActor:
    """A RolloutWorker in its own process: loads the newest weights between batches, asks admission,
    takes prompts, generates, scores, pushes groups. Restarted by Ray if it dies."""

    def __init__(self, cfg, policy_dir: str, index: int, peers: dict[str, str]):
        # The buffer, prompt queue and weight store come by name, looked up here: a restartable actor whose
        # constructor takes actor handles cannot be restarted safely by Ray (and Ray says so at creation).
        seed = build.rollout_seed(cfg, index)
        build.setup_process(cfg, seed)
        self.cfg, self.index = cfg, index
        self.buffer, self.queue, self.store = (ray.get_actor(peers[k]) for k in ("buffer", "queue", "store"))
        model, tokenizer = build.build_policy(cfg, policy_dir)
        remote = None  # the reward model, when there is one, is scored by its own actor
        if "reward_model" in peers:
            remote = RemoteRewardModel(ray.get_actor(peers["reward_model"]), cfg, tokenizer)
        self.worker = build.build_rollout_worker(cfg, model, tokenizer, policy_dir, seed, reward_model=remote)
        self.stop_event = threading.Event()
        self.timeout = cfg.runtime.wait_timeout_s
        self.syncs: list[dict] = []
        self.groups_pushed = 0
        self.pending_push = None  # (future, n_groups) of a push not yet confirmed (async loop only)
        self._push_pool = None  # the async loop's push thread, made on first use
        # seconds outside generation, by phase (stats: per batch): where the rollout's cycle goes
        self.phase_s = {"weights": 0.0, "prompts": 0.0, "split": 0.0, "push": 0.0}
        self.work_started: Optional[float] = None  # wall clock of the first batch: busy_frac's denominator
        with warnings.catch_warnings():  # Ray's own property reads a deprecated one internally
            warnings.simplefilter("ignore")
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.loop_running = False
        # partial rollouts: the weight-store request in flight between decode steps, and when it was sent
        self._newer_ref = None
        self._newer_asked = 0.0

    def ping(self) -> dict:
        return {"index": self.index, "restarted": self.restarted, "version": self.worker.version}

    def maybe_load_weights(self) -> bool:
        """Between batches only: adopt the newest published weights if they are newer than ours."""
        asked = time.perf_counter()
        found = get_or_fail(self.store.get_if_newer.remote(self.worker.version), self.timeout, "the weight store")
        if found is None:
            self.phase_s["weights"] += time.perf_counter() - asked
            return False
        version, (ref,) = found
        start = time.perf_counter()
        state_dict = unpack_state_dict(get_or_fail(ref, self.timeout, f"weights of version {version}"))
        fetched = time.perf_counter()
        self.worker.load_weights(state_dict, version)
        done = time.perf_counter()
        self.syncs.append(
            {"version": version, "fetch_s": fetched - start, "load_s": done - fetched, "stall_s": done - start}
        )
        self.phase_s["weights"] += done - asked
        return True

    def generate_once(self, n_prompts: int, wait: bool = True, prompts_ref=None) -> int:
        """Take n prompts, generate, push. Returns groups generated (sync mode calls this directly).

        wait=False (the async loop) packs and pushes on a helper thread and does not wait for the buffer to
        accept this push, only for the previous one: at most one push is in flight, pushes stay in order,
        and a failed push surfaces a batch later.
        prompts_ref: a prompt-queue request already sent (the async loop sends it beside the weights check).
        """
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        prompts = get_or_fail(
            prompts_ref or self.queue.get.remote(n_prompts), self.timeout, "prompts from the prompt queue"
        )
        t1 = time.perf_counter()
        self.phase_s["prompts"] += t1 - t0
        if not prompts:
            return 0
        busy_before = self.worker.busy_s
        between_steps = self._between_steps if self.cfg.rollout.partial_rollout else None
        groups = self.worker.generate_groups(prompts, between_steps=between_steps)
        t2 = time.perf_counter()
        self.phase_s["split"] += (t2 - t1) - (
            self.worker.busy_s - busy_before
        )  # what generate_groups adds to rollout()
        self.confirm_push()
        if wait:
            self._push(groups)
            self.groups_pushed += len(groups)
        else:  # packing, serialising and the buffer's answer happen on the push thread, beside the next batch
            if self._push_pool is None:
                self._push_pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-push")
            self.pending_push = (self._push_pool.submit(self._push, groups), len(groups))
        self.phase_s["push"] += time.perf_counter() - t2
        return len(groups)

    def _between_steps(self):
        """Partial rollouts: called by the engine between decode steps (and, with an environment, by its runner
        between a trajectory's turns). Asks the weight store for newer weights without waiting (one request in
        flight, at most every 20 ms); when newer ones are published, fetches them (the fetch is this worker's
        stall, recorded as a sync) and hands them to the engine."""
        now = time.perf_counter()
        ref = self._newer_ref
        if ref is None:
            if now - self._newer_asked < 0.02:
                return None
            self._newer_ref = self.store.get_if_newer.remote(self.worker.version)
            self._newer_asked = now
            return None
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        self._newer_ref = None
        found = get_or_fail(ref, self.timeout, "the weight store")
        if found is None or found[0] <= self.worker.version:
            return None
        version, (weights_ref,) = found
        state_dict = unpack_state_dict(get_or_fail(weights_ref, self.timeout, f"weights of version {version}"))
        fetched = time.perf_counter()
        self.syncs.append(
            {"version": version, "fetch_s": fetched - now, "load_s": 0.0, "stall_s": fetched - now, "mid_batch": True}
        )
        return state_dict, version

    def _push(self, groups: list[Experience]) -> None:
        get_or_fail(self.buffer.push.remote(pack_groups(groups)), self.timeout, "the replay buffer to accept a push")

    def confirm_push(self) -> None:
        """Wait for the push in flight, if any, and count its groups."""
        if self.pending_push is not None:
            future, n_groups = self.pending_push
            self.pending_push = None
            future.result()  # a failed push surfaces here, a batch later
            self.groups_pushed += n_groups

    def run_loop(self) -> dict:
        """Generate continuously until stop(); idle time (admission denied, weights loading) is counted.

        Round trips overlap where the order allows: the prompt request goes out beside the weights check,
        and the next batch's admission request goes out before this batch generates, so its answer is
        waiting when generation ends. The staleness bound does not rest on admission (the buffer evicts
        and the trainer checks), and the batch still loads the newest weights when it starts; what an
        early grant can cost is one batch generated after a pause or a narrowed admission window. A
        grant the loop does not use is released when it ends."""
        self.stop_event.clear()
        self.loop_running = True
        n = self.cfg.rollout.prompts_per_batch
        admit_ref = None
        try:
            while not self.stop_event.is_set():
                t0 = time.perf_counter()
                admitted = get_or_fail(
                    admit_ref or self.buffer.try_admit.remote(n), self.timeout, "admission from the replay buffer"
                )
                admit_ref = None
                if not admitted:
                    self.stop_event.wait(0.005)
                    self.worker.add_idle(time.perf_counter() - t0)
                    continue
                self.worker.add_idle(time.perf_counter() - t0)
                prompts_ref = self.queue.get.remote(n)
                self.maybe_load_weights()  # admitted against version v: weights >= v are published, load them
                admit_ref = self.buffer.try_admit.remote(n)
                made = self.generate_once(n, wait=False, prompts_ref=prompts_ref)
                if made < n and self.worker.env is not None:
                    # groups with a failed trajectory are left out: their admission is free again
                    self.buffer.release.remote(n - made)
            self.confirm_push()
        finally:
            self.loop_running = False
            if admit_ref is not None:
                self._release_unused(admit_ref, n)
        return self.stats()

    def _release_unused(self, admit_ref, n: int) -> None:
        """Return a grant for a batch that will not be generated, so the capacity stays exact (best effort:
        the loop may be ending because the buffer is unreachable)."""
        try:
            if get_or_fail(admit_ref, self.timeout, "admission from the replay buffer"):
                get_or_fail(self.buffer.release.remote(n), self.timeout, "the replay buffer to release an admission")
        except Exception as exc:
            log.warning("rollout worker %d could not release an unused admission: %s", self.index, exc)

    def stop(self) -> None:
        self.stop_event.set()

    def stats(self) -> dict:
        s = self.worker.stats()
        stalls = [x["stall_s"] for x in self.syncs]
        s.update(
            {
                "index": self.index,
                "restarted": self.restarted,
                "groups_pushed": self.groups_pushed,
                "syncs": len(self.syncs),
                "syncs_mid_batch": sum(1 for x in self.syncs if x.get("mid_batch")),
                "sync_stall_s_mean": sum(stalls) / len(stalls) if stalls else 0.0,
                "sync_stall_s_max": max(stalls) if stalls else 0.0,
                "batch_s_mean": s["busy_s"] / s["batches"] if s["batches"] else 0.0,
                "phase_s_per_batch": {k: v / s["batches"] if s["batches"] else 0.0 for k, v in self.phase_s.items()},
                "loop_running": self.loop_running,
                "busy_frac": busy_fraction(s["busy_s"], self.work_started),
            }
        )
        return s

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
