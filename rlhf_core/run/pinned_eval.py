"""Held-out evaluation pinned to a version, off the critical path: the periodic evaluation (eval.every) of a run.

The evaluation runs on a thread of its own, over a policy copy of its own, on a snapshot of exactly the version V
it was asked for (the weights the trainer published as version V: what the rollout workers load), so neither the
trainer (no lock held while it generates) nor the rollout fleet waits for it; its metrics come back with
`eval/version` = V and the supervision logs them at step V. It lives where the trainer lives (the threads host's
process; the trainer actor on Ray), beside the snapshots it evaluates.

A slow evaluation queues at most one version: a request while one runs and another waits replaces the waiting one
(the newest wins) and the skipped version is counted (`eval/skipped_versions`) and named in the next result
(`skipped`). An evaluation that raises is a result with its error, not the run's end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

log = logging.getLogger("rlhf_core.run")


class PinnedEvaluation:
    """`submit(version, weights)` queues an evaluation of those weights; `drain()` returns the finished ones.

    `build()` makes the evaluator (rlhf_core.run.evaluation.Evaluator, or an agent's) over a policy copy of its
    own; it runs on the evaluation thread at the first request, so a run that never evaluates pays nothing."""

    def __init__(self, build: Callable[[], object]):
        self.build = build
        self.evaluator = None
        self.cond = threading.Condition()
        self.pending: Optional[tuple[int, dict]] = None
        self.running: Optional[int] = None
        self.results: list[dict] = []
        self.skipped: list[int] = []  # versions replaced while waiting, not yet named in a result
        self.skipped_total = 0
        self.last: Optional[dict] = None  # the newest evaluation that succeeded (the run audit reads its keys)
        self.closed = False
        self.thread: Optional[threading.Thread] = None

    def submit(self, version: int, weights: Optional[dict]) -> None:
        """Evaluate `weights` (a published snapshot, its probe taken off; None: the evaluator's current weights) as
        version `version`, after the one running; a version still waiting is replaced (and counted skipped)."""
        with self.cond:
            if self.closed:
                return
            if self.pending is not None:
                self.skipped.append(self.pending[0])
                self.skipped_total += 1
            self.pending = (int(version), weights)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="atrlhf-eval", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.pending is None and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                (version, weights), self.pending = self.pending, None
                self.running = version
                skipped, self.skipped = self.skipped, []
            start = time.perf_counter()
            try:
                if self.evaluator is None:
                    self.evaluator = self.build()
                if weights is not None:
                    self.evaluator.engine.load_weights(weights, version)
                result = dict(self.evaluator())
            except Exception as exc:  # the evaluation's failure is its result's, not the run's
                log.warning("held-out evaluation of version %d failed: %s: %s", version, type(exc).__name__, exc)
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result.update({"eval/version": version, "eval/duration_s": time.perf_counter() - start})
            result["skipped"] = skipped
            with self.cond:
                self.results.append(result)
                self.last = result if "error" not in result else self.last
                self.running = None
                self.cond.notify_all()

    def drain(self) -> list[dict]:
        """The evaluations finished since the last call, oldest first (each with eval/version)."""
        with self.cond:
            out, self.results = self.results, []
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is running or waiting (at most timeout_s); True when idle."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.pending is not None or self.running is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.thread is None:
                    return self.pending is None and self.running is None
                self.cond.wait(remaining)
        return True

    def stats(self) -> dict:
        with self.cond:
            return {"eval_running": self.running, "eval_pending": self.pending[0] if self.pending else None,
                    "eval_skipped_versions": self.skipped_total, "eval_last": self.last}  # fmt: skip

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (an evaluation under way is left to finish, at most timeout_s) and the evaluator."""
        with self.cond:
            self.closed = True
            self.pending = None
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout_s)
        if self.evaluator is not None and hasattr(self.evaluator, "close"):
            self.evaluator.close()
        if getattr(self.evaluator, "env", None) is not None:
            self.evaluator.env.close()


def evaluation_evidence(result: dict) -> dict:
    """An evaluation's eval/* figures alone (no traces, no trajectories): what the trainer's stats carry for the
    run audit's eval_metric check."""
    return {k: v for k, v in result.items() if k.startswith("eval/") and isinstance(v, (int, float))}


def pinned_evaluation(cfg, policy_dir, heldout: list) -> PinnedEvaluation:
    """The run's pinned evaluation: an evaluator (rlhf_core.run.build.build_evaluator) over a policy of its own,
    loaded from `policy_dir` as a rollout worker's is (every request then loads the version it names)."""
    from rlhf_core.run import build

    def make():
        model, tokenizer = build.build_policy(cfg, policy_dir)
        return build.build_evaluator(cfg, model, tokenizer, policy_dir, heldout)

    return PinnedEvaluation(make)


class EvaluationHost:
    """What a host of the trainer role adds for pinned evaluations: `self.pinned` (a PinnedEvaluation) and the
    trainer role under the attribute `role_attr` names (the trainer actor's `role`, the threads host's
    `trainer_role`)."""

    role_attr = "role"
    pinned: Optional[PinnedEvaluation] = None
    last_evaluation: Optional[dict] = None  # the newest synchronous evaluation (`evaluate`: at start and end)

    def submit_evaluation(self) -> int:
        """Queue a held-out evaluation of the newest weights the trainer published, on the evaluation thread: the
        trainer goes on. Returns their version; the metrics come from `evaluations()` when done."""
        version, weights = getattr(self, self.role_attr).published_weights()
        self.pinned.submit(version, weights)
        return version

    def evaluations(self) -> list[dict]:
        """The pinned evaluations finished since the last call (each with eval/version)."""
        return self.pinned.drain() if self.pinned is not None else []

    def evaluation_stats(self) -> dict:
        """For the trainer's stats: the pinned evaluation's state (running, waiting, skipped) and `eval_last`, the
        newest evaluation's metrics (pinned, else the synchronous one), which the run audit reads."""
        out = self.pinned.stats() if self.pinned is not None else {}
        out["eval_last"] = evaluation_evidence(out.get("eval_last") or self.last_evaluation or {})
        return out

    def close(self) -> None:
        """Before the host goes (the Ray host calls it before killing the actor): the evaluation thread and what its
        evaluator started."""
        if self.pinned is not None:
            self.pinned.close()
