"""The prompt queue: prompts waiting for a rollout worker, served from the seeded, resumable prompt source.

Plain Python: the single-process loop uses it directly and the Ray runtime makes it an actor as it is
(`ray.remote(PromptQueue)`). Importing this module imports no torch (and no Ray): the queue holds no
tensors, so its actor process never loads it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Optional

from rlhf_core.config.base import PRIORITY_FLOOR
from rlhf_core.data.prompts import Prompt, prompt_source

log = logging.getLogger("rlhf_core.data")


def queue_options(cfg) -> dict:
    """A run config's PromptQueue arguments after its prompts, the same on every host (`PromptQueue(prompts,
    **queue_options(cfg))`, or the Ray actor's `.remote(prompts, **queue_options(cfg))`)."""
    return dict(seed=cfg.data.seed, sampler=cfg.data.sampler, floor=cfg.data.priority_floor)


class PromptQueue:
    """Prompts waiting for a rollout worker. The flow schedules (`top_up`); when it does not, `get`
    refills from the seeded source itself, so the loop never waits on the flow.

    Leases (a worker in its own process, which can die with a batch in hand): `get(n, holder, batch)` records
    the prompts as held by `holder` (one incarnation of one worker) for its batch number `batch`. A worker's
    batches are pushed in order with at most one push in flight, so asking for batch b means batches before
    b - 1 were pushed: their leases are dropped then. When the holder is lost, `requeue(holder, after)` puts
    the prompts of its batches after `after` (the last batch the experience buffer accepted from it) back at
    the front of the queue: generated again, never scored as failures, never trained twice.

    sampler, floor: data.sampler and data.priority_floor (`prompt_source`): 'epochs' serves seeded shuffled
    epochs; 'prioritized' draws by how far from solved each prompt last was, from the group rewards the rollout
    reports (`observe`)."""

    def __init__(self, prompts: list[Prompt], seed: int, sampler: str = "epochs", floor: float = PRIORITY_FLOOR):
        self.source = prompt_source(prompts, seed=seed, sampler=sampler, floor=floor)
        self.by_uid = {p.uid: p for p in prompts}
        self.queue: deque[Prompt] = deque()
        self.lock = threading.Lock()
        self.scheduled = 0
        self.served = 0
        self.leases: dict[str, dict[int, list[Prompt]]] = {}
        self.requeued = 0

    def top_up(self, n: int) -> int:
        """Schedule n prompts ahead of the workers' requests. A prioritized source draws nothing ahead: it draws
        when a worker asks (`get`), by the newest successes (at max_staleness 0 every host then draws the same)."""
        if self.source.sampler == "prioritized":
            return 0
        with self.lock:
            new = self.source.next(n)
            self.queue.extend(new)
            self.scheduled += len(new)
            return len(new)

    def get(
        self, n: int, holder: Optional[str] = None, batch: int = 0, settled: Optional[list[int]] = None
    ) -> list[Prompt]:
        """n prompts, leased to `holder` under lease number `batch`. settled: the holder's leases known done
        (a worker whose groups end out of order: environment episodes streamed); None: the holder's batches
        end in order, so leases before batch - 1 are done."""
        with self.lock:
            if len(self.queue) < n:
                new = self.source.next(n - len(self.queue))
                self.queue.extend(new)
                self.scheduled += len(new)
            out = [self.queue.popleft() for _ in range(min(n, len(self.queue)))]
            self.served += len(out)
            if holder is not None:
                held = self.leases.setdefault(holder, {})
                done = [b for b in held if b < batch - 1] if settled is None else settled
                for b in done:
                    held.pop(b, None)
                held[batch] = out
            return out

    def observe(self, scores: dict[int, float]) -> None:
        """The rollout's pushed groups: prompt uid -> the group's mean reward (what a prioritized source draws by)."""
        with self.lock:
            self.source.observe(scores)

    def holders(self, prefix: str = "") -> list[str]:
        """The holders with leases recorded (a worker's incarnations are named '<index>-<id>')."""
        with self.lock:
            return [h for h in self.leases if h.startswith(prefix)]

    def leased(self, holder: str) -> list[int]:
        """The batch numbers `holder` holds leases for (the newest not known to be delivered)."""
        with self.lock:
            return sorted(self.leases.get(holder, {}))

    def requeue(self, holder: str, after: int, settled: Sequence[int] = ()) -> int:
        """The holder is gone: its prompts of batches after `after` (but those `settled`: delivered or failed out
        of order) go back to the front of the queue, in their order; its lease ends. Returns how many prompts
        went back."""
        done = set(settled)
        with self.lock:
            held = self.leases.pop(holder, {})
            back = [p for b in sorted(held) if b > after and b not in done for p in held[b]]
            self.queue.extendleft(reversed(back))
            self.requeued += len(back)
            return len(back)

    def size(self) -> int:
        return len(self.queue)

    def stats(self) -> dict:
        out = {
            "queued": len(self.queue),
            "scheduled": self.scheduled,
            "served": self.served,
            "requeued": self.requeued,
            "epoch": self.source.epoch,
        }
        if self.source.sampler == "prioritized":
            out["solved_frac"] = self.source.solved_frac()
        return out

    def state_dict(self) -> dict:
        with self.lock:
            return {"source": self.source.state_dict(), "queued": [p.uid for p in self.queue]}

    def load_state_dict(self, state: dict) -> dict[int, int]:
        """Restore from a checkpoint's data state. With its record of trained prompts (`trained`: uid -> times
        trained on) the source serves exactly the prompts not yet trained on, epoch by epoch: what was queued,
        buffered or in flight at the checkpoint is served again, nothing trained on is. Without it (a checkpoint
        written before that record existed) the saved position and queue are restored as they were.
        Returns the trained counts to go on from (for the old layout: estimated from the position)."""
        with self.lock:
            saved = state["source"].get("sampler", "epochs")
            if saved != self.source.sampler:  # data.sampler changed between the runs: the new one starts afresh
                log.warning(
                    "this checkpoint's prompts were served by data.sampler=%s, this run's by %s: the new sampler "
                    "starts from its beginning",
                    saved,
                    self.source.sampler,
                )
                self.queue = deque()
                return {int(k): int(v) for k, v in (state.get("trained") or {}).items()}
            self.source.load_state_dict(state["source"])
            trained = state.get("trained")
            if trained is not None:
                self.queue = deque()
                self.source.resume_trained(trained, state["source"]["epoch"])
                return dict(trained)
            log.warning(
                "this checkpoint has no record of the prompts trained on (written before exactly-once resume): "
                "resuming from its data position; groups buffered or in flight when it was written are not "
                "regenerated"
            )
            self.queue = deque(self.by_uid[u] for u in state["queued"])
            return self.source.trained_estimate([p.uid for p in self.queue])
