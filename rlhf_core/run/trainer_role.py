"""The trainer's cycle, written once and Ray-free (see rlhf_core/run/roles.py for the two roles together)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.model.policy import dropout_max
from rlhf_core.rollout.probe import snapshot_bytes
from rlhf_core.rollout.probe import split as sync_probe_split
from rlhf_core.run.accounting import group_length, token_ledger
from rlhf_core.run.checkpoint import (
    CheckpointState,
    capture_rng,
    checkpoint_dir,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from rlhf_core.run.control import busy_fraction
from rlhf_core.types import Experience, cat_rollouts

log = logging.getLogger("rlhf_core.run")
TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"  # in the run dir: one line per step, {"step", "prompt_ids"}
NO_PREFETCH_ENV = "ASYNCTENSORRLHF_NO_PREFETCH"
"""Set to 1 to turn the trainer's prefetch off (an ablation for benchmarks/pipeline.py --no-prefetch; not a config
key: no run is better without it). Read in the trainer's process, which inherits it from the driver."""


def prefetch_enabled() -> bool:
    """Whether the trainer takes batch V + 1 while step V trains (always, unless NO_PREFETCH_ENV is 1)."""
    return os.environ.get(NO_PREFETCH_ENV, "") not in ("1", "true", "yes")


class TrainerRole:
    """The trainer's cycle over a `Trainer` (or, with `call`, over every rank of a sharded group at once).

    call(name, *args): Trainer.<name>(*args) on every rank, rank 0's result (default: this trainer's).
    snapshot(): the weights to publish (default: call("state_dict_for_sync")); a host whose rollout engine
    generates with the trainer's own model passes `lambda: None` (publishing is then only the version).
    model: the module checkpoints are written from; full_weights(): the gathered weights of a sharded group.
    peer_state(): (prompt queue state, rollout engines' RNG states) for a checkpoint, from the host."""

    def __init__(
        self,
        cfg,
        trainer,
        tokenizer,
        buffer,
        store,
        *,
        call: Optional[Callable] = None,
        snapshot: Optional[Callable[[], Optional[dict]]] = None,
        model=None,
        full_weights: Optional[Callable[[], dict]] = None,
        peer_state: Optional[Callable[[], tuple[dict, list]]] = None,
        checkpoint_root: Optional[str | Path] = None,
    ):
        self.cfg, self.trainer, self.tokenizer = cfg, trainer, tokenizer
        self.buffer, self.store = buffer, store
        self.call = call or (lambda name, *args: getattr(self.trainer, name)(*args))
        self.snapshot = snapshot or (lambda: self.call("state_dict_for_sync"))
        self.model = model if model is not None else trainer.model
        self.full_weights = full_weights
        self.peer_state = peer_state
        self.checkpoint_root = checkpoint_root  # None: <run_dir>/checkpoints
        self.run_facts: dict = {}  # what every checkpoint records about the run (eval_start, MLflow run id)
        self.lock = threading.Lock()  # one of: train step, evaluation, checkpoint, export
        self.stop_event = threading.Event()
        self.metrics: list[dict] = []
        self.idle_s = 0.0
        self.work_started: Optional[float] = None  # wall clock of the first step: busy_frac's denominator
        self.error: Optional[str] = None
        self.staleness_hist: dict[int, int] = {}
        self._model_facts: Optional[dict] = None
        self.published: Optional[tuple[int, Optional[dict]]] = None  # (version, snapshot) of the newest publish
        self.groups_trained = 0  # counted here, independently of the buffer's count (reconcile)
        self.tokens_trained = self.rows_trained = 0  # and in response tokens and rows (the token ledger)
        self.ledger_carried: dict = {}  # the token ledger at the checkpoint the run resumed from
        self.seed = torch.initial_seed()  # what the host seeded torch with (build.setup_process): the audit's
        self.trained: dict[int, int] = {}  # prompt uid -> times trained on in the run: in every checkpoint
        self.checkpoints_written: list[dict] = []
        self.last_publish_s: Optional[float] = None
        self.bound = cfg.runtime.max_staleness  # the staleness bound the buffer enforced for the latest batch
        self.last_batch = (0, 0)  # (samples, tokens) of the latest step
        self.total_steps: Optional[int] = None  # the run's last step (set by run() or step())

    # ------------------------------------------------------------------ one step
    def take(self, wait_s: float, for_version: Optional[int] = None) -> tuple[list[Experience], int]:
        """(groups, bound): a step's groups ([] if they did not arrive within wait_s) and the bound the buffer
        enforced taking them (the one owner of the bound)."""
        return self.buffer.take(self.cfg.trainer.prompts_per_step, wait_s, for_version)

    def step(self, wait_s: float, total_steps: int) -> Optional[dict]:
        """Take, train, publish, checkpoint when due: one whole step, or None when no batch came within wait_s."""
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        groups, bound = self.take(wait_s)
        self.idle_s += time.perf_counter() - t0
        if not groups:
            return None
        self.total_steps = total_steps
        return self.train_on(groups, bound, t0)

    def train_on(self, groups: list[Experience], bound: int, t0: float, shipper=None) -> dict:
        """One trainer step on these groups, taken within staleness `bound` (t0: when waiting for them began).
        The weights snapshot (when sync_every says so) is taken at once; shipping it and advancing the buffer
        happen here, or on the `shipper` executor while the next step runs."""
        t1 = time.perf_counter()
        with self.lock:
            batch = cat_rollouts([g.batch for g in groups], self.tokenizer.pad_token_id)
            consumer_version = self.trainer.version
            staleness = consumer_version - batch.policy_version
            # per token (partial rollouts: a row's tokens may be of several versions; policy_version is the oldest)
            token_staleness = (consumer_version - batch.versions_per_token())[batch.trained_mask]
            worst = max([int(staleness.max()), *([int(token_staleness.max())] if token_staleness.numel() else [])])
            if worst > bound:  # the buffer guarantees this; never train on it
                raise RuntimeError(f"staleness bound violated: tau={worst} > max_staleness={bound}")
            self.bound = bound
            for tau, count in zip(*torch.unique(staleness, return_counts=True)):
                self.staleness_hist[int(tau)] = self.staleness_hist.get(int(tau), 0) + int(count)
            m = self.call("train_step", batch)
            self.groups_trained += len(groups)
            for g in groups:  # the token ledger's trainer side, measured as the buffer measures
                tokens, rows = group_length(g)
                self.tokens_trained, self.rows_trained = self.tokens_trained + tokens, self.rows_trained + rows
                self.trained[g.prompt_id] = self.trained.get(g.prompt_id, 0) + 1
            self._record_trained(self.trainer.step, [g.prompt_id for g in groups])
            version = self.trainer.version
            due = bool(m["trainer/step_finite"]) and version % self.cfg.runtime.sync_every == 0
            # copied now, under the lock: the next optimizer step changes the weights in place
            snap_start = time.perf_counter()
            snapshot = self.snapshot() if due else None
            snapshot_s = time.perf_counter() - snap_start
        # a checkpoint due now is written before the new weights are published: in lockstep the rollout has not
        # started the next step, so a resume generates what the uninterrupted run generates
        self.checkpoint_if_due(self.total_steps or 0)
        (shipper or self.ship)(version, snapshot, due)
        if due:  # the CPU copy of the weights (with N trainer ranks: gathered from the shards)
            m["sync/snapshot_s"] = snapshot_s
            m["sync/bytes"] = snapshot_bytes(snapshot)
        if due and self.last_publish_s is not None:
            m["sync/latency_s"] = self.last_publish_s  # the latest publish that has completed
        t2 = time.perf_counter()
        self.last_batch = (len(batch), batch.num_tokens)
        m.update(
            {
                "async/max_staleness": bound,  # the bound in force for this step's batch
                "time/train_s": t2 - t1,
                "time/wait_s": t1 - t0,
                "step": self.trainer.step,
                "throughput/samples_per_s": len(batch) / max(1e-9, t2 - t0),
                "throughput/tokens_per_s": batch.num_tokens / max(1e-9, t2 - t0),
            }
        )
        self.metrics.append(m)
        return m

    def ship(self, version: int, snapshot: Optional[dict], published: bool) -> None:
        """After a step (or a publish request): the weights to the store, then the buffer's version update, in
        that order: the buffer learns the published version (for admission) only after the store holds the
        weights, so a worker admitted against version v always finds weights >= v."""
        start = time.perf_counter()
        if published:
            self.store.publish(version, snapshot)
            self.published = (version, snapshot)  # what a pinned evaluation of this version loads
        # after the last step no rollout is admitted for a step that will not come: in lockstep the rollout engines'
        # RNG in the final checkpoint is then where the next step (a resume) starts from
        last = self.total_steps is not None and version >= self.total_steps
        self.buffer.advance(version, version if published and not last else None)
        if published:
            self.last_publish_s = time.perf_counter() - start

    def publish(self) -> float:
        """Publish the current weights now (the flow's "sync sooner"); returns seconds. Waits for a running
        step to finish, so the snapshot is never torn."""
        start = time.perf_counter()
        with self.lock:
            snapshot, version = self.snapshot(), self.trainer.version
        self.ship(version, snapshot, published=True)
        return time.perf_counter() - start

    def published_weights(self) -> tuple[int, Optional[dict]]:
        """(version, weights) of the newest published snapshot, its sync probe taken off (before any publish: a
        snapshot of the trainer's weights taken now): what a pinned evaluation of that version loads."""
        if self.published is None:
            with self.lock:
                self.published = (self.trainer.version, self.snapshot())
        version, snapshot = self.published
        return version, sync_probe_split(snapshot)[0]

    def _record_trained(self, step: int, prompt_ids: list[int]) -> None:
        """Append the step's prompt ids to <run_dir>/trained_prompts.jsonl (what each step trained on)."""
        path = Path(self.cfg.run.run_dir) / TRAINED_PROMPTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"step": int(step), "prompt_ids": [int(u) for u in prompt_ids]}) + "\n")

    # ------------------------------------------------------------------ the continuous loop
    def run(self, total_steps: int) -> dict:
        """Train until total_steps or stop(), continuously (in lockstep with rollout at max_staleness 0).

        Two helper threads keep the data plane off the trainer's critical path: one takes the batch for version
        V + 1 while step V trains (unless a benchmark turns it off: `prefetch_enabled`), and one ships each
        published snapshot and advances the buffer, one at a time and in order, while the next step trains. A
        batch still prefetched when the loop ends goes back to the buffer; the last publish completes first."""
        self.stop_event.clear()
        self.total_steps = total_steps
        wait_s = 0.5
        prefetch = prefetch_enabled()
        nxt = None
        shipping = None  # the publish in flight, if any

        def ship(version, snapshot, published):
            # one publish in flight: at most two snapshots exist (shipping, and this one), and a failed
            # publish or buffer update surfaces here, a step later
            nonlocal shipping
            if shipping is not None:
                shipping.result()
            shipping = shipper_pool.submit(self.ship, version, snapshot, published)

        try:
            with (
                ThreadPoolExecutor(1, thread_name_prefix="trainer-prefetch") as take_pool,
                ThreadPoolExecutor(1, thread_name_prefix="trainer-publish") as shipper_pool,
            ):
                try:
                    while self.trainer.step < total_steps and not self.stop_event.is_set():
                        t0 = time.perf_counter()
                        self.work_started = self.work_started or t0
                        fut = nxt or take_pool.submit(self.take, wait_s, self.trainer.version)
                        nxt = None
                        groups, bound = fut.result()
                        self.idle_s += time.perf_counter() - t0
                        if not groups:
                            continue
                        if prefetch and self.trainer.step + 1 < total_steps:
                            nxt = take_pool.submit(self.take, wait_s, self.trainer.version + 1)
                        self.train_on(groups, bound, t0, shipper=ship)
                except BaseException:
                    self._settle(shipping, nxt, quiet=True)  # the loop's own error is the one to report
                    raise
                self._settle(shipping, nxt, quiet=False)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        return self.stats()

    def _settle(self, shipping, prefetched, quiet: bool) -> None:
        """When the loop ends: wait for the publish in flight, then return a prefetched, untrained batch
        to the buffer so that the accounting still adds up. quiet: log failures instead of raising them."""

        def attempt(fn, what: str):
            try:
                return fn()
            except Exception as exc:
                if not quiet:
                    raise
                log.warning("%s failed while the trainer loop was ending: %s", what, exc)
                return None

        try:
            if shipping is not None:
                attempt(shipping.result, "a weights publish")
        finally:  # even when a publish failed: the accounting must still add up
            taken = attempt(prefetched.result, "the prefetched take") if prefetched is not None else None
            if taken and taken[0]:
                attempt(lambda: self.buffer.give_back(taken[0]), "the give-back")

    def stop(self) -> None:
        self.stop_event.set()

    def drain_metrics(self) -> list[dict]:
        out, self.metrics = self.metrics, []
        return out

    # ------------------------------------------------------------------ run state: the one writer and reader
    def checkpoint_if_due(self, total_steps: int) -> None:
        """At every exact multiple of checkpoint.every before total_steps (the host writes the last)."""
        every, step = self.cfg.checkpoint.every, self.trainer.step
        if not every or step % every or step >= total_steps or self.peer_state is None:
            return
        data, rollout_rng = self.peer_state()
        facts = dict(self.run_facts)
        missing = [i for i, s in enumerate(rollout_rng) if s is None]
        if missing:
            facts["rollout_rng_missing"] = missing
        path = checkpoint_dir(self.cfg.run.run_dir, step, under=self.checkpoint_root)
        self.checkpoint(str(path), data, rollout_rng, facts)
        self.checkpoints_written.append({"step": step, "path": str(path), "rollout_rng_missing": missing})

    def drain_checkpoints(self) -> list[dict]:
        """Checkpoints written since the last call: [{step, path, rollout_rng_missing}]."""
        out, self.checkpoints_written = self.checkpoints_written, []
        return out

    def checkpoint(self, path: str | Path, data: dict, rollout_rng: list, run: dict) -> str:
        """The one checkpoint layout: the trainer's weights, optimizer, versions and RNG, plus what the host
        gathered from the others (prompt queue position, rollout engines' RNG, run facts) and the bound in force
        (the autopilot's, when it is on: a resumed autopilot goes on from it)."""
        with self.lock:
            state = CheckpointState(
                trainer=self.call("state_dict"),
                data={**data, "trained": dict(self.trained)},  # exactly-once resume: what was trained on
                rng={"trainer": capture_rng(), "rollout": list(rollout_rng)},
                run={"max_staleness": self.bound, **run, "ledger": self.ledger()},
                config=self.cfg.model_dump(mode="json"),
            )
            if self.full_weights is None:
                return str(save_checkpoint(path, self.model, state))
            return str(save_checkpoint(path, self.trainer.model, state, weights=self.full_weights()))

    def restore(self, path: str | Path) -> CheckpointState:
        """Validate the whole checkpoint, then restore weights, optimizer, versions and RNG; returns the state
        for the host (prompt queue position, rollout RNG, run facts)."""
        with self.lock:
            state = load_checkpoint(path, self.trainer.model, critic=self.trainer.critic)
            self.trainer.load_state_dict(state.trainer)
            restore_rng(state.rng["trainer"])
            if state.resumed_bound(self.cfg) is not None:
                self.bound = state.resumed_bound(self.cfg)
            self.ledger_carried = dict(state.run.get("ledger") or {})
        return state

    def ledger(self) -> dict:
        """The token ledger now (the buffer's side and this trainer's), for a checkpoint: a run resumed from it
        goes on from these accounts ({} when the buffer does not measure)."""
        trained = {"trained_rows": self.rows_trained, "trained_tokens": self.tokens_trained}
        return token_ledger(self.buffer.stats(), {**trained, "ledger_carried": self.ledger_carried})

    def set_trained(self, trained: dict) -> None:
        """The prompts trained on so far (uid -> times), as a resumed run's prompt queue restored them."""
        with self.lock:
            self.trained = {int(k): int(v) for k, v in trained.items()}

    def stats(self) -> dict:
        s = self.trainer.stats()
        s.update(
            {
                "idle_s": self.idle_s,
                "busy_frac": busy_fraction(s["busy_s"], self.work_started),
                "error": self.error,
                "staleness_hist": dict(self.staleness_hist),
                "consecutive_skips": self.trainer.consecutive_skips,
                "groups_trained": self.groups_trained,
                "trained_tokens": self.tokens_trained,
                "trained_rows": self.rows_trained,
                "ledger_carried": self.ledger_carried,
                "seed": self.seed,
                **self.model_facts(),
            }
        )
        return s

    def model_facts(self) -> dict:
        """What the run audit checks of the trained model, computed once: its bytes (a LoRA sync ships far fewer)
        and the largest dropout left active in it (the trainer turns dropout off)."""
        if self._model_facts is None:
            params = list(self.model.parameters()) if isinstance(self.model, torch.nn.Module) else []
            self._model_facts = {"model_bytes": sum(p.numel() * p.element_size() for p in params)} if params else {}
            if params:
                self._model_facts["dropout_max"] = dropout_max(self.model)
        return self._model_facts
