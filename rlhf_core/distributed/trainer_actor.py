"""The trainer actor: the trainer role (`rlhf_core.run.roles.TrainerRole`) hosted in its own process (rank 0
of a sharded trainer group when cluster.trainer_workers > 1; the other ranks are `trainer_group.TrainerRankActor`s).

Hosting only: the role's cycle runs as a long-running actor method; the actor is threaded (`max_concurrency`),
so control calls (stats, stop, publish, evaluate, checkpoint) stay answerable while it runs. Its peers are the
buffer and weight-store actors behind `peers.py`'s adapters; with N ranks every trainer call runs on all of
them at once (`_on_all`).
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import ray

from rlhf_core.data import Prompt
from rlhf_core.distributed.calls import WaitTimeout, die, get_or_fail
from rlhf_core.distributed.peers import RemoteBuffer, RemoteWeights
from rlhf_core.distributed.rollout_actor import rollout_rng_states
from rlhf_core.distributed.trainer_group import group_address, join_trainer_group
from rlhf_core.model.lora import adapter_state_dict, is_lora
from rlhf_core.model.weights import load_weights_into
from rlhf_core.run import build
from rlhf_core.run.checkpoint import CheckpointState
from rlhf_core.run.roles import TrainerRole

log = logging.getLogger("rlhf_core.distributed")


class TrainerActor:
    """The trainer role in its own process. With cluster.trainer_workers = N > 1 it is rank 0 of a sharded
    group: after `join_group` every step, snapshot and checkpoint runs on all ranks at once (`_on_all`), each
    rank training on its slice of the batch; rank 0 alone talks to the buffer and the weight store. It keeps an
    unsharded copy of the policy (`self.model`) for evaluation, export and the warm start. A rank that dies
    fails the step with a message naming the rank and the step."""

    def __init__(self, cfg, policy_dir: str, train_prompts: list[Prompt], heldout: list[Prompt], buffer, store):
        build.setup_process(cfg, cfg.trainer.seed)
        self.cfg, self.timeout = cfg, cfg.runtime.wait_timeout_s
        self.buffer, self.store = RemoteBuffer(buffer, self.timeout), RemoteWeights(store, self.timeout)
        self.train_prompts = train_prompts  # for the warm start only
        self.model, self.tokenizer = build.build_policy(cfg, policy_dir)
        self.followers: list = []  # ranks 1..N-1 of a sharded trainer group
        self.sharded = cfg.cluster.trainer_workers > 1
        self.address = group_address() if self.sharded else None
        self.evaluator = build.build_evaluator(cfg, self.model, self.tokenizer, policy_dir, heldout)
        self.role: Optional[TrainerRole] = None
        if not self.sharded:
            self._make_role(build.build_trainer(cfg, self.model, self.tokenizer))

    def _make_role(self, trainer) -> None:
        on_all, full = (self._on_all, lambda: self._on_all("full_weights")) if self.sharded else (None, None)
        self.role = TrainerRole(
            self.cfg, trainer, self.tokenizer, self.buffer, self.store, call=on_all, model=self.model, full_weights=full
        )

    @property
    def trainer(self):
        return self.role.trainer

    # ------------------------------------------------------------------ a sharded trainer group
    def group_address(self) -> Optional[str]:
        """Where ranks 1..N-1 meet this one (None for a single trainer)."""
        return self.address

    def join_group(self, followers: list) -> int:
        """Rank 0 joins the group the `followers` (ranks 1..N-1, starting meanwhile) join, and builds its sharded
        Trainer from a copy of the policy (this actor keeps the unsharded one). Returns the world size."""
        self.followers = list(followers)
        self._make_role(join_trainer_group(self.cfg, copy.deepcopy(self.model), self.tokenizer, self.address, 0))
        return 1 + len(self.followers)

    def _on_all(self, name: str, *args):
        """Trainer.<name>(*args) on every rank at once (a collective with N ranks), rank 0's result. A rank
        that died (or failed) fails the call with a message naming it and the step."""
        refs = [f.call.remote(name, *args) for f in self.followers]
        try:
            out = getattr(self.trainer, name)(*args)
        except Exception as exc:
            try:
                self._check_ranks(refs, name, timeout_s=10.0)  # a dead peer is why rank 0's collective failed
            except WaitTimeout:  # a rank still busy, not dead: rank 0's own error is the news
                pass
            raise RuntimeError(f"trainer rank 0 failed in {name} at step {self.trainer.step + 1}: {exc}") from exc
        self._check_ranks(refs, name, self.timeout)
        return out

    def _check_ranks(self, refs: list, name: str, timeout_s: float) -> None:
        n = 1 + len(self.followers)
        for rank, ref in enumerate(refs, start=1):
            try:
                get_or_fail(ref, timeout_s, f"trainer rank {rank} of {n} to finish {name}")
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                died = isinstance(exc, ray.exceptions.RayActorError)
                raise RuntimeError(
                    f"trainer rank {rank} of {n} {'died' if died else 'failed'} in {name} at step "
                    f"{self.trainer.step + 1}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None

    def _refresh_model(self) -> None:
        """The unsharded copy of a sharded trainer gets the current weights (gathered from the ranks)."""
        if self.sharded:
            load_weights_into(self.model, self._on_all("full_weights"))

    # ------------------------------------------------------------------ the role, hosted
    def publish(self) -> float:
        return self.role.publish()

    def run_loop(self, total_steps: int) -> dict:
        return self.role.run(total_steps)

    def stop(self) -> None:
        self.role.stop()

    def drain_metrics(self) -> list[dict]:
        return self.role.drain_metrics()

    def set_checkpointing(self, queue, workers: list, run_facts: dict) -> None:
        """The trainer writes a checkpoint at every exact multiple of checkpoint.every (before
        total_steps), asking `queue` and `workers` for their state; `run_facts` go into each checkpoint."""
        workers = list(workers)
        timeout = self.timeout

        def peer_state() -> tuple[dict, list]:
            data = get_or_fail(queue.state_dict.remote(), timeout, "the prompt queue position")
            return data, rollout_rng_states(workers)

        self.role.peer_state = peer_state
        self.role.run_facts = dict(run_facts)

    def drain_checkpoints(self) -> list[dict]:
        return self.role.drain_checkpoints()

    def checkpoint(self, path: str, data: dict, rollout_rng: list, run: dict) -> str:
        return self.role.checkpoint(path, data, rollout_rng, run)

    def restore(self, path: str) -> CheckpointState:
        """Each rank reads its shard while rank 0 restores (the role's reader); returns the state for the others."""
        refs = [f.restore.remote(path) for f in self.followers]
        state = self.role.restore(path)
        self._check_ranks(refs, "restore", self.timeout)
        return state

    def set_trained(self, trained: dict) -> None:
        self.role.set_trained(trained)

    def stats(self) -> dict:
        return self.role.stats()

    def version(self) -> int:
        return self.trainer.version

    # ------------------------------------------------------------------ what the unsharded copy serves
    def evaluate(self) -> dict:
        with self.role.lock:
            self._refresh_model()
            # the evaluator's engine generates with this trainer's weights: their version (traces carry it)
            self.evaluator.engine.version = self.trainer.version
            return self.evaluator()

    def warm_start(self, steps: int) -> dict:
        """The supervised format warm start on this trainer's model (before the first publish); its progress
        meanwhile from `warm_start_progress`."""
        from rlhf_core.run.warm_start import warm_start

        self._warm_start_done = (0, None)

        def progress(done: int, loss: float) -> None:
            self._warm_start_done = (done, loss)

        with self.role.lock:
            out = warm_start(self.model, self.tokenizer, self.train_prompts, self.cfg, steps, progress)
            if self.sharded:  # trained on the unsharded copy: every rank takes its shard of the result
                weights = (
                    adapter_state_dict(self.model)  # with LoRA only the adapters trained
                    if is_lora(self.model)
                    else {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
                )
                self._on_all("load_full_weights", weights)
            return out

    def warm_start_progress(self) -> tuple[int, Optional[float]]:
        """(steps done, the last step's loss) of the warm start under way (a threaded actor: answered meanwhile)."""
        return getattr(self, "_warm_start_done", (0, None))

    def export(self, path: str) -> str:
        """The policy as a Hugging Face directory (with LoRA: the PEFT adapter, plus the merged model when
        model.lora.export_merged), with its tokenizer and the run's config."""
        with self.role.lock:
            self._refresh_model()
            return str(build.export_run_policy(self.cfg, self.model, self.tokenizer, path))

    def crash(self) -> None:
        """Fault-injection hook: die the way a segfault or an OOM kill would."""
        die()
