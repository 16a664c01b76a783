"""Watching the runtime's long-running loops: the trainer's and each rollout worker's (a mixin of
`DistributedRun`): wait for one to end (a Prefect task run spans it), and restart the loop of a rollout worker
Ray restarted, reporting each death and restart as a runtime event. The restart budget is
cluster.max_restarts, enforced by the supervision."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

import ray

from rlhf_core.distributed.calls import RunFailed, WorkerDied, task_error


class LoopWatch:
    """What DistributedRun does about its loops. Uses its trainer, workers, handle, timeout, restarts,
    worker_loops, worker_loop_starts, trainer_loop, stopping, failed and _event."""

    def wait_loop(
        self,
        role: str,
        index: int = 0,
        attempt: int = 1,
        report: Optional[Callable[[dict], None]] = None,
        report_every_s: float = 30.0,
    ) -> dict:
        """Block until one loop ends (async mode; for whoever watches it, e.g. a Prefect task that spans it).

        role "trainer", or "rollout" with the worker's `index` and `attempt` (1 for its first loop, n for the loop
        Ray's (n-1)-th restart of it runs, waited for until the supervision starts it). Returns the loop's final
        stats (empty when the run ended before the loop started); raises RunFailed with the loop's error when
        it raised, WorkerDied when a rollout worker's process died. `report(stats)` gets the actor's stats
        every `report_every_s`."""
        actor = self.trainer if role == "trainer" else self.workers[index]
        what = "the trainer" if role == "trainer" else f"rollout worker {index}"
        next_report = time.monotonic() + report_every_s
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
            if report is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + report_every_s
                try:
                    report(ray.get(actor.stats.remote(), timeout=10))
                except Exception:  # a worker restarting does not answer: the next report will
                    pass
        return {}

    def _loop_ref(self, role: str, index: int, attempt: int):
        if role == "trainer":
            return self.trainer_loop
        starts = self.worker_loop_starts.get(index, [])
        return starts[attempt - 1] if len(starts) >= attempt else None

    def _check_worker_loops(self) -> None:
        """Restart the loop of a worker that Ray restarted; count and report the event."""
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
            info = self._wait_restarted(i)
            self._event(
                "rollout_worker_restarted",
                f"rollout worker {i} restarted (reconstructed={info['restarted']}) and reloads the newest weights",
            )
            self.worker_loops[i] = self.workers[i].run_loop.remote()
            self.worker_loop_starts.setdefault(i, []).append(self.worker_loops[i])

    def _wait_restarted(self, i: int) -> dict:
        """Wait (bounded by runtime.wait_timeout_s) for Ray to bring worker i back; it is 'unavailable' meanwhile."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return ray.get(self.workers[i].ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                raise RunFailed(f"rollout worker {i} did not come back: {exc}") from exc
        raise RunFailed(f"rollout worker {i} did not come back within {self.timeout:g} s (runtime.wait_timeout_s)")
