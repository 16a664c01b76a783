"""The rollout fleet of a Ray run (a mixin of `DistributedRun`): start a worker, retire one, and give back the
prompts of a worker that was lost.

Every rollout worker incarnation leases its prompts from the queue batch by batch and names itself on every
push (`rlhf_core.data.queue.PromptQueue`, `rlhf_core.run.control.ExperienceBuffer.revoke`). When one is lost
(its process or its node died) or retired (the fleet shrinks), the runtime revokes it at the buffer, which
refuses anything it still pushes and frees the admission it held, and requeues the prompts of every batch the
buffer did not accept from it: they are generated again by another worker, never scored as failures and never
trained twice. `rollout/requeued_prompts` counts them; `reconcile` counts a revoked worker's groups by what the
buffer accepted from it.

The number of workers has one owner at a time: `atrlhf scale` (a request the supervision reads from the run
directory, `rlhf_core.run.requests`) or, with cluster.autoscale.enabled, the autoscaler
(`rlhf_core.autoscale`); the supervision applies either through `set_rollout_workers`.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import ray

from rlhf_core.distributed.calls import remote
from rlhf_core.distributed.cluster import rollout_worker_resources, room_for
from rlhf_core.distributed.rollout_actor import RolloutActor

log = logging.getLogger("rlhf_core.distributed")

RETIRE_WAIT_S = 30.0  # how long a retiring worker may take to finish and push its batch before it is killed


class Fleet:
    """What DistributedRun does about its rollout workers. Uses its cfg, queue, buffer, trainer, workers,
    restarts, worker_loops, worker_loop_starts, pending_starts, handle, peers, started, timeout and _event."""

    requeued_prompts = 0
    retired_restarts = 0  # restarts of workers since retired (the restart budget counts every worker's)

    def _new_worker(self, index: int, placement: Optional[dict] = None):
        """A rollout worker actor (not started): its own process, restarted by Ray where it can be placed."""
        c = self.cfg.cluster
        options = dict(
            **c.actor_options("rollout"),
            max_concurrency=4,
            max_restarts=c.max_restarts,
            max_task_retries=0,
            **(placement or {}),
        )
        return remote(RolloutActor, **options).remote(self.cfg, self.policy_dir, index, self.peers)

    def room_for_worker(self) -> bool:
        """Whether the cluster has the free resources of one more rollout worker now."""
        try:
            return room_for(rollout_worker_resources(self.cfg), ray.available_resources())
        except Exception:  # Ray unreachable: the poll says so elsewhere
            return False

    def recover_prompts(self, index: int) -> int:
        """Worker `index` was lost or retired: revoke each of its incarnations that holds a lease and requeue the
        prompts the buffer did not accept from them. Returns how many prompts went back to the queue."""
        back = 0
        leased = self._get(self.queue.holders.remote(f"{index}-"), "the prompt queue's leases")
        admitted = self._get(self.buffer.holder_names.remote(f"{index}-"), "the replay buffer's workers")
        for holder in sorted(set(leased) | set(admitted)):  # one admitted but dead before its first prompts too
            self._get(self.buffer.revoke.remote(holder), "the replay buffer to revoke a lost worker")
            low, above = self._get(self.buffer.settled_leases.remote(holder), "the replay buffer's leases")
            back += self._get(self.queue.requeue.remote(holder, low, above), "the prompt queue to requeue prompts")
        if back:
            self.requeued_prompts += back
            self._event(
                "prompts_requeued",
                f"rollout worker {index}: {back} prompt(s) it held in flight went back to the queue "
                "(generated again; nothing it did not deliver is scored or trained)",
            )
        return back

    def set_rollout_workers(self, n: int, reason: str = "") -> int:
        """Grow or shrink the fleet to n workers (at least 1), without waiting for anything to start: a new worker
        starts its loop (which loads the newest weights first) once Ray has it up; a retired one (the newest
        first) finishes the batch in hand, pushes it and is removed. A worker is added only where the cluster has
        room for it now (the fleet grows as far as it can, and the event says so). Returns the new size."""
        n = max(1, int(n))
        before = len(self.workers)
        while len(self.workers) < n and self.room_for_worker():
            self._add_worker()
        while len(self.workers) > n:
            self._retire_worker()
        after = len(self.workers)
        if after != before:
            self._refresh_checkpointing()
            self._event(
                "rollout_workers_changed", f"rollout workers {before} -> {after}" + (f" ({reason})" if reason else "")
            )
        if after < n:
            need = rollout_worker_resources(self.cfg)
            self._event(
                "rollout_workers_short",
                f"{n} rollout worker(s) asked for, {after} running: the cluster has no room for another ({need} each)",
            )
        return after

    def _add_worker(self) -> None:
        i = len(self.workers)
        worker = self._new_worker(i)
        self.workers.append(worker)
        self.handle.actors.append(worker)
        if len(self.restarts) <= i:
            self.restarts.append(0)
        if self.started:  # its loop starts once it answers (loops.py: pending starts)
            self.pending_starts[i] = (time.monotonic(), "starting")

    def _retire_worker(self) -> None:
        i = len(self.workers) - 1
        worker = self.workers[i]
        loop = self.worker_loops.pop(i, None)
        try:
            worker.stop.remote()
            if loop is not None:
                ray.wait([loop], timeout=RETIRE_WAIT_S)
        except Exception:  # a worker already gone: its prompts are recovered below either way
            pass
        self.workers.pop()
        self.retired_restarts += self.restarts[i]
        self.restarts[i] = 0
        self.worker_loop_starts.pop(i, None)
        self.pending_starts.pop(i, None)
        self.restart_pings.pop(i, None)
        self._kill(worker)
        self.recover_prompts(i)

    def _kill(self, actor) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
        if actor in self.handle.actors:
            self.handle.actors.remove(actor)

    def _refresh_checkpointing(self) -> None:
        """The trainer's checkpoints ask every current worker for its sampling RNG state."""
        if self.started:
            facts = {"eval_start": self.eval_start, **self.run_facts}
            self._get(
                self.trainer.set_checkpointing.remote(self.queue, self.workers, facts), "the trainer's checkpointing"
            )

    def fleet_stats(self) -> dict:
        """The fleet at a poll. Whether the cluster has room for another worker is asked of Ray (a round trip to
        its control store) only where the autoscaler reads it."""
        autoscale = self.cfg.cluster.autoscale.enabled
        return {
            "rollout_workers": len(self.workers),
            "room_for_worker": self.room_for_worker() if autoscale else None,
            "requeued_prompts": self.requeued_prompts,
            "restarts_total": sum(self.restarts) + self.retired_restarts,
            "starting": sorted(self.pending_starts),
        }
