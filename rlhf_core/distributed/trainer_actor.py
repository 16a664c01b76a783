"""The trainer actor: the Trainer in its own process, talking through Ray (rank 0 of a sharded trainer group
when cluster.trainer_workers > 1; the other ranks are `trainer_group.TrainerRankActor`s).

Its parts are built by `rlhf_core.build`; it takes batches from the experience buffer and publishes weights
to the weight store (the control objects of `control.py`, each a Ray actor). The loop is a long-running actor
method; the actor is threaded (`max_concurrency`), so control calls (stats, stop, publish, evaluate,
checkpoint) stay answerable while it runs. Every blocking wait has a timeout and a message naming what it
waited for.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import ray
import torch

from rlhf_core import build
from rlhf_core.build import export_run_policy
from rlhf_core.checkpoint import (
    CheckpointState,
    capture_rng,
    checkpoint_dir,
    load_checkpoint,
    load_weights_into,
    restore_rng,
    save_checkpoint,
)
from rlhf_core.data import Prompt
from rlhf_core.distributed.calls import WaitTimeout, die, get_or_fail
from rlhf_core.distributed.control import busy_fraction
from rlhf_core.distributed.rollout_actor import rollout_rng_states
from rlhf_core.distributed.trainer_group import group_address, join_trainer_group
from rlhf_core.distributed.transport import pack_groups, pack_state_dict, unpack_groups
from rlhf_core.lora import adapter_state_dict, is_lora
from rlhf_core.types import Experience, cat_rollouts

log = logging.getLogger("rlhf_core.distributed")
TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"  # in the run dir: one line per step, {"step", "prompt_ids"}


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
        self.address = group_address() if self.sharded else None
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
        self.trained: dict[int, int] = {}  # prompt uid -> times trained on in the run: in every checkpoint
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
        self.trainer = join_trainer_group(self.cfg, copy.deepcopy(self.model), self.tokenizer, self.address, 0)
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
            pilot = self.cfg.runtime.autopilot  # the autopilot moves the buffer's bound up to its ceiling
            bound = pilot.max_staleness if pilot.enabled else self.cfg.runtime.max_staleness
            # per token (partial rollouts: a row's tokens may be of several versions; policy_version is the oldest)
            token_staleness = (consumer_version - batch.versions_per_token())[batch.trained_mask]
            worst = max([int(staleness.max()), *([int(token_staleness.max())] if token_staleness.numel() else [])])
            if worst > bound:  # the buffer guarantees this; never train on it
                raise RuntimeError(f"staleness bound violated: tau={worst} > max_staleness")
            for tau, count in zip(*torch.unique(staleness, return_counts=True)):
                self.staleness_hist[int(tau)] = self.staleness_hist.get(int(tau), 0) + int(count)
            m = self._on_all("train_step", batch)
            self.groups_trained += len(groups)
            for g in groups:
                self.trained[g.prompt_id] = self.trained.get(g.prompt_id, 0) + 1
            self._record_trained(self.trainer.step, [g.prompt_id for g in groups])
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

    def _record_trained(self, step: int, prompt_ids: list[int]) -> None:
        """Append the step's prompt ids to <run_dir>/trained_prompts.jsonl (what each step trained on)."""
        path = Path(self.cfg.run.run_dir) / TRAINED_PROMPTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"step": int(step), "prompt_ids": [int(u) for u in prompt_ids]}) + "\n")

    def set_trained(self, trained: dict) -> None:
        """The prompts trained on so far (uid -> times), as a resumed run's prompt queue restored them."""
        with self.lock:
            self.trained = {int(k): int(v) for k, v in trained.items()}

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
        path = checkpoint_dir(self.cfg.run.run_dir, step)
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
                data={**data, "trained": dict(self.trained)},  # exactly-once resume: what was trained on
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
            state = load_checkpoint(path, self.trainer.model, critic=self.trainer.critic)
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
        die()
