"""DistributedRun: the Ray runtime of one training run (mechanisms, not policies).

It launches the actors, runs their loops (in lockstep at runtime.max_staleness 0), and answers the control
plane: poll stats, schedule prompts, sync weights, throttle, evaluate, checkpoint, export, teardown.
The Prefect flow (flows/train.py) decides WHEN to do these things; `run_distributed`
(rlhf_core.hosts.driver) is the same supervision (rlhf_core.supervision.Supervisor) without Prefect,
for tests, benchmarks and debugging.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from rlhf_core.config import TrainConfig
from rlhf_core.data.queue import PromptQueue, queue_options
from rlhf_core.distributed.calls import ActorDied, get_or_fail, ready, remote, ship_user_modules
from rlhf_core.distributed.cluster import (
    ClusterHandle,
    check_resources,
    connect,
    connected,
    gpu_placement_group,
    in_bundle,
    on_this_node,
    role_counts,
    teardown,
)
from rlhf_core.distributed.eval_actor import RayEvaluation
from rlhf_core.distributed.fleet import Fleet
from rlhf_core.distributed.loops import LoopWatch
from rlhf_core.distributed.reward_model_actor import RewardModelActor
from rlhf_core.distributed.rollout_actor import rollout_rng_states
from rlhf_core.distributed.trainer_actor import TrainerActor
from rlhf_core.distributed.trainer_group import TrainerRankActor
from rlhf_core.env.serve import stop_wait_s
from rlhf_core.hosts.base import HostBase
from rlhf_core.run import build
from rlhf_core.run.accounting import reconcile
from rlhf_core.run.checkpoint import read_checkpoint
from rlhf_core.run.control import ExperienceBuffer, RunFailed, WeightStore, WorkerDied, assemble_poll, buffer_options
from rlhf_core.run.preflight import check_lengths, check_output_dir
from rlhf_core.run.supervise import FAILED_GRACE_S, stop_grace
from rlhf_core.usercode import USER_MODULE_PREFIX

log = logging.getLogger("rlhf_core.distributed")


class DistributedRun(LoopWatch, Fleet, HostBase):
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.handle: Optional[ClusterHandle] = None
        self.buffer = self.queue = self.store = self.trainer = self.reward_model = None
        self.workers: list = []
        self.trainer_ranks: list = []  # ranks 1..N-1 of a sharded trainer group (cluster.trainer_workers)
        self.worker_loops: dict[int, object] = {}
        self.worker_loop_starts: dict[int, list] = {}  # every loop each worker ran, oldest first (restarts)
        self.trainer_loop = None
        self.restarts = [0] * cfg.rollout.num_workers
        self.pending_starts: dict[int, tuple[float, str]] = {}  # workers restarting or starting (loops.py)
        self.restart_pings: dict[int, object] = {}
        self.waiting_reported: set[int] = set()
        self.peers: dict[str, str] = {}  # the named actors a rollout worker looks up
        self.events: list[dict] = []
        self._new_events: list[dict] = []
        self.last_step = 0
        self.last_version = 0
        self.started = False
        self.stopping = False  # stop() was called: the loops are ending
        self.failed: Optional[str] = None
        self.timeout = cfg.runtime.wait_timeout_s
        self.policy_dir: Optional[str] = None
        self.eval_start: Optional[float] = None
        self.heldout: list = []  # the held-out prompts (the evaluation actor's, when eval.every starts it)
        self.evaluation = RayEvaluation(self)  # eval.every's pinned evaluations, on an actor of their own
        self.run_facts: dict = {}  # what every checkpoint records about the run (the flow adds its MLflow run id)
        # the autopilot's bound a resumed run goes on with (the checkpoint's); None: runtime.max_staleness
        self.restored_max_staleness: Optional[int] = None

    # ------------------------------------------------------------------ bring-up
    def _get(self, ref, what: str):
        return get_or_fail(ref, self.timeout, what)

    # ------------------------------------------------------------------ the host's reach (HostBase)
    def _trainer(self, name: str, *args):
        slow = name in ("restore", "checkpoint")  # a large model's read or write
        timeout = max(self.timeout, 600) if slow else self.timeout
        return get_or_fail(getattr(self.trainer, name).remote(*args), timeout, f"the trainer's {name}")

    def _queue(self, name: str, *args):
        return self._get(getattr(self.queue, name).remote(*args), f"the prompt queue's {name}")

    def _buffer(self, name: str, *args):
        return self._get(getattr(self.buffer, name).remote(*args), f"the replay buffer's {name}")

    def _rollout_rng(self) -> list:
        return rollout_rng_states(self.workers)

    def _set_rollout_rng(self, states: list) -> None:
        for w, rng in zip(self.workers, states):
            if rng is not None:  # None: the worker was restarting when the checkpoint was taken
                self._get(w.set_rng_state.remote(rng), "a rollout worker to restore its RNG")

    def _workers_adopt(self) -> None:
        self._get([w.maybe_load_weights.remote() for w in self.workers], "the rollout workers to load weights")

    def launch(self, resume_from: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> dict:
        """Join or start Ray, check resources, create the actors, restore a checkpoint if given. `progress(line)`
        is told each phase as it ends (Ray, the actors, the first weights): start-up takes a minute on a laptop."""
        cfg = self.cfg
        say = progress or (lambda line: None)
        t0 = time.monotonic()
        check_output_dir(cfg.run.output_dir)  # before anything starts, not at the first checkpoint
        self.policy_dir = str(build.resolve_policy_dir(cfg))
        # prompts are tokenized once here and shipped to the actors that need them
        train_prompts, heldout = build.build_prompts(cfg, build.build_tokenizer(cfg, self.policy_dir))
        self.heldout = heldout
        check_lengths(self.policy_dir, cfg, train_prompts + heldout)
        if cfg.reward.model.path:
            from rlhf_core.reward.model import check_reward_model_dir

            check_reward_model_dir(cfg.reward.model.path)
        if resume_from:  # validate before starting anything (clear error, nothing half-started)
            read_checkpoint(resume_from)

        say("starting Ray" if not cfg.cluster.address else f"joining Ray at {cfg.cluster.address}")
        self.handle = connect(cfg.cluster)
        ship_user_modules(USER_MODULE_PREFIX)
        try:
            where = "a local instance started here" if self.handle.started_ray else f"joined {self.handle.address}"
            say(f"Ray up ({where}, {time.monotonic() - t0:.1f} s); starting the actors")
            check_resources(cfg)
            pg = gpu_placement_group(cfg, self.timeout)
            self.handle.placement_group = pg
            c = cfg.cluster

            def placed(bundle: int) -> dict:
                return in_bundle(pg, bundle)

            counts = role_counts(cfg)  # the evaluation actor's bundle, when it reserves one, is the last
            last = counts["rollout"] + counts["trainer"] + counts["reward"]
            self.placed_eval = lambda: placed(last) if counts["eval"] else {}

            # named, so that rollout workers look them up instead of taking handles in their constructor
            self.peers = peers = {k: f"atrlhf-{k}-{uuid.uuid4().hex[:12]}" for k in ("queue", "buffer", "store")}
            here = on_this_node()  # the control plane lives with the driver: losing another node cannot take it
            self.queue = remote(PromptQueue, num_cpus=0, max_concurrency=8, name=peers["queue"], **here).remote(
                train_prompts, **queue_options(cfg)
            )
            self.buffer = remote(ExperienceBuffer, num_cpus=0, max_concurrency=16, name=peers["buffer"], **here).remote(
                **buffer_options(cfg)
            )
            self.store = remote(WeightStore, num_cpus=0, max_concurrency=8, name=peers["store"], **here).remote()
            if cfg.reward.model.path:  # its own process and resources; the last bundle of the placement group
                peers["reward_model"] = f"atrlhf-reward_model-{uuid.uuid4().hex[:12]}"
                self.reward_model = remote(
                    RewardModelActor,
                    **c.actor_options("reward"),
                    name=peers["reward_model"],
                    **placed(cfg.rollout.num_workers + c.trainer_workers),
                ).remote(cfg, self.policy_dir)
            self.trainer = remote(
                TrainerActor,
                **c.actor_options("trainer"),
                max_concurrency=4,
                **placed(0),
            ).remote(cfg, self.policy_dir, train_prompts, heldout, self.buffer, self.store)
            ranks = c.trainer_workers  # bundles 0..ranks-1 of the placement group: the trainer group
            if ranks > 1:
                address = self._get(self.trainer.group_address.remote(), "the trainer's group address")
                self.trainer_ranks = [
                    remote(TrainerRankActor, **c.actor_options("trainer"), **placed(r)).remote(
                        cfg, self.policy_dir, r, address
                    )
                    for r in range(1, ranks)
                ]
            self.workers = [self._new_worker(i, placed(i + ranks)) for i in range(cfg.rollout.num_workers)]
            self.handle.actors = [self.queue, self.buffer, self.store, self.trainer, *self.trainer_ranks, *self.workers]
            if self.reward_model is not None:
                self.handle.actors.append(self.reward_model)
            if self.trainer_ranks:  # the ranks meet (each builds its shard) before anything asks the trainer
                get_or_fail(
                    self.trainer.join_group.remote(self.trainer_ranks),
                    max(self.timeout, 300),
                    f"the {c.trainer_workers} trainer ranks to form their group",
                )
            get_or_fail(
                [w.ping.remote() for w in self.workers] + [self.trainer.version.remote()],
                max(self.timeout, 300),
                "the rollout workers and the trainer to start",
            )
            say(
                f"actors up: the trainer and {len(self.workers)} rollout worker(s) "
                f"({time.monotonic() - t0:.1f} s); loading the first weights"
            )
            if resume_from:
                self._restore(str(resume_from))
            self._first_weights()
            if cfg.eval.every > 0:  # eval.every's actor starts now: its policy copy is built before the loops run
                self.evaluation.start()
            took = time.monotonic() - t0
            say(f"first weights (version {self.last_version}) loaded by every rollout worker ({took:.1f} s)")
        except BaseException:
            self.teardown(failed=True)
            raise
        return {
            "ray_address": self.handle.address,
            "started_ray": self.handle.started_ray,
            "policy_dir": self.policy_dir,
            "version": self.last_version,
            "step": self.last_step,
        }

    # ------------------------------------------------------------------ loops
    def start(self) -> None:
        """Start the rollout and trainer loops (non-blocking); at max_staleness 0 they run in lockstep."""
        if self.started:
            return
        facts = {"eval_start": self.eval_start, **self.run_facts}
        self._get(self.trainer.set_checkpointing.remote(self.queue, self.workers, facts), "the trainer's checkpointing")
        self.trainer_loop = self.trainer.run_loop.remote(self.cfg.trainer.total_steps)
        self.worker_loops = {i: w.run_loop.remote() for i, w in enumerate(self.workers)}
        for i, ref in self.worker_loops.items():
            self.worker_loop_starts.setdefault(i, []).append(ref)
        self.started = True

    def wait(self, seconds: float) -> None:
        """Between polls: wake as soon as the trainer loop ends, not up to a whole interval later."""
        if self.trainer_loop is not None:
            ready([self.trainer_loop], seconds)
        else:
            time.sleep(seconds)

    # ------------------------------------------------------------------ supervision hooks
    def poll(self) -> dict:
        """Stats of every actor plus the trainer metrics produced since the last poll."""
        if self.trainer_loop is not None:
            if ready([self.trainer_loop], 0):
                try:
                    get_or_fail(self.trainer_loop, self.timeout, "the trainer loop")
                except Exception as exc:
                    self.failed = f"trainer failed: {exc}"
                    raise RunFailed(self.failed) from exc
        if self.started:
            self._check_worker_loops()
        # all requests in flight at once: one round trip instead of one per actor
        bstats_ref, qstats_ref = self.buffer.stats.remote(), self.queue.stats.remote()
        # a worker Ray is restarting is not asked (a call would wait for it): it is down until it is back
        wstats_refs = [None if i in self.pending_starts else w.stats.remote() for i, w in enumerate(self.workers)]
        try:
            metrics = self._get(self.trainer.drain_metrics.remote(), "trainer metrics")
            tstats = self._get(self.trainer.stats.remote(), "trainer stats")  # after the drain: step >= drained steps
        except ActorDied as exc:
            self.failed = f"trainer failed: the trainer actor died ({type(exc).__name__})"
            raise RunFailed(self.failed) from exc
        bstats = self._get(bstats_ref, "buffer stats")
        qstats = self._get(qstats_ref, "prompt queue stats")
        wstats = []
        for i, ref in enumerate(wstats_refs):
            try:
                if ref is None:
                    raise WorkerDied("restarting")
                s = get_or_fail(ref, min(self.timeout, 10), f"rollout worker {i}'s stats")
                s["alive"] = True
            except Exception as exc:
                s = {"index": i, "alive": False, "error": type(exc).__name__}
                if ref is None:
                    s.update(error=self.pending_starts[i][1], starting=True)
            s["restarts"] = self.restarts[i]
            wstats.append(s)
        fleet = {"cluster/rollout_workers": len(self.workers), "rollout/requeued_prompts": self.requeued_prompts}
        tstats["eval_last"] = self.evaluation.last  # the run audit's evidence of the evaluation metric
        return assemble_poll(self, metrics, tstats, bstats, qstats, wstats, fleet, self.fleet_stats())

    def evaluate(self) -> dict:
        result = get_or_fail(self.trainer.evaluate.remote(), max(self.timeout, 600), "held-out evaluation")
        self.evaluation.remember(result)
        return result

    def submit_evaluation(self) -> int:
        """A pinned evaluation of the newest published version, on the evaluation actor (started at the first)."""
        return self.evaluation.submit()

    def evaluations(self) -> list[dict]:
        return self.evaluation.drain()

    def warm_start(self, steps: int, progress: Optional[Callable] = None, every_s: float = 10.0) -> dict:
        """The supervised format warm start in the trainer, then its weights published and loaded by every
        rollout worker before the loops start; returns warm_start/* and eval/accuracy_warm_start. Meanwhile
        `progress(steps done, last loss)` every `every_s` seconds."""
        ref = self.trainer.warm_start.remote(steps)
        deadline = time.monotonic() + max(self.timeout, 600)
        while progress is not None and time.monotonic() < deadline and not ready([ref], every_s):
            progress(*self._get(self.trainer.warm_start_progress.remote(), "the warm start's progress"))
        metrics = get_or_fail(ref, max(deadline - time.monotonic(), 1), "the warm start")
        return self._after_warm_start(metrics)

    def new_checkpoints(self) -> list[dict]:
        """Checkpoints the async trainer wrote at exact multiples of checkpoint.every since the last
        call ([{step, path, rollout_rng_missing}]); the flow uploads and reports them."""
        if self.trainer is None:
            return []
        try:
            written = self._get(self.trainer.drain_checkpoints.remote(), "the trainer's new checkpoints")
        except ActorDied as exc:  # its process or its node died: the run ends, naming it
            self.failed = f"trainer failed: the trainer actor died ({type(exc).__name__})"
            raise RunFailed(self.failed) from exc
        for c in written:
            if c["rollout_rng_missing"]:
                self._event(
                    "checkpoint_partial",
                    f"checkpoint {c['path']}: rollout worker(s) {c['rollout_rng_missing']} "
                    "were restarting; their sampling RNG is not in it (a resume seeds them afresh)",
                )
        return written

    def export(self, path: str | Path) -> str:
        return get_or_fail(self.trainer.export.remote(str(path)), max(self.timeout, 600), "the model export")

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Stop the loops and wait for them to return, at most `grace_s` (default: runtime.wait_timeout_s, at
        most 30 s; a run that failed waits FAILED_GRACE_S: a role stuck mid-batch is killed, not waited for)."""
        if self.trainer is None:
            return
        self.stopping = True
        refs = []
        for actor in [self.trainer, *self.workers]:
            try:
                refs.append(actor.stop.remote())
            except Exception:
                pass
        loops = [r for r in [self.trainer_loop, *self.worker_loops.values()] if r is not None]
        try:
            ready(refs + loops, stop_grace(self.timeout, grace_s), every=True)
        except Exception:
            pass
        self.started = False

    def teardown(self, failed: bool = False) -> None:
        """Idempotent: stop loops, kill exactly our actors and placement group, shut Ray down if we started it.
        `failed`: the run ended on an error, its loops get FAILED_GRACE_S to return before the kill."""
        if self.handle is None:
            return
        try:
            if connected():
                self.stop(FAILED_GRACE_S if failed else None)
                self.close_workers()
        finally:
            teardown(self.handle)
            self.handle = None

    def close_workers(self) -> None:
        """Each rollout worker closes what it holds before its actor is killed (an environment instance a hung
        step still holds is closed once that step ends, within STOP_GRACE_S), bounded: a worker that does not
        answer is killed as before."""
        refs = []
        for close in [*(w.close.remote for w in self.workers), self.evaluation.close_ref]:
            try:
                refs.append(close())
            except Exception:
                pass
        refs = [r for r in refs if r is not None]
        bound = stop_wait_s(self.cfg.env.step_timeout_s if self.cfg.env.path else 0.0) + 2
        try:
            ready(refs, bound, every=True)
        except Exception:
            pass

    # ------------------------------------------------------------------ reconciliation
    reconcile = staticmethod(reconcile)  # the conservation of groups (rlhf_core.run.control owns it)
