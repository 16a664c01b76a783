"""What every host is: `DistributedRun` (Ray actors, ray_cluster.py), `ThreadedRun` (threads of this process,
threads.py) and `InProcessRun` (this thread, in lockstep: run_sync, in_process.py).

`RunHost` declares the control interface they implement: what the one supervision loop (`rlhf_core.run.supervise`),
the Prefect flow and `run_distributed` call. `HostBase` writes once what is the same on every host (restore from a
checkpoint, the first weights, the start evaluation and warm start, the warm start's hand-over, a checkpoint's
gathering, prompt top-up, the buffer's knobs, the weights publish, `wait_loop`); a host supplies how it reaches its
roles (`_trainer`, `_queue`, `_buffer`: a direct call in this process, a remote call on Ray) and its rollout workers
(`_rollout_rng`, `_set_rollout_rng`, `_workers_adopt`). `rlhf_core.hosts.make_runtime` picks the host cluster.host
names (the in-process host is run_sync's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

from rlhf_core.config import TrainConfig
from rlhf_core.run.checkpoint import CheckpointState

log = logging.getLogger("rlhf_core.run")


@dataclass(frozen=True)
class LoopReport:
    """What `wait_loop` reports while it waits: the role's stats to `fn`, every `every_s` seconds."""

    fn: Callable[[dict], None]
    every_s: float = 30.0


@runtime_checkable
class RunHost(Protocol):
    """The control interface of a run's host. Attributes the supervision reads: `cfg`, `last_step`,
    `last_version`, `done`, `failed`, `events`, `restarts`, `restored_max_staleness` (a resumed autopilot's
    bound), `eval_start`, `run_facts` (what every checkpoint records)."""

    def launch(self, resume_from: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> dict:
        """Build or start every role, restore `resume_from`, load the first weights into every rollout engine."""

    def start(self) -> None:
        """Start the trainer's and every rollout worker's loop (non-blocking)."""

    def wait(self, seconds: float) -> None:
        """Between polls: at most `seconds`, waking when the trainer's loop ends."""

    def poll(self) -> dict:
        """Every role's stats plus the trainer metrics produced since the last poll (raises RunFailed)."""

    def top_up_prompts(self, n: Optional[int] = None, target: Optional[int] = None) -> int:
        """Fill the prompt queue up to `target` (at most `n` more); returns how many were queued."""

    def request_sync(self) -> float:
        """Publish the trainer's weights now; rollout workers adopt them between batches."""

    def throttle(self, paused: bool) -> None:
        """Pause or resume the buffer's admission of new rollout batches."""

    def set_max_staleness(self, bound: int) -> int:
        """Move the staleness bound (the autopilot); returns the bound in force."""

    def set_rollout_workers(self, n: int, reason: str = "") -> int:
        """Resize the rollout fleet (the autoscaler); returns its size (a host that cannot: the size it has)."""

    def evaluate(self) -> dict:
        """Held-out evaluation with the trainer's current weights."""

    def submit_evaluation(self) -> int:
        """A pinned evaluation of the newest published version, off the critical path; returns the version."""

    def evaluations(self) -> list[dict]:
        """The pinned evaluations finished since the last call."""

    def begin(self, resumed: bool) -> dict:
        """The start evaluation (resumed: the lineage's), then the warm start; their metrics."""

    def checkpoint(self, path: str | Path, run: Optional[dict] = None) -> str:
        """A full resumable checkpoint (rlhf_core.run.checkpoint's one layout) with the run facts `run`."""

    def warm_start(self, steps: int) -> dict:
        """The supervised format warm start, then its weights in every rollout engine."""

    def new_checkpoints(self) -> list[dict]:
        """Checkpoints the trainer wrote at multiples of checkpoint.every since the last call."""

    def export(self, path: str | Path) -> str:
        """The trained policy for use outside training."""

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Stop the loops and wait for them to return (at most `grace_s`)."""

    def teardown(self, failed: bool = False) -> None:
        """Idempotent: stop the loops and release everything the host started."""

    def reconcile(self, poll: dict) -> dict:
        """The accounting of groups, samples and tokens from a poll (rlhf_core.run.accounting)."""

    def wait_loop(self, role: str, index: int = 0, attempt: int = 1, report: Optional[LoopReport] = None) -> dict:
        """Block until one loop ends ("trainer", or "rollout" worker `index`, its `attempt`-th loop): the Prefect
        task run that spans it waits here. Returns its final stats; raises RunFailed with its error."""


class HostBase:
    """What every host does the same way, over the host's reach into its roles (see the module docstring)."""

    cfg: TrainConfig
    eval_start: Optional[float]
    restored_max_staleness: Optional[int]
    last_step: int
    last_version: int

    # ------------------------------------------------------------------ the host's reach (each host defines)
    def _trainer(self, name: str, *args):
        """The trainer role's `name(*args)` (TrainerRole in this process, the trainer actor on Ray)."""
        raise NotImplementedError

    def _queue(self, name: str, *args):
        raise NotImplementedError

    def _buffer(self, name: str, *args):
        raise NotImplementedError

    def _rollout_rng(self) -> list:
        """Every rollout engine's sampling RNG state (None for one the host could not reach)."""
        raise NotImplementedError

    def _set_rollout_rng(self, states: list) -> None:
        """Restore the rollout engines' RNG from a checkpoint's states (None: leave that engine as it is)."""
        raise NotImplementedError

    def _workers_adopt(self) -> None:
        """Every rollout worker loads the newest published weights now (before the loops start)."""
        raise NotImplementedError

    def _event(self, kind: str, detail: str) -> None:
        ev = {"time": time.time(), "kind": kind, "detail": detail}
        self.events.append(ev)
        self._new_events.append(ev)
        log.warning("%s: %s", kind, detail)

    def _loop_polls(self, role: str, index: int, attempt: int, what: str):
        """`wait_loop`'s waiting, a generator: it yields after each wait of about a second on a loop that runs (a
        moment to report) and returns the loop's final stats; raises RunFailed naming `what` with its error."""
        raise NotImplementedError

    def _loop_stats(self, role: str, index: int) -> Optional[dict]:
        """The stats of the role a loop runs in, for `wait_loop`'s reports (None: no answer this time)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ written once
    def wait_loop(self, role: str, index: int = 0, attempt: int = 1, report: Optional[LoopReport] = None) -> dict:
        """Block until one loop ends (async mode; for whoever watches it, e.g. a Prefect task that spans it).

        role "trainer", or "rollout" with the worker's `index` and `attempt` (1 for its first loop, n for the loop
        a restart of it runs, waited for until the supervision starts it). Returns the loop's final stats (empty
        when the run ended before the loop started); raises RunFailed with the loop's error when it raised (on
        Ray, WorkerDied when a rollout worker's process died). `report`: the role's stats to `report.fn` every
        `report.every_s`. The host supplies the waiting (`_loop_polls`) and the stats (`_loop_stats`)."""
        what = "the trainer" if role == "trainer" else f"rollout worker {index}"
        polls = self._loop_polls(role, index, attempt, what)
        next_report = time.monotonic() + (report.every_s if report is not None else 0.0)
        while True:
            try:
                next(polls)
            except StopIteration as end:
                return end.value
            if report is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + report.every_s
                stats = self._loop_stats(role, index)
                if stats is not None:
                    report.fn(stats)

    def _restore(self, path: str) -> CheckpointState:
        """Trainer state first (it validates the whole checkpoint), then the prompt queue's position (and the record
        of prompts trained on), the rollout engines' RNG (those the checkpoint has states for: one from the loop or
        a smaller fleet seeds the workers it covers, the others keep their own seeds), the start evaluation, and a
        resumed autopilot's bound (without the autopilot the configured bound is the bound)."""
        state: CheckpointState = self._trainer("restore", path)
        self._trainer("set_trained", self._queue("load_state_dict", state.data))
        self._set_rollout_rng(list(state.rng.get("rollout", [])))
        self.eval_start = state.run.get("eval_start")
        if state.resumed_bound(self.cfg) is not None:
            self.restored_max_staleness = self.set_max_staleness(state.resumed_bound(self.cfg))
        return state

    def _first_weights(self) -> None:
        """After the build (and a restore): admission counts from the trainer's version, its weights are published
        and every rollout engine loads them; last_step / last_version as the trainer has them."""
        stats = self._trainer("stats")
        self._buffer("start_at", stats["version"])
        self.request_sync()
        self._workers_adopt()
        self.last_step, self.last_version = stats["step"], stats["version"]

    def _after_warm_start(self, metrics: dict) -> dict:
        """The warm start's weights in every rollout engine before the loops start, and the evaluation after it."""
        self.request_sync()
        self._workers_adopt()
        return {**metrics, "eval/accuracy_warm_start": self.evaluate()["eval/accuracy"]}

    def begin(self, resumed: bool) -> dict:
        """What every driver does before the loops start: the held-out evaluation before training (`resumed`: the
        lineage's, restored from the checkpoint), then the warm start (not on resume). Returns eval/accuracy_start
        and the warm start's metrics (warm_start/*, eval/accuracy_warm_start)."""
        if not resumed:
            self.eval_start = self.evaluate()["eval/accuracy"]
        out = {"eval/accuracy_start": self.eval_start}
        if self.cfg.trainer.warm_start.steps and not resumed:
            out.update(self.warm_start(self.cfg.trainer.warm_start.steps))
        return out

    def checkpoint(self, path: str | Path, run: Optional[dict] = None) -> str:
        """A full resumable checkpoint (rlhf_core.run.checkpoint's one layout): the trainer's state, the prompt
        queue's position, every rollout engine's RNG, and the run facts (`run`, plus eval_start). An engine the
        host could not reach (a worker Ray is restarting) is left out, and the checkpoint says so."""
        data, rollout_rng = self._queue("state_dict"), self._rollout_rng()
        facts = {"eval_start": self.eval_start, **(run or {})}
        missing = [i for i, s in enumerate(rollout_rng) if s is None]
        if missing:
            facts["rollout_rng_missing"] = missing
            self._event(
                "checkpoint_partial",
                f"rollout worker(s) {missing} were restarting: their sampling RNG is "
                "not in this checkpoint (a resume seeds them afresh)",
            )
        return self._trainer("checkpoint", str(path), data, rollout_rng, facts)

    def top_up_prompts(self, n: Optional[int] = None, target: Optional[int] = None) -> int:
        """Schedule prompts with backpressure: fill the queue up to `target` (default two trainer steps)."""
        target = target or 2 * self.cfg.trainer.prompts_per_step
        queued = self._queue("size")
        want = max(0, target - queued) if n is None else min(n, max(0, target - queued))
        return self._queue("top_up", want) if want else 0

    def request_sync(self) -> float:
        """Publish the trainer's weights now (rollout workers adopt them between batches)."""
        return self._trainer("publish")

    def throttle(self, paused: bool) -> None:
        self._buffer("set_paused", paused)

    def set_max_staleness(self, bound: int) -> int:
        """Move the staleness bound at runtime (the autopilot), within runtime.autopilot's range; returns it."""
        return self._buffer("set_max_staleness", bound)

    @property
    def done(self) -> bool:
        return self.last_step >= self.cfg.trainer.total_steps

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.teardown(failed=exc_type is not None)
