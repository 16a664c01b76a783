"""InProcessRun: the lockstep host in one thread (`run_sync`), driven by the one supervision loop
(`rlhf_core.run.supervise`) as the threads and Ray hosts are.

Its roles are the in-process run's (`rlhf_core.run.local.build_run`: the plain control objects as peers, the
engine over the trainer's own model unless the run was built with `share_weights=False`). Nothing runs between
polls: the supervision's `wait` is where one lockstep step happens (the rollout role generates while admission
lets it, the trainer role takes, trains, publishes and checkpoints when due), so every poll after the first sees
exactly one step, and the health checks, the audit, evaluations every eval.every steps and the checkpoints are
the supervision's, as on the other hosts. What is the same on every host (restore, the first weights, checkpoints,
prompt top-up, the buffer's knobs, the start evaluation and warm start) is `HostBase`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from rlhf_core.config import TrainConfig
from rlhf_core.hosts.base import HostBase
from rlhf_core.run.accounting import reconcile
from rlhf_core.run.checkpoint import CheckpointError, CheckpointState
from rlhf_core.run.checkpoint import checkpoint_dir as step_checkpoint_dir
from rlhf_core.run.control import assemble_poll
from rlhf_core.run.local import RunParts, build_run, export_run, lockstep_step
from rlhf_core.run.supervise import Sinks, supervise
from rlhf_core.run.warm_start import warm_start as run_warm_start


class InProcessRun(HostBase):
    """The run's roles in this thread, in lockstep; the control interface of `RunHost`. `parts`: an in-process
    run already built (`build_run`; the caller closes it), else the host builds one and closes it at teardown."""

    def __init__(self, cfg: TrainConfig, parts: Optional[RunParts] = None, checkpoint_root: Optional[Path] = None):
        self.cfg, self.parts, self.owns_parts = cfg, parts, parts is None
        self.checkpoint_root = checkpoint_root
        self.events: list[dict] = []
        self._new_events: list[dict] = []
        self.restarts = [0]  # nothing here is restarted
        self.last_step = self.last_version = 0
        self.failed: Optional[str] = None
        self.eval_start: Optional[float] = None
        self.run_facts: dict = {}
        self.restored: Optional[CheckpointState] = None
        self.restored_max_staleness: Optional[int] = None
        self._evaluations: list[dict] = []

    # ------------------------------------------------------------------ bring-up
    def launch(self, resume_from: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> dict:
        """Build the parts (unless given), restore `resume_from`, publish the first weights to the engine."""
        if self.parts is None:
            self.parts = build_run(self.cfg, share_weights=True)
        self.parts.trainer_role.checkpoint_root = self.checkpoint_root  # None: <run_dir>/checkpoints
        if resume_from:
            self.restored = self._restore(str(resume_from))
            if self.parts.trainer.step >= self.cfg.trainer.total_steps:
                raise CheckpointError(
                    f"{resume_from} holds step {self.parts.trainer.step}, which already reaches trainer.total_steps="
                    f"{self.cfg.trainer.total_steps}: nothing to train; raise trainer.total_steps to continue"
                )
        self._first_weights()
        self.parts.engine.version = self.parts.trainer.version
        return {"policy_dir": str(self.parts.policy_dir), "version": self.last_version, "step": self.last_step}

    # ------------------------------------------------------------------ the host's reach (HostBase)
    def _trainer(self, name: str, *args):
        return getattr(self.parts.trainer_role, name)(*args)

    def _queue(self, name: str, *args):
        return getattr(self.parts.prompts, name)(*args)

    def _buffer(self, name: str, *args):
        return getattr(self.parts.buffer, name)(*args)

    def _rollout_rng(self) -> list:
        return self.parts.peer_state()[1]

    def _set_rollout_rng(self, states: list) -> None:
        if states and states[0] is not None and hasattr(self.parts.engine, "generator"):
            self.parts.engine.generator.set_state(states[0])

    def _workers_adopt(self) -> None:
        self.parts.rollout_role.adopt_weights()

    # ------------------------------------------------------------------ loops: one lockstep step per wait
    def start(self) -> None:
        self.parts.trainer_role.run_facts = {"eval_start": self.eval_start, **self.run_facts}

    def wait(self, seconds: float) -> None:
        """One lockstep step (the supervision waits here between polls), unless the run is done."""
        if not self.done:
            lockstep_step(self.parts, stall_s=self.cfg.supervision.stall_timeout_s)
            self.last_step = self.parts.trainer.step

    def poll(self) -> dict:
        parts = self.parts
        wstats = [{**parts.rollout_role.stats(), "alive": True, "restarted": False, "restarts": 0}]
        tstats = {**parts.trainer_role.stats(), "eval_last": {}}
        metrics = parts.trainer_role.drain_metrics()
        return assemble_poll(self, metrics, tstats, parts.buffer.stats(), parts.prompts.stats(), wstats)

    def stop(self, grace_s: Optional[float] = None) -> None:
        """The loops end: the last step published nothing (no next step), so the engine gets the final weights
        here (for the final evaluation)."""
        self.parts.trainer_role.publish()
        self.parts.rollout_role.adopt_weights()

    def teardown(self, failed: bool = False) -> None:
        if self.owns_parts and self.parts is not None:
            self.parts.worker.close()
            self.parts.evaluator.close()
            self.parts = None

    # ------------------------------------------------------------------ supervision hooks
    def top_up_prompts(self, n: Optional[int] = None, target: Optional[int] = None) -> int:
        """Nothing to schedule ahead: in lockstep the rollout draws each batch's prompts when it generates (the
        same prompts in the same order; a checkpoint then holds no queued prompts)."""
        return 0

    def set_rollout_workers(self, n: int, reason: str = "") -> int:
        return 1  # one engine, in this thread

    def evaluate(self) -> dict:
        return self.parts.evaluator()

    def submit_evaluation(self) -> int:
        """In one thread an evaluation of the newest weights is simply run now."""
        version = self.parts.trainer.version
        self._evaluations.append({**self.evaluate(), "eval/version": version})
        return version

    def evaluations(self) -> list[dict]:
        out, self._evaluations = self._evaluations, []
        return out

    def warm_start(self, steps: int) -> dict:
        parts = self.parts
        metrics = run_warm_start(parts.model, parts.tokenizer, parts.train_prompts, self.cfg, steps)
        self._buffer("start_at", parts.trainer.version)
        return self._after_warm_start(metrics)

    def new_checkpoints(self) -> list[dict]:
        return self.parts.trainer_role.drain_checkpoints()

    def export(self, path: str | Path) -> str:
        return str(export_run(self.parts, path))

    def wait_loop(self, role: str, index: int = 0, attempt: int = 1, report=None):
        """No loop runs apart from the supervision: its final stats at once."""
        owner = self.parts.trainer_role if role == "trainer" else self.parts.rollout_role
        return owner.stats()

    reconcile = staticmethod(reconcile)


def run_sync(
    cfg: TrainConfig,
    resume_from: Optional[str] = None,
    on_step: Optional[Callable[[dict], None]] = None,
    parts: Optional[RunParts] = None,
    checkpoint_dir: Optional[str | Path] = None,
) -> dict:
    """Train in one process, in lockstep, for cfg.trainer.total_steps and return the final metrics: the
    in-process host (`InProcessRun`) under the one supervision loop (health checks, the run audit, evaluations
    every eval.every steps); at runtime.max_staleness 0 every host trains the same model.

    Returned keys include eval/accuracy_start (held-out accuracy before training; on resume, the value
    recorded at the start of the original run) and eval/accuracy (after training).
    """
    host = InProcessRun(
        cfg, parts or build_run(cfg, share_weights=True), Path(checkpoint_dir) if checkpoint_dir else None
    )
    host.owns_parts = parts is None
    with host:
        host.launch(resume_from)
        run_facts = dict(host.restored.run) if host.restored is not None else {}
        run_facts.pop("max_staleness", None)  # the bound is the buffer's (restored with the autopilot)
        run_facts.pop("ledger", None)  # the trainer role goes on from it (TrainerRole.ledger_carried)
        run_facts.update(host.begin(resumed=host.restored is not None))
        host.run_facts = {k: v for k, v in run_facts.items() if k != "eval/accuracy_start"}
        history, written, latest = host.parts.history, set(), []

        def evaluate(step: int) -> None:  # eval.every: into the metrics of the step it follows
            (latest[-1] if latest else {}).update(host.evaluate())

        def on_poll(poll: dict) -> None:
            latest.extend(poll["metrics"])
            history.extend(poll["metrics"])

        def on_tick(poll: dict) -> None:  # after the poll's evaluation
            for m in poll["metrics"]:
                if on_step:
                    on_step(m)

        sinks = Sinks(
            on_poll=on_poll,
            on_checkpoint=lambda c: written.add(c["step"]),
            evaluate=evaluate,
            on_tick=on_tick,
        )
        start = time.perf_counter()
        supervise(cfg, host, host.last_step, sinks)
        p = host.parts
        if p.trainer.step not in written:  # checkpoint.every=0 means "only at the end"
            host.checkpoint(
                step_checkpoint_dir(cfg.run.run_dir, p.trainer.step, under=host.checkpoint_root), host.run_facts
            )
        result = {k: v for k, v in run_facts.items() if k not in ("eval_start", "eval/accuracy_start")}
        result["eval/accuracy_start"] = host.eval_start
        result.update(history[-1] if history else {})
        result.update(host.evaluate())
        result["time/train_wall_s"] = time.perf_counter() - start
        result["steps"] = p.trainer.step
        return result
