"""Watching the runtime's long-running loops: the trainer's and each rollout worker's (a mixin of
`DistributedRun`): wait for one to end (a Prefect task run spans it), and restart the loop of a rollout worker
Ray restarted, reporting each death and restart as a runtime event. The restart budget is
cluster.max_restarts, enforced by the supervision."""

from __future__ import annotations

import time
from typing import Optional

import ray

from rlhf_core.distributed.calls import task_error
from rlhf_core.distributed.cluster import rollout_worker_resources
from rlhf_core.run.control import RunFailed, WorkerDied

WAITING_EVENT_S = 10.0  # a worker not back after this long is reported as waiting for room
# a pending start's state (a worker's `error` in the poll while it lasts) -> what its event says once it is up
ARRIVED = {"restarting": "restarted", "starting": "started"}


class LoopWatch:
    """What DistributedRun does about its loops. Uses its trainer, workers, handle, timeout, restarts,
    worker_loops, worker_loop_starts, trainer_loop, stopping, failed, _event and recover_prompts (Fleet)."""

    # worker index -> (since when, "restarting" | "starting"): a worker Ray is bringing back, or a new one starting
    pending_starts: dict[int, tuple[float, str]]
    restart_pings: dict[int, object]
    waiting_reported: set[int]

    def _loop_polls(self, role: str, index: int, attempt: int, what: str):
        """HostBase.wait_loop's waiting on Ray: a loop not started yet (or not restarted yet by Ray) is waited for
        until the supervision starts it; raises WorkerDied when a rollout worker's process died."""
        while self.handle is not None and not (self.stopping and self._loop_ref(role, index, attempt) is None):
            ref = self._loop_ref(role, index, attempt)
            if ref is None:  # not started yet (or not restarted yet)
                time.sleep(1.0)
                continue
            try:
                if ray.wait([ref], timeout=1.0)[0]:
                    return ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                raise RunFailed(f"{what} failed: {task_error(exc)}") from exc
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                if self.stopping or self.handle is None:  # killed by the teardown
                    return {}
                if role == "trainer":
                    raise RunFailed(f"the trainer actor died ({type(exc).__name__})") from exc
                raise WorkerDied(f"{what} died ({type(exc).__name__}); Ray restarts it") from exc
            except Exception:  # Ray shut down under us: the teardown
                if self.handle is None:
                    return {}
                raise
            yield
        return {}

    def _loop_stats(self, role: str, index: int) -> Optional[dict]:
        try:
            actor = self.trainer if role == "trainer" else self.workers[index]
            return ray.get(actor.stats.remote(), timeout=10)
        except Exception:  # a worker restarting does not answer: the next report will
            return None

    def _loop_ref(self, role: str, index: int, attempt: int):
        if role == "trainer":
            return self.trainer_loop
        starts = self.worker_loop_starts.get(index, [])
        return starts[attempt - 1] if len(starts) >= attempt else None

    def _check_worker_loops(self) -> None:
        """A worker whose loop ended with its process (or node) dead: count the restart, give its in-flight prompts
        back to the queue, and wait for Ray to bring it back (without blocking the poll: where the cluster has no
        room for it, the wait is an event and the supervision's outage limit, supervision.stall_timeout_s,
        decides); once back, start its loop again."""
        for i, ref in list(self.worker_loops.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                ray.get(ref)
                continue  # the loop ended normally (stop)
            except ray.exceptions.RayTaskError as exc:  # the loop raised (e.g. a reward function kept failing)
                self.failed = f"rollout worker {i} failed: {task_error(exc)}"
                raise RunFailed(self.failed) from exc
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.restarts[i] += 1
                self._event(
                    "rollout_worker_died",
                    f"rollout worker {i} died ({type(exc).__name__}); restart "
                    f"{sum(self.restarts)} in the run (budget cluster.max_restarts={self.cfg.cluster.max_restarts}, "
                    "the supervision's to enforce)",
                )
            del self.worker_loops[i]
            self.recover_prompts(i)
            self.pending_starts[i] = (time.monotonic(), "restarting")
        for i, (since, state) in list(self.pending_starts.items()):
            info = self._restarted(i)
            if info is None:
                if i not in self.waiting_reported and time.monotonic() - since > WAITING_EVENT_S:
                    self.waiting_reported.add(i)
                    self._event(
                        "rollout_worker_waiting",
                        f"rollout worker {i} is not up after {time.monotonic() - since:.0f} s: Ray places it once "
                        f"a node has {rollout_worker_resources(self.cfg)} free (add a node, or it fails the run "
                        f"after supervision.stall_timeout_s={self.cfg.supervision.stall_timeout_s:g})",
                    )
                continue
            del self.pending_starts[i]
            self.waiting_reported.discard(i)
            kind = ARRIVED[state]
            self._event(
                f"rollout_worker_{kind}",
                f"rollout worker {i} {kind} after {time.monotonic() - since:.1f} s "
                f"(reconstructed={info['restarted']}); it loads the newest weights",
            )
            self.worker_loops[i] = self.workers[i].run_loop.remote()
            self.worker_loop_starts.setdefault(i, []).append(self.worker_loops[i])

    def _restarted(self, i: int) -> Optional[dict]:
        """Worker i's ping answer once Ray brought it back; None while it is restarting (or waiting for room).
        A worker Ray gave up on (its restarts spent) fails the run."""
        ref = self.restart_pings.get(i)
        if ref is None:
            ref = self.restart_pings[i] = self.workers[i].ping.remote()
        if not ray.wait([ref], timeout=0)[0]:
            return None
        del self.restart_pings[i]
        try:
            return ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            return None  # asked while restarting: ask again at the next poll
        except ray.exceptions.RayActorError as exc:
            self.failed = f"rollout worker {i} did not come back: {exc}"
            raise RunFailed(self.failed) from exc
