"""The rollout worker's cycle, written once and Ray-free (see rlhf_core/run/roles.py for the two roles together)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from rlhf_core.run.control import busy_fraction

log = logging.getLogger("rlhf_core.run")


class RolloutRole:
    """The rollout worker's cycle over a `RolloutWorker`: admit -> prompts -> adopt weights -> generate -> push.

    Peers: buffer (try_admit, release, push), queue (get; observe, under data.sampler 'prioritized'), store
    (fetch_if_newer, poll_newer).

    holder: this worker incarnation's name where it can be lost (its own process): its prompts are leased
    batch by batch and its pushes carry the batch number, so that a lost worker's prompts are generated again
    (`PromptQueue.requeue`, `ExperienceBuffer.revoke`). None in one process."""

    def __init__(self, cfg, worker, buffer, queue, store, index: int = 0, holder: Optional[str] = None):
        self.cfg, self.worker, self.index, self.holder = cfg, worker, index, holder
        self.batches = 0  # batches asked for (the lease numbers)
        self.buffer, self.queue, self.store = buffer, queue, store
        self.stop_event = threading.Event()
        self.syncs: list[dict] = []
        self.groups_pushed = 0
        self.pushed_by_holder: dict = {}  # lease name -> groups pushed under it (reconcile leaves revoked ones out)
        self.pending_push = None  # (future, n_groups, holder) of a push not yet confirmed (the continuous loop only)
        self._push_pool = None  # the loop's push thread, made on first use
        # seconds outside generation, by phase (stats: per batch): where the rollout's cycle goes
        self.phase_s = {"weights": 0.0, "prompts": 0.0, "split": 0.0, "push": 0.0}
        self.work_started: Optional[float] = None  # wall clock of the first batch: busy_frac's denominator
        self.loop_running = False

    def adopt_weights(self) -> bool:
        """Between batches: adopt the newest published weights if they are newer than ours."""
        asked = time.perf_counter()
        found = self.store.fetch_if_newer(self.worker.version)
        if found is None:
            self.phase_s["weights"] += time.perf_counter() - asked
            return False
        version, state_dict = found
        fetched = time.perf_counter()
        self.worker.load_weights(state_dict, version)
        done = time.perf_counter()
        self.syncs.append(
            {"version": version, "fetch_s": fetched - asked, "load_s": done - fetched, "stall_s": done - asked}
        )
        self.phase_s["weights"] += done - asked
        return True

    def _between_steps(self):
        """Partial rollouts: called by the engine between decode steps (and by the environment runner between
        a trajectory's turns). Returns (state_dict, version) when newer weights are published, else None; the
        store answers without waiting (`poll_newer`), so this costs nothing while there is nothing new."""
        start = time.perf_counter()
        found = self.store.poll_newer(self.worker.version)
        if found is None:
            return None
        version, state_dict = found
        fetched = time.perf_counter()
        self.syncs.append(
            {
                "version": version,
                "fetch_s": fetched - start,
                "load_s": 0.0,
                "stall_s": fetched - start,
                "mid_batch": True,
            }
        )
        return state_dict, version

    def ask_prompts(self, n_prompts: int, settled: Optional[list[int]] = None):
        """Send the request for the next batch's prompts (leased to this holder under the next batch number).
        settled: the leases done since the last request, when they end out of order (streamed episodes)."""
        self.batches += 1
        if self.holder is None:
            return self.queue.submit("get", n_prompts)
        if settled is not None:
            return self.queue.submit("get", n_prompts, self.holder, self.batches, settled)
        return self.queue.submit("get", n_prompts, self.holder, self.batches)

    def _push(self, groups: list, batch: int):
        if self.cfg.data.sampler != "epochs":  # the prompt queue draws by the rewards the rollout saw
            self.queue.submit("observe", {g.prompt_id: g.reward for g in groups})
        if self.holder is None:
            return self.buffer.push(groups)
        return self.buffer.push(groups, self.holder, batch)

    def _admit(self, n: int):
        if self.holder is None:
            return self.buffer.submit("try_admit", n)
        return self.buffer.submit("try_admit", n, 1, self.holder)

    def _release(self, n: int, lease: Optional[int] = None) -> None:
        """Free n admitted groups; lease: the batch they were leased under, when it ends with nothing pushed."""
        if self.holder is None:
            self.buffer.release(n)
        elif lease is not None:
            self.buffer.release(n, self.holder, lease)
        else:
            self.buffer.release(n, self.holder)

    def generate(self, n_prompts: int, prompts_call=None, wait: bool = True) -> int:
        """Take n prompts, generate, score, push. Returns the groups generated.

        wait=False (the continuous loop) pushes on a helper thread and waits only for the previous push: at
        most one push is in flight, pushes stay in order, and a failed push surfaces a batch later.
        prompts_call: a prompt-queue request already sent by `ask_prompts` (the loop sends it beside the weights
        check)."""
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        prompts = (prompts_call or self.ask_prompts(n_prompts)).result()
        batch = self.batches  # this batch's lease number (the next one is asked for before this push lands)
        t1 = time.perf_counter()
        self.phase_s["prompts"] += t1 - t0
        if not prompts:
            return 0
        busy_before = self.worker.busy_s
        between_steps = self._between_steps if self.cfg.rollout.partial_rollout else None
        groups = self.worker.generate_groups(prompts, between_steps=between_steps)
        t2 = time.perf_counter()
        self.phase_s["split"] += (t2 - t1) - (self.worker.busy_s - busy_before)  # what generate_groups adds
        self.confirm_push()
        if wait:
            self._push(groups, batch)
            self._count_push(len(groups), self.holder)
        else:
            if self._push_pool is None:
                self._push_pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-push")
            self.pending_push = (self._push_pool.submit(self._push, groups, batch), len(groups), self.holder)
        self.phase_s["push"] += time.perf_counter() - t2
        return len(groups)

    def confirm_push(self) -> None:
        """Wait for the push in flight, if any, and count its groups."""
        if self.pending_push is not None:
            future, n_groups, holder = self.pending_push
            self.pending_push = None
            future.result()  # a failed push surfaces here, a batch later
            self._count_push(n_groups, holder)

    def _count_push(self, n_groups: int, holder) -> None:
        self.groups_pushed += n_groups
        if holder is not None:
            self.pushed_by_holder[holder] = self.pushed_by_holder.get(holder, 0) + n_groups

    def _batch(self, admitted, overlap: bool):
        """The rollout cycle, written once: wait for `admitted` (the admission future), load the newest weights,
        generate, release what was not made. Returns (whether a batch was generated, the next admission in flight).
        `overlap` (the continuous loop): the prompt request goes out beside the weights check and the next batch's
        admission before this batch generates, so its answer is waiting when generation ends."""
        n = self.cfg.rollout.prompts_per_batch
        t0 = time.perf_counter()
        granted = admitted.result()
        self.worker.add_idle(time.perf_counter() - t0)
        if not granted:
            return False, None
        prompts = self.ask_prompts(granted) if overlap else None
        self.adopt_weights()  # admitted against version v: weights >= v are published, load them
        following = self._admit(n) if overlap else None
        try:
            made = self.generate(granted, prompts_call=prompts, wait=not overlap)
        except BaseException:
            if following is not None:
                self._release_unused(following, n)
            raise
        if made < granted:  # groups an environment failed (or prompts that ran out): their admission is free again
            self._release(granted - made, self.batches if not made else None)
        return True, following

    def step(self) -> bool:
        """One batch, whole: False when admission refuses it (the buffer holds what the bound allows). A batch is
        rollout.prompts_per_batch prompts, or fewer when admission has room for fewer."""
        return self._batch(self._admit(self.cfg.rollout.prompts_per_batch), overlap=False)[0]

    def run(self) -> dict:
        """Generate continuously until stop() (`_batch` with its overlap); idle time (admission denied, weights
        loading) is counted. The staleness bound does not rest on admission (the buffer evicts
        and the trainer checks), and the batch still loads the newest weights when it starts; what an
        early grant can cost is one batch generated after a pause or a lowered bound. A grant the loop
        does not use is released when it ends."""
        self.stop_event.clear()
        self.loop_running = True
        if self.worker.env is not None:  # environment episodes: no batch barrier (rollout_stream.py)
            from rlhf_core.run.rollout_stream import run_streaming

            self.work_started = self.work_started or time.perf_counter()
            try:
                run_streaming(self)
            finally:
                self.loop_running = False
            return self.stats()
        n = self.cfg.rollout.prompts_per_batch
        admit = None
        try:
            while not self.stop_event.is_set():
                admitted, admit = admit or self._admit(n), None
                generated, admit = self._batch(admitted, overlap=True)
                if not generated:
                    t0 = time.perf_counter()
                    self.stop_event.wait(0.005)
                    self.worker.add_idle(time.perf_counter() - t0)
            self.confirm_push()
        finally:
            self.loop_running = False
            if admit is not None:
                self._release_unused(admit, n)
        return self.stats()

    def _release_unused(self, admit, n: int) -> None:
        """Return a grant for a batch that will not be generated, so the capacity stays exact (best effort:
        the loop may be ending because the buffer is unreachable)."""
        try:
            granted = admit.result()
            if granted:
                self._release(granted)
        except Exception as exc:
            log.warning("rollout worker %d could not release an unused admission: %s", self.index, exc)

    def stop(self) -> None:
        self.stop_event.set()

    def stats(self) -> dict:
        s = self.worker.stats()
        stalls = [x["stall_s"] for x in self.syncs]
        batches = s["batches"]
        s.update(
            {
                "index": self.index,
                "groups_pushed": self.groups_pushed,
                "pushed_by_holder": dict(self.pushed_by_holder),
                "syncs": len(self.syncs),
                "syncs_mid_batch": sum(1 for x in self.syncs if x.get("mid_batch")),
                "sync_stall_s_mean": sum(stalls) / len(stalls) if stalls else 0.0,
                "sync_stall_s_max": max(stalls) if stalls else 0.0,
                "batch_s_mean": s["busy_s"] / batches if batches else 0.0,
                "phase_s_per_batch": {k: v / batches if batches else 0.0 for k, v in self.phase_s.items()},
                "loop_running": self.loop_running,
                "busy_frac": busy_fraction(s["busy_s"], self.work_started),
            }
        )
        return s
