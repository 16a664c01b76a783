"""Pinned evaluation on Ray (eval.every): an actor of its own, off the critical path of the trainer and the fleet.

`EvalActor` holds a policy copy of its own and a `rlhf_core.run.pinned_eval.PinnedEvaluation` thread; it loads the
weights of exactly version V as a rollout worker does, from the weight store's reference (one object-store read,
nothing through the driver), so neither the trainer (no lock, no GIL shared with it) nor the rollout fleet waits.
`RayEvaluation` is the driver's side: it starts the actor at the end of the launch when eval.every is set (else at
the first request: a run that never evaluates pays nothing), asks the store for the newest published version, and
drains the finished evaluations. Its resources are cluster.resources.eval (default none reserved: CPU 0, GPU 0; its
bundle is the placement group's last); its process runs at a lower CPU priority (NICENESS) than the roles'.
"""

from __future__ import annotations

import os
from typing import Optional

import ray

from rlhf_core.distributed.calls import get_or_fail, remote
from rlhf_core.distributed.transport import unpack_state_dict
from rlhf_core.rollout.probe import split as sync_probe_split
from rlhf_core.run import build
from rlhf_core.run.pinned_eval import evaluation_evidence, pinned_evaluation

NICENESS = 10  # the evaluation process's CPU priority below the roles' (os.nice): it never takes their cores


class EvalActor:
    """The evaluation worker: `submit(version, [ref])` queues version V (the weight store's packed snapshot; None:
    the weights it was built with), `evaluations()` returns the finished ones (each with eval/version)."""

    def __init__(self, cfg, policy_dir: str, heldout: list):
        os.nice(NICENESS)  # off the critical path: where it shares CPUs, the trainer and the fleet go first
        build.setup_process(cfg, cfg.trainer.seed)
        self.timeout = cfg.runtime.wait_timeout_s
        self.pinned = pinned_evaluation(cfg, policy_dir, heldout)
        self.pinned.evaluator = self.pinned.build()  # ready before the first request (the actor starts with the run)

    def submit(self, version: int, ref_box: Optional[list]) -> int:
        weights = None
        if ref_box:  # the ref arrives inside a list: Ray passes the reference, the read happens here
            packed = get_or_fail(ref_box[0], self.timeout, f"weights of version {version}")
            weights = sync_probe_split(unpack_state_dict(packed))[0]
        self.pinned.submit(int(version), weights)
        return int(version)

    def evaluations(self) -> list[dict]:
        return self.pinned.drain()

    def stats(self) -> dict:
        return self.pinned.stats()

    def close(self) -> None:
        self.pinned.close()


class RayEvaluation:
    """The Ray host's pinned evaluation: the actor (started at the first request) and the newest evaluation's
    evidence for the run audit (`last`: the synchronous start/final evaluation's or the newest pinned one's)."""

    def __init__(self, run):
        self.run = run  # the DistributedRun: its cfg, handle, store, policy_dir, heldout, placement
        self.actor = None
        self.submitted: list = []  # requests the actor has not taken yet (ObjectRefs)
        self.last: dict = {}

    def start(self) -> None:
        """Start the actor now (at the end of the launch, when eval.every will ask for evaluations): its policy copy
        is built before the loops run, not at the first request. Non-blocking."""
        if self.actor is None:
            self._start()

    def _start(self):
        run, c = self.run, self.run.cfg.cluster
        options = {**c.actor_options("eval"), "max_concurrency": 4, **run.placed_eval()}
        self.actor = remote(EvalActor, **options).remote(run.cfg, run.policy_dir, run.heldout)
        run.handle.actors.append(self.actor)
        return self.actor

    def submit(self) -> int:
        """Queue an evaluation of the newest version the trainer published (what the rollout workers load); returns
        that version at once (the actor, started at the first request, takes it when it is up: the caller, the
        supervision loop, never waits for it)."""
        actor = self.actor or self._start()
        found = get_or_fail(self.run.store.get_if_newer.remote(-1), self.run.timeout, "the weight store")
        version, box = (found[0], found[1]) if found is not None else (self.run.last_version, None)
        self.submitted.append(actor.submit.remote(version, box))
        return int(version)

    def drain(self) -> list[dict]:
        """The evaluations finished since the last call; a request the actor refused (it failed to start) raises."""
        if self.actor is None:
            return []
        if self.submitted:
            done, self.submitted = ray.wait(self.submitted, num_returns=len(self.submitted), timeout=0)
            get_or_fail(done, self.run.timeout, "the evaluation requests")
        out = get_or_fail(self.actor.evaluations.remote(), self.run.timeout, "the finished evaluations")
        self.remember(*out)
        return out

    def remember(self, *results: dict) -> None:
        for result in results:
            if "error" not in result:
                self.last = evaluation_evidence(result)

    def close_ref(self):
        """The actor's close (its thread and evaluator), for the host's bounded wait before the kill."""
        return self.actor.close.remote() if self.actor is not None else None
