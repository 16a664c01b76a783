"""The rollout, trainer and reward-model actors: core workers in their own processes, talking through Ray.

Their parts are built by `rlhf_core.build` (as the single-process loop's are); the prompt queue, the
experience buffer and the weight store are the plain control objects of `control.py`, each wrapped in a
Ray actor by the runtime; experience and weights cross processes packed by `transport.py`.

The rollout and trainer loops are long-running actor methods; the actors are threaded
(`max_concurrency`), so control calls (stats, stop, load weights, publish, evaluate, checkpoint) stay
answerable while a loop runs. Every blocking wait has a timeout and a message naming what it waited for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import ray
import torch

from rlhf_core import build
from rlhf_core.build import export_run_policy
from rlhf_core.checkpoint import (
    CheckpointState,
    capture_rng,
    load_checkpoint,
    load_weights_into,
    restore_rng,
    save_checkpoint,
)
from rlhf_core.data import Prompt
from rlhf_core.distributed.control import busy_fraction
from rlhf_core.distributed.transport import pack_groups, pack_state_dict, unpack_groups, unpack_state_dict
from rlhf_core.lora import adapter_state_dict, is_lora
from rlhf_core.trainer import Trainer
from rlhf_core.types import Experience, cat_rollouts

log = logging.getLogger("rlhf_core.distributed")


class WaitTimeout(TimeoutError):
    """A blocking wait ran past runtime.wait_timeout_s."""


def get_or_fail(ref, timeout_s: float, what: str):
    """ray.get with a timeout whose error names what was waited for."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what} (runtime.wait_timeout_s)") from None


# --------------------------------------------------------------------------------------------- reward model
class RewardModelActor:
    """The reward model (`rlhf_core.reward.model.RewardModelScorer`) in its own process, with its own
    resources (cluster.reward_cpus / reward_gpus); rollout workers find it by name and send it their rows.
    Calls run one at a time (the actor's default concurrency): one model, one set of running moments."""

    def __init__(self, cfg, policy_dir: str):
        from rlhf_core.reward.model import RewardModelScorer

        build.setup_process(cfg, cfg.trainer.seed)
        tokenizer = build.build_tokenizer(cfg, policy_dir)
        self.scorer = RewardModelScorer(cfg.reward.model, tokenizer, build.build_stop_ids(cfg, tokenizer, policy_dir))

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


# --------------------------------------------------------------------------------------------- rollout
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
        groups = self.worker.generate_groups(prompts)
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
                self.generate_once(n, wait=False, prompts_ref=prompts_ref)
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
        _die()


# --------------------------------------------------------------------------------------------- trainer
# --------------------------------------------------------------------------------------------- trainer group
def _group_address() -> str:
    """tcp://<this node's IP>:<a free port>: where rank 0 of a trainer group meets the others."""
    import socket

    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"tcp://{ip}:{s.getsockname()[1]}"


def _join_trainer_group(cfg, model, tokenizer, address: str, rank: int):
    """Join the torch.distributed group of cluster.trainer_workers ranks (NCCL on GPU, gloo on CPU; collectives
    time out after runtime.wait_timeout_s) and build this rank's sharded Trainer of `model`."""
    from datetime import timedelta

    import torch.distributed as dist

    on_gpu = next(model.parameters()).device.type == "cuda"
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=address,
        rank=rank,
        world_size=cfg.cluster.trainer_workers,
        timeout=timedelta(seconds=cfg.runtime.wait_timeout_s),
    )
    return Trainer(model, cfg, tokenizer.pad_token_id, group=dist.group.WORLD)


class TrainerRankActor:
    """Rank r > 0 of a sharded trainer group (cluster.trainer_workers > 1): holds its shard of the policy,
    gradients and optimizer state, and runs each collective operation rank 0 (the TrainerActor) asks for, in
    rank 0's order, on the same arguments. It talks to nothing else."""

    def __init__(self, cfg, policy_dir: str, rank: int, address: str):
        build.setup_process(cfg, cfg.trainer.seed)
        self.rank = rank
        model, tokenizer = build.build_policy(cfg, policy_dir)
        self.trainer = _join_trainer_group(cfg, model, tokenizer, address, rank)

    def call(self, name: str, *args) -> None:
        """Run Trainer.<name>(*args) here (rank 0 runs it at the same time); the result stays here."""
        getattr(self.trainer, name)(*args)

    def restore(self, path: str) -> None:
        """This rank's shard of a checkpoint's weights and optimizer state, its versions and RNG."""
        state = load_checkpoint(path, self.trainer.model)
        self.trainer.load_state_dict(state.trainer)
        restore_rng(state.rng["trainer"])

    def ping(self) -> int:
        return self.rank

    def crash(self) -> None:
        """Fault-injection hook: die the way a segfault or an OOM kill would."""
        _die()


class TrainerActor:
    """The Trainer in its own process: takes whole batches of groups, steps, publishes weights.

    With cluster.trainer_workers = N > 1 it is rank 0 of a sharded trainer group: after `join_group` (the
    runtime starts ranks 1..N-1 as TrainerRankActors) every step, weight snapshot and checkpoint is run on
    all ranks at once (`_on_all`), each rank training on its slice of the batch; rank 0 alone talks to the
    buffer and the weight store. It keeps an unsharded copy of the policy (`self.model`) for evaluation,
    export and the warm start, refreshed from the gathered weights when those need it. A rank that dies
    fails the step with a message naming the rank and the step."""

    def __init__(self, cfg, policy_dir: str, train_prompts: list[Prompt], heldout: list[Prompt], buffer, store):
        build.setup_process(cfg, cfg.trainer.seed)
        self.cfg, self.buffer, self.store = cfg, buffer, store
        self.train_prompts = train_prompts  # for the warm start only
        self.model, self.tokenizer = build.build_policy(cfg, policy_dir)
        self.followers: list = []  # ranks 1..N-1 of a sharded trainer group
        self.sharded = cfg.cluster.trainer_workers > 1
        self.trainer = None if self.sharded else build.build_trainer(cfg, self.model, self.tokenizer)
        self.address = _group_address() if self.sharded else None
        self.evaluator = build.build_evaluator(cfg, self.model, self.tokenizer, policy_dir, heldout)
        self.lock = threading.Lock()  # one of: train step, evaluation, checkpoint, export
        self.stop_event = threading.Event()
        self.metrics: list[dict] = []
        self.idle_s = 0.0
        self.work_started: Optional[float] = None  # wall clock of the first step: busy_frac's denominator
        self.timeout = cfg.runtime.wait_timeout_s
        self.error: Optional[str] = None
        self.staleness_hist: dict[int, int] = {}
        self.groups_trained = 0  # counted here, independently of the buffer's count (reconcile)
        self.checkpoints_written: list[dict] = []
        self.peers = None
        self.last_publish_s: Optional[float] = None

    # ------------------------------------------------------------------ a sharded trainer group
    def group_address(self) -> Optional[str]:
        """Where ranks 1..N-1 meet this one (None for a single trainer)."""
        return self.address

    def join_group(self, followers: list) -> int:
        """Rank 0 joins the group the `followers` (ranks 1..N-1, starting meanwhile) join, and builds its sharded
        Trainer from a copy of the policy (this actor keeps the unsharded one). Returns the world size."""
        import copy

        self.followers = list(followers)
        self.trainer = _join_trainer_group(self.cfg, copy.deepcopy(self.model), self.tokenizer, self.address, 0)
        return 1 + len(self.followers)

    def _on_all(self, name: str, *args):
        """Trainer.<name>(*args) on every rank at once (a collective with N ranks), rank 0's result. A rank
        that died (or failed) fails the call with a message naming it and the step."""
        refs = [f.call.remote(name, *args) for f in self.followers]
        try:
            out = getattr(self.trainer, name)(*args)
        except Exception as exc:
            try:
                self._check_ranks(refs, name, timeout_s=10.0)  # a dead peer is why rank 0's collective failed
            except WaitTimeout:  # a rank still busy, not dead: rank 0's own error is the news
                pass
            raise RuntimeError(f"trainer rank 0 failed in {name} at step {self.trainer.step + 1}: {exc}") from exc
        self._check_ranks(refs, name, self.timeout)
        return out

    def _check_ranks(self, refs: list, name: str, timeout_s: float) -> None:
        n = 1 + len(self.followers)
        for rank, ref in enumerate(refs, start=1):
            try:
                get_or_fail(ref, timeout_s, f"trainer rank {rank} of {n} to finish {name}")
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                died = isinstance(exc, ray.exceptions.RayActorError)
                raise RuntimeError(
                    f"trainer rank {rank} of {n} {'died' if died else 'failed'} in {name} at step "
                    f"{self.trainer.step + 1}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None

    def _refresh_model(self) -> None:
        """The unsharded copy of a sharded trainer gets the current weights (gathered from the ranks)."""
        if self.sharded:
            load_weights_into(self.model, self._on_all("full_weights"))

    def publish(self) -> float:
        """Publish the current weights now (the flow's "sync sooner"); returns seconds. Waits for a
        running step to finish, so the snapshot is never torn."""
        start = time.perf_counter()
        with self.lock:
            snapshot, version = self._on_all("state_dict_for_sync"), self.trainer.version
        self._ship(version, snapshot, published=True)
        return time.perf_counter() - start

    def _ship(self, version: int, snapshot: Optional[dict], published: bool) -> None:
        """After a step (or a publish request): one ray.put of the CPU snapshot, registered in the weight
        store, then the buffer's version update, in that order: the buffer learns the published version
        (for admission) only after the store holds the weights, so a worker admitted against version v
        always finds weights >= v. Records the publish seconds in self.last_publish_s."""
        start = time.perf_counter()
        if snapshot is not None:
            ref = ray.put(pack_state_dict(snapshot))
            get_or_fail(
                self.store.publish.remote(version, [ref], time.perf_counter() - start),
                self.timeout,
                "the weight store to register a publish",
            )
        get_or_fail(
            self.buffer.advance.remote(version, version if published else None),
            self.timeout,
            "the replay buffer version update",
        )
        if snapshot is not None:
            self.last_publish_s = time.perf_counter() - start

    def _take_batch(self, wait_s: float, for_version: Optional[int] = None) -> list[Experience]:
        """prompts_per_step groups from the buffer, unpacked, or [] if they did not arrive within wait_s."""
        return unpack_groups(
            get_or_fail(
                self.buffer.take.remote(self.cfg.trainer.prompts_per_step, wait_s, for_version),
                wait_s + self.timeout,
                "a batch from the replay buffer",
            )
        )

    def train_once(self, wait_s: Optional[float] = None) -> Optional[dict]:
        """Take prompts_per_step groups (waiting up to wait_s), train one step, publish by sync_every, in
        lockstep: everything is done when it returns (sync mode)."""
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        groups = self._take_batch(wait_s if wait_s is not None else self.timeout)
        self.idle_s += time.perf_counter() - t0
        return self._train_on(groups, t0) if groups else None

    def _train_on(self, groups: list[Experience], t0: float, shipper=None) -> dict:
        """One trainer step on these groups (t0: when waiting for them began). The weights snapshot (when
        sync_every says so) is taken at once; shipping it and advancing the buffer happen here, or on the
        `shipper` executor while the next step runs."""
        t1 = time.perf_counter()
        with self.lock:
            batch = cat_rollouts([g.batch for g in groups], self.tokenizer.pad_token_id)
            consumer_version = self.trainer.version
            staleness = consumer_version - batch.policy_version
            if int(staleness.max()) > self.cfg.runtime.max_staleness:  # the buffer guarantees this; never train on it
                raise RuntimeError(f"staleness bound violated: tau={int(staleness.max())} > max_staleness")
            for tau, count in zip(*torch.unique(staleness, return_counts=True)):
                self.staleness_hist[int(tau)] = self.staleness_hist.get(int(tau), 0) + int(count)
            m = self._on_all("train_step", batch)
            self.groups_trained += len(groups)
            version = self.trainer.version
            due = bool(m["trainer/step_finite"]) and version % self.cfg.runtime.sync_every == 0
            # copied now, under the lock: the next optimizer step changes the weights in place
            snap_start = time.perf_counter()
            snapshot = self._on_all("state_dict_for_sync") if due else None
            snapshot_s = time.perf_counter() - snap_start
        (shipper or self._ship)(version, snapshot, due)
        if due:  # the CPU copy of the weights (with N trainer ranks: gathered from the shards)
            m["sync/snapshot_s"] = snapshot_s
        if due and self.last_publish_s is not None:
            m["sync/latency_s"] = self.last_publish_s  # in async mode: the latest publish that has completed
        t2 = time.perf_counter()
        m.update(
            {
                "time/train_s": t2 - t1,
                "time/wait_s": t1 - t0,
                "step": self.trainer.step,
                "throughput/samples_per_s": len(batch) / max(1e-9, t2 - t0),
                "throughput/tokens_per_s": batch.num_tokens / max(1e-9, t2 - t0),
            }
        )
        self.metrics.append(m)
        return m

    def run_loop(self, total_steps: int) -> dict:
        """Train until total_steps or stop(), continuously (async mode).

        Two helper threads keep the data plane off the trainer's critical path: with runtime.prefetch
        one takes (and unpacks) the batch for version V + 1 while step V trains, and one ships each
        published snapshot and advances the buffer, one at a time and in order, while the next step
        trains. A batch still prefetched when the loop ends goes back to the buffer; the last publish
        completes first.
        """
        self.stop_event.clear()
        wait_s = 0.5
        nxt = None
        shipping = None  # the publish in flight, if any

        def ship(version, snapshot, published):
            # one publish in flight: at most two snapshots exist (shipping, and this one), and a failed
            # publish or buffer update surfaces here, a step later
            nonlocal shipping
            if shipping is not None:
                shipping.result()
            shipping = shipper_pool.submit(self._ship, version, snapshot, published)

        try:
            with (
                ThreadPoolExecutor(1, thread_name_prefix="trainer-prefetch") as take_pool,
                ThreadPoolExecutor(1, thread_name_prefix="trainer-publish") as shipper_pool,
            ):
                try:
                    while self.trainer.step < total_steps and not self.stop_event.is_set():
                        t0 = time.perf_counter()
                        self.work_started = self.work_started or t0
                        fut = nxt or take_pool.submit(self._take_batch, wait_s, self.trainer.version)
                        nxt = None
                        groups = fut.result()
                        self.idle_s += time.perf_counter() - t0
                        if not groups:
                            continue
                        if self.cfg.runtime.prefetch and self.trainer.step + 1 < total_steps:
                            nxt = take_pool.submit(self._take_batch, wait_s, self.trainer.version + 1)
                        self._train_on(groups, t0, shipper=ship)
                        self._checkpoint_if_due(total_steps)
                except BaseException:
                    self._settle(shipping, nxt, quiet=True)  # the loop's own error is the one to report
                    raise
                self._settle(shipping, nxt, quiet=False)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        return self.stats()

    def _settle(self, shipping, prefetched, quiet: bool) -> None:
        """When the loop ends: wait for the publish in flight, then return a prefetched, untrained batch
        to the buffer so that the accounting still adds up. quiet: log failures instead of raising them."""

        def attempt(fn, what: str):
            try:
                return fn()
            except Exception as exc:
                if not quiet:
                    raise
                log.warning("%s failed while the trainer loop was ending: %s", what, exc)
                return None

        try:
            if shipping is not None:
                attempt(shipping.result, "a weights publish")
        finally:  # even when a publish failed: the accounting must still add up
            groups = attempt(prefetched.result, "the prefetched take") if prefetched is not None else None
            if groups:
                attempt(
                    lambda: get_or_fail(
                        self.buffer.give_back.remote(pack_groups(groups)),
                        self.timeout,
                        "the replay buffer to take back a prefetched batch",
                    ),
                    "the give-back",
                )

    def stop(self) -> None:
        self.stop_event.set()

    def drain_metrics(self) -> list[dict]:
        out, self.metrics = self.metrics, []
        return out

    def evaluate(self) -> dict:
        with self.lock:
            self._refresh_model()
            return self.evaluator()

    def set_checkpointing(self, queue, workers: list, run_facts: dict) -> None:
        """Async mode: this trainer writes a checkpoint at every exact multiple of tracking.checkpoint_every
        (before total_steps), named by the step it holds; it asks `queue` and `workers` for their state.
        `run_facts` (held-out accuracy at the start, MLflow run id) go into each checkpoint."""
        self.peers = (queue, list(workers))
        self.run_facts = dict(run_facts)

    def _checkpoint_if_due(self, total_steps: int) -> None:
        every, step = self.cfg.tracking.checkpoint_every, self.trainer.step
        if not every or step % every or step >= total_steps or getattr(self, "peers", None) is None:
            return
        queue, workers = self.peers
        data = get_or_fail(queue.state_dict.remote(), self.timeout, "the prompt queue position")
        rollout_rng = rollout_rng_states(workers)
        facts = dict(self.run_facts)
        missing = [i for i, s in enumerate(rollout_rng) if s is None]
        if missing:
            facts["rollout_rng_missing"] = missing
        path = self.cfg.run.run_dir / "checkpoints" / f"step_{step:06d}"
        self.checkpoint(str(path), data, rollout_rng, facts)
        self.checkpoints_written.append({"step": step, "path": str(path), "rollout_rng_missing": missing})

    def drain_checkpoints(self) -> list[dict]:
        """Checkpoints the loop wrote since the last call: [{step, path, rollout_rng_missing}]."""
        out, self.checkpoints_written = self.checkpoints_written, []
        return out

    def warm_start(self, steps: int) -> dict:
        """The supervised format warm start on this trainer's model (before the first publish)."""
        from rlhf_core.warm_start import warm_start

        with self.lock:
            out = warm_start(self.model, self.tokenizer, self.train_prompts, self.cfg, steps)
            if self.sharded:  # trained on the unsharded copy: every rank takes its shard of the result
                weights = (
                    adapter_state_dict(self.model)  # with LoRA only the adapters trained
                    if is_lora(self.model)
                    else {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
                )
                self._on_all("load_full_weights", weights)
            return out

    def checkpoint(self, path: str, data: dict, rollout_rng: list, run: dict) -> str:
        """The one checkpoint layout: this process's weights, optimizer, versions and RNG, plus what the
        runtime gathered from the others (prompt queue position, rollout engines' RNG, run facts)."""
        with self.lock:
            state = CheckpointState(
                trainer=self._on_all("state_dict"),
                data=data,
                rng={"trainer": capture_rng(), "rollout": list(rollout_rng)},
                run=dict(run),
                config=self.cfg.model_dump(mode="json"),
            )
            if not self.sharded:
                return str(save_checkpoint(path, self.model, state))
            weights = self._on_all("full_weights")  # gathered: the same file one trainer writes
            return str(save_checkpoint(path, self.trainer.model, state, weights=weights))

    def restore(self, path: str) -> CheckpointState:
        """Validate, then restore weights, optimizer, versions and RNG; returns the state for the others."""
        with self.lock:
            refs = [f.restore.remote(path) for f in self.followers]  # each rank reads its shard
            state = load_checkpoint(path, self.trainer.model)
            self.trainer.load_state_dict(state.trainer)
            restore_rng(state.rng["trainer"])
            self._check_ranks(refs, "restore", self.timeout)
        return state

    def export(self, path: str) -> str:
        """The policy as a Hugging Face directory (with LoRA: the PEFT adapter, plus the merged model when
        model.lora.export_merged), with its tokenizer and the run's config."""
        with self.lock:
            self._refresh_model()
            return str(export_run_policy(self.cfg, self.model, self.tokenizer, path))

    def stats(self) -> dict:
        s = self.trainer.stats()
        s.update(
            {
                "idle_s": self.idle_s,
                "busy_frac": busy_fraction(s["busy_s"], self.work_started),
                "error": self.error,
                "staleness_hist": dict(self.staleness_hist),
                "consecutive_skips": self.trainer.consecutive_skips,
                "groups_trained": self.groups_trained,
            }
        )
        return s

    def version(self) -> int:
        return self.trainer.version

    def crash(self) -> None:
        """Fault-injection hook: die the way a segfault or an OOM kill would."""
        _die()


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


def _die() -> None:
    os._exit(1)
