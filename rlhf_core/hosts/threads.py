"""ThreadedRun: the in-process asynchronous host (cluster.host: threads). The trainer role's loop runs on one
thread and each rollout role's loop on another, in this process, with the plain control objects as their peers
(`ExperienceBuffer`, `WeightStore`, `PromptQueue`: thread-safe, called directly). Nothing is packed or copied
between the roles: groups reach the trainer as the rollout made them, and a publish is the trainer's CPU
snapshot (`Trainer.state_dict_for_sync`, taken under the trainer's lock: its optimizer updates the parameters in
place), handed to the rollout engines by reference and copied once into each engine's own model.

Its public interface is `rlhf_core.hosts.base.RunHost`, as `DistributedRun`'s is, and what is the same on both hosts
is written once in `HostBase` (restore, the first weights, checkpoints, prompt top-up, the buffer's knobs), so the
one supervision loop (`rlhf_core.run.supervise`), the Prefect flow and
`run_distributed` drive either host; `rlhf_core.hosts.make_runtime` picks one by cluster.host. The roles'
cycles, the staleness bound (the buffer's), checkpoints (the trainer role's writer and reader: either host
resumes the other's), metric names and the accounting (`reconcile`) are the same objects as on Ray.

Threads share the interpreter: torch kernels run without the GIL, each role's thread sets its own
cluster.torch_threads intra-op threads, and waits (an environment's step, a reward process) cost no CPU. A role
that raises ends its loop; the next poll raises RunFailed naming it. Threads are not restarted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.config import TrainConfig
from rlhf_core.data.queue import PromptQueue, queue_options
from rlhf_core.hosts.base import HostBase
from rlhf_core.run import build
from rlhf_core.run.accounting import reconcile
from rlhf_core.run.checkpoint import read_checkpoint
from rlhf_core.run.control import ExperienceBuffer, RunFailed, assemble_poll, buffer_options
from rlhf_core.run.peers import LocalPeer, LocalWeights
from rlhf_core.run.pinned_eval import EvaluationHost, pinned_evaluation
from rlhf_core.run.preflight import check_lengths, check_output_dir
from rlhf_core.run.roles import RolloutRole, TrainerRole
from rlhf_core.run.supervise import FAILED_GRACE_S, stop_grace

log = logging.getLogger("rlhf_core.run")


@contextmanager
def torch_threads(n: int):
    """torch intra-op threads of the calling thread for the block (OpenMP's count is per calling thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SharedWeights(LocalWeights):
    """The weight store shared by the trainer's publish thread and the rollout threads: the version and its
    state dict change together (one lock); a fetch returns the published dict itself, never a copy."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def publish(self, version: int, state_dict: Optional[dict]) -> None:
        with self.lock:
            super().publish(version, state_dict)

    def fetch_if_newer(self, version: int):
        with self.lock:
            return super().fetch_if_newer(version)

    poll_newer = fetch_if_newer  # partial rollouts: a version comparison under a lock, nothing to wait for


class RoleThread(threading.Thread):
    """One role's loop on its own thread with its own torch intra-op threads; keeps the loop's result or error."""

    def __init__(self, name: str, loop: Callable[[], dict], threads: int):
        super().__init__(name=name, daemon=True)
        self.loop, self.threads = loop, threads
        self.result: Optional[dict] = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        torch.set_num_threads(self.threads)
        try:
            self.result = self.loop()
        except BaseException as exc:  # reported by poll() and wait_loop() as RunFailed
            log.exception("%s failed", self.name)
            self.error = exc

    def failure(self) -> Optional[str]:
        return None if self.error is None else f"{type(self.error).__name__}: {self.error}"


class ThreadedRun(EvaluationHost, HostBase):
    """The run's roles on threads of this process; the same control interface as `DistributedRun`."""

    role_attr = "trainer_role"

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.buffer: Optional[ExperienceBuffer] = None
        self.queue: Optional[PromptQueue] = None
        self.store: Optional[SharedWeights] = None
        self.trainer_role: Optional[TrainerRole] = None
        self.rollout_roles: list[RolloutRole] = []
        self.evaluator = None
        self.pinned = None
        self.model = self.tokenizer = None
        self.train_prompts: list = []
        self.trainer_loop: Optional[RoleThread] = None
        self.worker_loops: dict[int, RoleThread] = {}
        self.restarts = [0] * cfg.rollout.num_workers  # threads are not restarted: the budget is never spent
        self.events: list[dict] = []
        self._new_events: list[dict] = []
        self.last_step = 0
        self.last_version = 0
        self.started = False
        self.stopping = False
        self.launched = False
        self.failed: Optional[str] = None
        self.timeout = cfg.runtime.wait_timeout_s
        self.threads = cfg.cluster.torch_threads
        self.policy_dir: Optional[str] = None
        self.eval_start: Optional[float] = None
        self.run_facts: dict = {}
        self.restored_max_staleness: Optional[int] = None

    # ------------------------------------------------------------------ bring-up
    def launch(self, resume_from: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> dict:
        """Build the trainer, the rollout workers and their peers in this process, restore a checkpoint if given,
        and load the first weights into every rollout engine."""
        cfg = self.cfg
        say = progress or (lambda line: None)
        t0 = time.monotonic()
        check_output_dir(cfg.run.output_dir)
        if cfg.cluster.address:
            log.warning("cluster.host is 'threads': cluster.address=%r is not used", cfg.cluster.address)
        if resume_from:  # validate before building anything (clear error, nothing half-built)
            read_checkpoint(resume_from)
        try:
            with torch_threads(self.threads):
                self._build()
            say(f"roles built in this process: the trainer and {len(self.rollout_roles)} rollout worker(s) "
                f"({time.monotonic() - t0:.1f} s); loading the first weights")  # fmt: skip
            if resume_from:
                self._restore(str(resume_from))
            self._first_weights()
        except BaseException:
            self.teardown(failed=True)
            raise
        self.launched = True
        took = time.monotonic() - t0
        say(f"first weights (version {self.last_version}) loaded by every rollout worker ({took:.1f} s)")
        return {
            "ray_address": "in-process (cluster.host: threads)",
            "started_ray": False,
            "policy_dir": self.policy_dir,
            "version": self.last_version,
            "step": self.last_step,
        }

    def _build(self) -> None:
        """The parts of TrainerActor and of each RolloutActor (rlhf_core.run.build), wired with plain peers."""
        cfg = self.cfg
        build.setup_process(cfg, cfg.trainer.seed)
        policy_dir = build.resolve_policy_dir(cfg)
        self.policy_dir = str(policy_dir)
        self.model, self.tokenizer = self._policy(policy_dir)
        self.train_prompts, heldout = build.build_prompts(cfg, self.tokenizer)
        check_lengths(policy_dir, cfg, self.train_prompts + heldout)
        trainer = build.build_trainer(cfg, self.model, self.tokenizer, policy_dir)
        self.evaluator = build.build_evaluator(cfg, self.model, self.tokenizer, policy_dir, heldout)
        self.pinned = pinned_evaluation(cfg, policy_dir, heldout)  # eval.every's, off the trainer's path
        self.buffer = ExperienceBuffer(**buffer_options(cfg))
        self.queue = PromptQueue(self.train_prompts, **queue_options(cfg))
        self.store = SharedWeights()
        self.trainer_role = TrainerRole(
            cfg, trainer, self.tokenizer, LocalPeer(self.buffer), self.store, peer_state=self._peer_state
        )
        for i in range(cfg.rollout.num_workers):
            self.rollout_roles.append(
                RolloutRole(cfg, self._rollout_worker(i, policy_dir), LocalPeer(self.buffer), LocalPeer(self.queue),
                            self.store, i)
            )  # fmt: skip

    # the parts a host built on this one may hold elsewhere (`rlhf_core.hosts.shared_fleet`)
    def _policy(self, policy_dir: Path):
        """The trainer's (model, tokenizer)."""
        return build.build_policy(self.cfg, policy_dir)

    def _rollout_worker(self, index: int, policy_dir: Path):
        """Rollout worker `index` over its engine's own copy of the policy, as each actor has."""
        model, tokenizer = build.build_policy(self.cfg, policy_dir)
        return build.build_rollout_worker(self.cfg, model, tokenizer, policy_dir, build.rollout_seed(self.cfg, index))

    def _peer_state(self) -> tuple[dict, list]:
        """(prompt queue position, every rollout engine's sampling RNG) for a checkpoint."""
        return self.queue.state_dict(), self._rollout_rng()

    # ------------------------------------------------------------------ the host's reach (HostBase)
    def _trainer(self, name: str, *args):
        return getattr(self.trainer_role, name)(*args)

    def _queue(self, name: str, *args):
        return getattr(self.queue, name)(*args)

    def _buffer(self, name: str, *args):
        return getattr(self.buffer, name)(*args)

    def _rollout_rng(self) -> list:
        rng = [getattr(r.worker.engine, "generator", None) for r in self.rollout_roles]
        return [g.get_state() if g is not None else None for g in rng]

    def _set_rollout_rng(self, states: list) -> None:
        for role, rng in zip(self.rollout_roles, states):
            if rng is not None and hasattr(role.worker.engine, "generator"):
                role.worker.engine.generator.set_state(rng)

    def _workers_adopt(self) -> None:
        for role in self.rollout_roles:
            role.adopt_weights()

    # ------------------------------------------------------------------ loops
    def start(self) -> None:
        """Start the trainer's and every rollout worker's loop, each on its thread (non-blocking)."""
        if self.started:
            return
        self.trainer_role.run_facts = {"eval_start": self.eval_start, **self.run_facts}
        total = self.cfg.trainer.total_steps
        self.trainer_loop = RoleThread("atrlhf-trainer", lambda: self.trainer_role.run(total), self.threads)
        self.worker_loops = {
            r.index: RoleThread(f"atrlhf-rollout-{r.index}", r.run, self.threads) for r in self.rollout_roles
        }
        self.started, self.stopping = True, False
        for loop in [self.trainer_loop, *self.worker_loops.values()]:
            loop.start()

    def wait(self, seconds: float) -> None:
        """Between polls: wake as soon as the trainer loop ends."""
        if self.trainer_loop is not None and self.trainer_loop.is_alive():
            self.trainer_loop.join(timeout=seconds)
        else:
            time.sleep(seconds)

    def _check_loops(self) -> None:
        loops = [("trainer", self.trainer_loop), *((f"rollout worker {i}", t) for i, t in self.worker_loops.items())]
        for what, loop in loops:
            if loop is not None and loop.error is not None:
                self.failed = f"{what} failed: {loop.failure()}"
                raise RunFailed(self.failed) from loop.error

    # ------------------------------------------------------------------ supervision hooks
    def poll(self) -> dict:
        """Every role's stats plus the trainer metrics produced since the last poll (DistributedRun.poll's keys)."""
        self._check_loops()
        metrics = self.trainer_role.drain_metrics()
        tstats = {**self.trainer_role.stats(), **self.evaluation_stats()}  # after the drain: step >= drained steps
        bstats, qstats = self.buffer.stats(), self.queue.stats()
        wstats = [{**r.stats(), "alive": True, "restarted": False, "restarts": 0} for r in self.rollout_roles]
        return assemble_poll(self, metrics, tstats, bstats, qstats, wstats)

    def set_rollout_workers(self, n: int, reason: str = "") -> int:
        """The threads host's fleet is the one it was built with (threads are not added or removed)."""
        return len(self.rollout_roles)

    def evaluate(self) -> dict:
        """Held-out evaluation with the trainer's current weights (between two of its steps)."""
        with self.trainer_role.lock, torch_threads(self.threads):
            self.evaluator.engine.version = self.trainer_role.trainer.version
            self.last_evaluation = self.evaluator()
            return self.last_evaluation

    def warm_start(self, steps: int) -> dict:
        """The supervised format warm start on the trainer's model, then its weights loaded by every rollout
        worker before the loops start; returns warm_start/* and eval/accuracy_warm_start."""
        from rlhf_core.run.warm_start import warm_start

        with self.trainer_role.lock, torch_threads(self.threads):
            metrics = warm_start(self.model, self.tokenizer, self.train_prompts, self.cfg, steps)
        return self._after_warm_start(metrics)

    def new_checkpoints(self) -> list[dict]:
        """Checkpoints the trainer wrote at exact multiples of checkpoint.every since the last call."""
        return self.trainer_role.drain_checkpoints() if self.trainer_role is not None else []

    def export(self, path: str | Path) -> str:
        with self.trainer_role.lock:
            return str(build.export_run_policy(self.cfg, self.model, self.tokenizer, path))

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Stop the loops and wait for them to return, at most `grace_s` (DistributedRun.stop's bound)."""
        if self.trainer_role is None:
            return
        self.stopping = True
        for role in [self.trainer_role, *self.rollout_roles]:
            role.stop()
        grace = stop_grace(self.timeout, grace_s)
        deadline = time.monotonic() + grace
        for loop in [self.trainer_loop, *self.worker_loops.values()]:
            if loop is not None:
                loop.join(timeout=max(0.0, deadline - time.monotonic()))
                if loop.is_alive():
                    log.warning("%s did not stop within %.0f s", loop.name, grace)
        self.started = False

    def teardown(self, failed: bool = False) -> None:
        """Idempotent: stop the loops, close what the workers and the evaluator started (reward and environment
        processes). `failed`: the run ended on an error, its loops get FAILED_GRACE_S to return."""
        if self.trainer_role is None and not self.rollout_roles:
            return
        try:
            self.stop(FAILED_GRACE_S if failed else None)
        finally:
            for role in self.rollout_roles:
                role.worker.close()
            if self.evaluator is not None:
                self.evaluator.close()
                if getattr(self.evaluator, "env", None) is not None:
                    self.evaluator.env.close()
            if self.pinned is not None:
                self.pinned.close()
            self.trainer_role, self.rollout_roles = None, []

    def _loop_polls(self, role: str, index: int, attempt: int, what: str):
        """HostBase.wait_loop's waiting on a thread (threads are never restarted, so an attempt after the first ends
        at once)."""
        if attempt > 1:
            return {}
        while True:
            loop = self.trainer_loop if role == "trainer" else self.worker_loops.get(index)
            if loop is None:
                if self.stopping or (self.launched and self.trainer_role is None):
                    return {}
                time.sleep(0.2)
                continue
            loop.join(timeout=1.0)
            if not loop.is_alive():
                if loop.error is not None:
                    raise RunFailed(f"{what} failed: {loop.failure()}") from loop.error
                return loop.result or {}
            yield

    def _loop_stats(self, role: str, index: int) -> dict:
        return (self.trainer_role if role == "trainer" else self.rollout_roles[index]).stats()

    reconcile = staticmethod(reconcile)  # the conservation of groups (rlhf_core.run.control owns it)
