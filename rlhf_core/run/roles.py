"""Each role's cycle, written once and Ray-free: the trainer's and the rollout worker's.

    trainer: take a batch within the bound the buffer enforced -> train -> record -> publish (runtime.sync_every)
             -> checkpoint when due; `checkpoint()` and `restore()` are the one writer and reader of run state.
    rollout: admit -> take prompts -> adopt the newest weights -> generate -> score -> push.

A role talks to its peers (the experience buffer, the weight store, the prompt queue) by method calls only.
In one process the peers are the plain objects (`rlhf_core.run.local` wraps them in `LocalPeer`); on Ray
they are actor handles behind the adapters of `rlhf_core.distributed.peers`, which also carry the transport
(packing, the object store). Whoever hosts a role (`rlhf_core.run.local`, the Ray actors) only supplies
threads, ranks and stats: a feature written here behaves the same on every host, and lockstep is
runtime.max_staleness 0, not another code path.

Peer calls: `peer.<method>(*args)` waits for the answer; `peer.submit(name, *args).result()` lets a host
overlap round trips (the rollout loop asks admission for its next batch before generating this one).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.checkpoint import (
    CheckpointState,
    capture_rng,
    checkpoint_dir,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from rlhf_core.run.control import busy_fraction
from rlhf_core.types import Experience, cat_rollouts

log = logging.getLogger("rlhf_core.run")
TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"  # in the run dir: one line per step, {"step", "prompt_ids"}


class TrainerRole:
    """The trainer's cycle over a `Trainer` (or, with `call`, over every rank of a sharded group at once).

    call(name, *args): Trainer.<name>(*args) on every rank, rank 0's result (default: this trainer's).
    snapshot(): the weights to publish (default: call("state_dict_for_sync")); a host whose rollout engine
    generates with the trainer's own model passes `lambda: None` (publishing is then only the version).
    model: the module checkpoints are written from; full_weights(): the gathered weights of a sharded group.
    peer_state(): (prompt queue state, rollout engines' RNG states) for a checkpoint, from the host."""

    def __init__(
        self,
        cfg,
        trainer,
        tokenizer,
        buffer,
        store,
        *,
        call: Optional[Callable] = None,
        snapshot: Optional[Callable[[], Optional[dict]]] = None,
        model=None,
        full_weights: Optional[Callable[[], dict]] = None,
        peer_state: Optional[Callable[[], tuple[dict, list]]] = None,
        checkpoint_root: Optional[str | Path] = None,
    ):
        self.cfg, self.trainer, self.tokenizer = cfg, trainer, tokenizer
        self.buffer, self.store = buffer, store
        self.call = call or (lambda name, *args: getattr(self.trainer, name)(*args))
        self.snapshot = snapshot or (lambda: self.call("state_dict_for_sync"))
        self.model = model if model is not None else trainer.model
        self.full_weights = full_weights
        self.peer_state = peer_state
        self.checkpoint_root = checkpoint_root  # None: <run_dir>/checkpoints
        self.run_facts: dict = {}  # what every checkpoint records about the run (eval_start, MLflow run id)
        self.lock = threading.Lock()  # one of: train step, evaluation, checkpoint, export
        self.stop_event = threading.Event()
        self.metrics: list[dict] = []
        self.idle_s = 0.0
        self.work_started: Optional[float] = None  # wall clock of the first step: busy_frac's denominator
        self.error: Optional[str] = None
        self.staleness_hist: dict[int, int] = {}
        self.groups_trained = 0  # counted here, independently of the buffer's count (reconcile)
        self.trained: dict[int, int] = {}  # prompt uid -> times trained on in the run: in every checkpoint
        self.checkpoints_written: list[dict] = []
        self.last_publish_s: Optional[float] = None
        self.bound = cfg.runtime.max_staleness  # the staleness bound the buffer enforced for the latest batch
        self.last_batch = (0, 0)  # (samples, tokens) of the latest step

    # ------------------------------------------------------------------ one step
    def take(self, wait_s: float, for_version: Optional[int] = None) -> tuple[list[Experience], int]:
        """(groups, bound): a step's groups ([] if they did not arrive within wait_s) and the bound the buffer
        enforced taking them (the one owner of the bound)."""
        return self.buffer.take(self.cfg.trainer.prompts_per_step, wait_s, for_version)

    def step(self, wait_s: float, total_steps: int) -> Optional[dict]:
        """Take, train, publish, checkpoint when due: one whole step, or None when no batch came within wait_s."""
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        groups, bound = self.take(wait_s)
        self.idle_s += time.perf_counter() - t0
        if not groups:
            return None
        m = self.train_on(groups, bound, t0)
        self.checkpoint_if_due(total_steps)
        return m

    def train_on(self, groups: list[Experience], bound: int, t0: float, shipper=None) -> dict:
        """One trainer step on these groups, taken within staleness `bound` (t0: when waiting for them began).
        The weights snapshot (when sync_every says so) is taken at once; shipping it and advancing the buffer
        happen here, or on the `shipper` executor while the next step runs."""
        t1 = time.perf_counter()
        with self.lock:
            batch = cat_rollouts([g.batch for g in groups], self.tokenizer.pad_token_id)
            consumer_version = self.trainer.version
            staleness = consumer_version - batch.policy_version
            # per token (partial rollouts: a row's tokens may be of several versions; policy_version is the oldest)
            token_staleness = (consumer_version - batch.versions_per_token())[batch.trained_mask]
            worst = max([int(staleness.max()), *([int(token_staleness.max())] if token_staleness.numel() else [])])
            if worst > bound:  # the buffer guarantees this; never train on it
                raise RuntimeError(f"staleness bound violated: tau={worst} > max_staleness={bound}")
            self.bound = bound
            for tau, count in zip(*torch.unique(staleness, return_counts=True)):
                self.staleness_hist[int(tau)] = self.staleness_hist.get(int(tau), 0) + int(count)
            m = self.call("train_step", batch)
            self.groups_trained += len(groups)
            for g in groups:
                self.trained[g.prompt_id] = self.trained.get(g.prompt_id, 0) + 1
            self._record_trained(self.trainer.step, [g.prompt_id for g in groups])
            version = self.trainer.version
            due = bool(m["trainer/step_finite"]) and version % self.cfg.runtime.sync_every == 0
            # copied now, under the lock: the next optimizer step changes the weights in place
            snap_start = time.perf_counter()
            snapshot = self.snapshot() if due else None
            snapshot_s = time.perf_counter() - snap_start
        (shipper or self.ship)(version, snapshot, due)
        if due:  # the CPU copy of the weights (with N trainer ranks: gathered from the shards)
            m["sync/snapshot_s"] = snapshot_s
        if due and self.last_publish_s is not None:
            m["sync/latency_s"] = self.last_publish_s  # the latest publish that has completed
        t2 = time.perf_counter()
        self.last_batch = (len(batch), batch.num_tokens)
        m.update(
            {
                "async/max_staleness": bound,  # the bound in force for this step's batch
                "time/train_s": t2 - t1,
                "time/wait_s": t1 - t0,
                "step": self.trainer.step,
                "throughput/samples_per_s": len(batch) / max(1e-9, t2 - t0),
                "throughput/tokens_per_s": batch.num_tokens / max(1e-9, t2 - t0),
            }
        )
        self.metrics.append(m)
        return m

    def ship(self, version: int, snapshot: Optional[dict], published: bool) -> None:
        """After a step (or a publish request): the weights to the store, then the buffer's version update, in
        that order: the buffer learns the published version (for admission) only after the store holds the
        weights, so a worker admitted against version v always finds weights >= v."""
        start = time.perf_counter()
        if published:
            self.store.publish(version, snapshot)
        self.buffer.advance(version, version if published else None)
        if published:
            self.last_publish_s = time.perf_counter() - start

    def publish(self) -> float:
        """Publish the current weights now (the flow's "sync sooner"); returns seconds. Waits for a running
        step to finish, so the snapshot is never torn."""
        start = time.perf_counter()
        with self.lock:
            snapshot, version = self.snapshot(), self.trainer.version
        self.ship(version, snapshot, published=True)
        return time.perf_counter() - start

    def _record_trained(self, step: int, prompt_ids: list[int]) -> None:
        """Append the step's prompt ids to <run_dir>/trained_prompts.jsonl (what each step trained on)."""
        path = Path(self.cfg.run.run_dir) / TRAINED_PROMPTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"step": int(step), "prompt_ids": [int(u) for u in prompt_ids]}) + "\n")

    # ------------------------------------------------------------------ the continuous loop
    def run(self, total_steps: int) -> dict:
        """Train until total_steps or stop(), continuously (in lockstep with rollout at max_staleness 0).

        Two helper threads keep the data plane off the trainer's critical path: with runtime.prefetch one
        takes the batch for version V + 1 while step V trains, and one ships each published snapshot and
        advances the buffer, one at a time and in order, while the next step trains. A batch still prefetched
        when the loop ends goes back to the buffer; the last publish completes first."""
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
            shipping = shipper_pool.submit(self.ship, version, snapshot, published)

        try:
            with (
                ThreadPoolExecutor(1, thread_name_prefix="trainer-prefetch") as take_pool,
                ThreadPoolExecutor(1, thread_name_prefix="trainer-publish") as shipper_pool,
            ):
                try:
                    while self.trainer.step < total_steps and not self.stop_event.is_set():
                        t0 = time.perf_counter()
                        self.work_started = self.work_started or t0
                        fut = nxt or take_pool.submit(self.take, wait_s, self.trainer.version)
                        nxt = None
                        groups, bound = fut.result()
                        self.idle_s += time.perf_counter() - t0
                        if not groups:
                            continue
                        if self.cfg.runtime.prefetch and self.trainer.step + 1 < total_steps:
                            nxt = take_pool.submit(self.take, wait_s, self.trainer.version + 1)
                        self.train_on(groups, bound, t0, shipper=ship)
                        self.checkpoint_if_due(total_steps)
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
            taken = attempt(prefetched.result, "the prefetched take") if prefetched is not None else None
            if taken and taken[0]:
                attempt(lambda: self.buffer.give_back(taken[0]), "the give-back")

    def stop(self) -> None:
        self.stop_event.set()

    def drain_metrics(self) -> list[dict]:
        out, self.metrics = self.metrics, []
        return out

    # ------------------------------------------------------------------ run state: the one writer and reader
    def checkpoint_if_due(self, total_steps: int) -> None:
        """At every exact multiple of checkpoint.every before total_steps (the host writes the last)."""
        every, step = self.cfg.checkpoint.every, self.trainer.step
        if not every or step % every or step >= total_steps or self.peer_state is None:
            return
        data, rollout_rng = self.peer_state()
        facts = dict(self.run_facts)
        missing = [i for i, s in enumerate(rollout_rng) if s is None]
        if missing:
            facts["rollout_rng_missing"] = missing
        path = checkpoint_dir(self.cfg.run.run_dir, step, under=self.checkpoint_root)
        self.checkpoint(str(path), data, rollout_rng, facts)
        self.checkpoints_written.append({"step": step, "path": str(path), "rollout_rng_missing": missing})

    def drain_checkpoints(self) -> list[dict]:
        """Checkpoints written since the last call: [{step, path, rollout_rng_missing}]."""
        out, self.checkpoints_written = self.checkpoints_written, []
        return out

    def checkpoint(self, path: str | Path, data: dict, rollout_rng: list, run: dict) -> str:
        """The one checkpoint layout: the trainer's weights, optimizer, versions and RNG, plus what the host
        gathered from the others (prompt queue position, rollout engines' RNG, run facts) and the bound in force
        (the autopilot's, when it is on: a resumed autopilot goes on from it)."""
        with self.lock:
            state = CheckpointState(
                trainer=self.call("state_dict"),
                data={**data, "trained": dict(self.trained)},  # exactly-once resume: what was trained on
                rng={"trainer": capture_rng(), "rollout": list(rollout_rng)},
                run={"max_staleness": self.bound, **run},
                config=self.cfg.model_dump(mode="json"),
            )
            if self.full_weights is None:
                return str(save_checkpoint(path, self.model, state))
            return str(save_checkpoint(path, self.trainer.model, state, weights=self.full_weights()))

    def restore(self, path: str | Path) -> CheckpointState:
        """Validate the whole checkpoint, then restore weights, optimizer, versions and RNG; returns the state
        for the host (prompt queue position, rollout RNG, run facts)."""
        with self.lock:
            state = load_checkpoint(path, self.trainer.model, critic=self.trainer.critic)
            self.trainer.load_state_dict(state.trainer)
            restore_rng(state.rng["trainer"])
            if self.cfg.runtime.autopilot.enabled and state.run.get("max_staleness") is not None:
                self.bound = int(state.run["max_staleness"])
        return state

    def set_trained(self, trained: dict) -> None:
        """The prompts trained on so far (uid -> times), as a resumed run's prompt queue restored them."""
        with self.lock:
            self.trained = {int(k): int(v) for k, v in trained.items()}

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


class RolloutRole:
    """The rollout worker's cycle over a `RolloutWorker`: admit -> prompts -> adopt weights -> generate -> push.

    Peers: buffer (try_admit, release, push), queue (get), store (fetch_if_newer, poll_newer)."""

    def __init__(self, cfg, worker, buffer, queue, store, index: int = 0):
        self.cfg, self.worker, self.index = cfg, worker, index
        self.buffer, self.queue, self.store = buffer, queue, store
        self.stop_event = threading.Event()
        self.syncs: list[dict] = []
        self.groups_pushed = 0
        self.pending_push = None  # (future, n_groups) of a push not yet confirmed (the continuous loop only)
        self._push_pool = None  # the loop's push thread, made on first use
        # seconds outside generation, by phase (stats: per batch): where the rollout's cycle goes
        self.phase_s = {"weights": 0.0, "prompts": 0.0, "split": 0.0, "push": 0.0}
        self.work_started: Optional[float] = None  # wall clock of the first batch: busy_frac's denominator
        self.loop_running = False

    def adopt_weights(self) -> bool:
        """Between batches: adopt the newest published weights if they are newer than ours."""
        asked = time.perf_counter()
        found = self.store.fetch_if_newer(self.worker.version)
        if found is None:
            self.phase_s["weights"] += time.perf_counter() - asked
            return False
        version, state_dict = found
        fetched = time.perf_counter()
        self.worker.load_weights(state_dict, version)
        done = time.perf_counter()
        self.syncs.append(
            {"version": version, "fetch_s": fetched - asked, "load_s": done - fetched, "stall_s": done - asked}
        )
        self.phase_s["weights"] += done - asked
        return True

    def _between_steps(self):
        """Partial rollouts: called by the engine between decode steps (and by the environment runner between
        a trajectory's turns). Returns (state_dict, version) when newer weights are published, else None; the
        store answers without waiting (`poll_newer`), so this costs nothing while there is nothing new."""
        start = time.perf_counter()
        found = self.store.poll_newer(self.worker.version)
        if found is None:
            return None
        version, state_dict = found
        fetched = time.perf_counter()
        self.syncs.append(
            {
                "version": version,
                "fetch_s": fetched - start,
                "load_s": 0.0,
                "stall_s": fetched - start,
                "mid_batch": True,
            }
        )
        return state_dict, version

    def generate(self, n_prompts: int, prompts_call=None, wait: bool = True) -> int:
        """Take n prompts, generate, score, push. Returns the groups generated.

        wait=False (the continuous loop) pushes on a helper thread and waits only for the previous push: at
        most one push is in flight, pushes stay in order, and a failed push surfaces a batch later.
        prompts_call: a prompt-queue request already sent (the loop sends it beside the weights check)."""
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        prompts = (prompts_call or self.queue.submit("get", n_prompts)).result()
        t1 = time.perf_counter()
        self.phase_s["prompts"] += t1 - t0
        if not prompts:
            return 0
        busy_before = self.worker.busy_s
        between_steps = self._between_steps if self.cfg.rollout.partial_rollout else None
        groups = self.worker.generate_groups(prompts, between_steps=between_steps)
        t2 = time.perf_counter()
        self.phase_s["split"] += (t2 - t1) - (self.worker.busy_s - busy_before)  # what generate_groups adds
        self.confirm_push()
        if wait:
            self.buffer.push(groups)
            self.groups_pushed += len(groups)
        else:
            if self._push_pool is None:
                self._push_pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-push")
            self.pending_push = (self._push_pool.submit(self.buffer.push, groups), len(groups))
        self.phase_s["push"] += time.perf_counter() - t2
        return len(groups)

    def confirm_push(self) -> None:
        """Wait for the push in flight, if any, and count its groups."""
        if self.pending_push is not None:
            future, n_groups = self.pending_push
            self.pending_push = None
            future.result()  # a failed push surfaces here, a batch later
            self.groups_pushed += n_groups

    def step(self) -> bool:
        """One batch, whole: False when admission refuses it (the buffer holds what the bound allows)."""
        t0 = time.perf_counter()
        n = int(self.buffer.try_admit(self.cfg.rollout.prompts_per_batch, 1))  # a part batch when that is what fits
        self.worker.add_idle(time.perf_counter() - t0)
        if not n:
            return False
        self.adopt_weights()
        made = self.generate(n)
        if made < n:  # groups an environment failed (or prompts that ran out): their admission is free again
            self.buffer.release(n - made)
        return True

    def run(self) -> dict:
        """Generate continuously until stop(); idle time (admission denied, weights loading) is counted.

        Round trips overlap where the order allows: the prompt request goes out beside the weights check,
        and the next batch's admission request goes out before this batch generates, so its answer is
        waiting when generation ends. The staleness bound does not rest on admission (the buffer evicts
        and the trainer checks), and the batch still loads the newest weights when it starts; what an
        early grant can cost is one batch generated after a pause or a lowered bound. A grant the loop
        does not use is released when it ends."""
        self.stop_event.clear()
        self.loop_running = True
        batch = self.cfg.rollout.prompts_per_batch
        admit = None
        try:
            while not self.stop_event.is_set():
                t0 = time.perf_counter()
                # a part batch when only that fits (groups an environment failed leave such room)
                n = int((admit or self.buffer.submit("try_admit", batch, 1)).result())
                admit = None
                if not n:
                    self.stop_event.wait(0.005)
                    self.worker.add_idle(time.perf_counter() - t0)
                    continue
                self.worker.add_idle(time.perf_counter() - t0)
                prompts = self.queue.submit("get", n)
                self.adopt_weights()  # admitted against version v: weights >= v are published, load them
                admit = self.buffer.submit("try_admit", batch, 1)
                made = self.generate(n, prompts_call=prompts, wait=False)
                if made < n:
                    self.buffer.release(n - made)
            self.confirm_push()
        finally:
            self.loop_running = False
            if admit is not None:
                self._release_unused(admit)
        return self.stats()

    def _release_unused(self, admit) -> None:
        """Return a grant for a batch that will not be generated, so the capacity stays exact (best effort:
        the loop may be ending because the buffer is unreachable)."""
        try:
            granted = int(admit.result())
            if granted:
                self.buffer.release(granted)
        except Exception as exc:
            log.warning("rollout worker %d could not release an unused admission: %s", self.index, exc)

    def stop(self) -> None:
        self.stop_event.set()

    def stats(self) -> dict:
        s = self.worker.stats()
        stalls = [x["stall_s"] for x in self.syncs]
        batches = s["batches"]
        s.update(
            {
                "index": self.index,
                "groups_pushed": self.groups_pushed,
                "syncs": len(self.syncs),
                "syncs_mid_batch": sum(1 for x in self.syncs if x.get("mid_batch")),
                "sync_stall_s_mean": sum(stalls) / len(stalls) if stalls else 0.0,
                "sync_stall_s_max": max(stalls) if stalls else 0.0,
                "batch_s_mean": s["busy_s"] / batches if batches else 0.0,
                "phase_s_per_batch": {k: v / batches if batches else 0.0 for k, v in self.phase_s.items()},
                "loop_running": self.loop_running,
                "busy_frac": busy_fraction(s["busy_s"], self.work_started),
            }
        )
        return s
